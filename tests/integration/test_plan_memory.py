"""`mbtune plan` without a profile, held against real pipelines: at the largest micro-batch size it gives,
every rank's measured peak fits the device memory; one sample more, the binding rank's does not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mbtune.pipeline.launch import run_pipeline_point
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.planning.memory_plan import MemoryPlanConfig, plan_memory

pytestmark = pytest.mark.integration

MEMORY = 256 * 2**20


def test_the_largest_micro_batch_fits_every_rank_and_one_more_does_not_fit_the_binding_one():
    plan = plan_memory(MemoryPlanConfig(workload="gpt", device_memory_bytes=MEMORY, num_ranks=2,
                                        schedules=("1f1b",), micro_batches=(4,)))
    [row] = plan.rows
    assert row.micro_batch_size >= 2 and row.binding_rank is not None
    spec = PipelineSpec(workload="gpt", schedule="1f1b", num_ranks=2, num_micro_batches=4,
                        micro_batch_size=row.micro_batch_size, measured_steps=1)
    fits, over = (run_pipeline_point(replace(spec, micro_batch_size=size), timeout_s=300)
                  for size in (row.micro_batch_size, row.micro_batch_size + 1))
    assert fits.ok and over.ok, (fits.error, over.error)
    assert all(peak is not None and peak <= MEMORY for peak in fits.peak_memory_bytes), fits.peak_memory_bytes
    assert over.peak_memory_bytes[row.binding_rank] > MEMORY, over.peak_memory_bytes
    assert list(fits.peak_memory_bytes) == list(row.peak_bytes)  # the same bytes, counted the same way


def test_a_configuration_that_cannot_run_is_named_not_planned():
    plan = plan_memory(MemoryPlanConfig(workload="gpt", device_memory_bytes=MEMORY, num_ranks=2,
                                        schedules=("1f1b",), micro_batches=(1,)))  # 1f1b needs m >= stages
    assert plan.rows[0].skipped and plan.rows[0].micro_batch_size == 0


def test_ranks_traced_in_forked_workers_predict_what_one_process_predicts():
    config = MemoryPlanConfig(workload="gpt", device_memory_bytes=MEMORY, num_ranks=2, schedules=("gpipe",),
                              micro_batches=(2,), recompute=("none", "full"))
    alone, forked = (plan_memory(replace(config, workers=workers)) for workers in (1, 2))
    assert [(r.micro_batch_size, r.peak_bytes, r.limits) for r in alone.rows] == \
        [(r.micro_batch_size, r.peak_bytes, r.limits) for r in forked.rows]
    assert all(row.micro_batch_size > 2 for row in alone.rows)  # the peaks shown were traced at that size
