"""`mbtune plan` without a profile on a machine with a GPU: the ranks are traced on fake CPU tensors in forked
workers, whatever the workload's loading asked of CUDA (skipped where no CUDA device is visible)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mbtune.planning.memory_plan import MemoryPlanConfig, plan_memory

pytestmark = pytest.mark.gpu


def test_a_workload_that_starts_cuda_while_loading_is_planned_in_forked_workers():
    config = MemoryPlanConfig(workload="tests.fixtures.workloads:cuda_at_load", device_memory_bytes=256 * 2**20,
                              num_ranks=2, schedules=("1f1b",), micro_batches=(2,), workers=2)
    forked, alone = plan_memory(config), plan_memory(replace(config, workers=1))
    assert forked.rows[0].micro_batch_size >= 1
    assert (forked.rows[0].micro_batch_size, forked.rows[0].peak_bytes) == \
        (alone.rows[0].micro_batch_size, alone.rows[0].peak_bytes)
