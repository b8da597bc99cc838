"""`mbtune confirm --duration` on CUDA: the run's allocated high-water mark over time, the evaluation pass that
raised it named, and the caching allocator's retries and fragmentation read from torch.cuda.memory_stats."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mbtune.probing.confirm import FITS, ConfirmConfig, confirm_command
from mbtune.probing.high_water import EVALUATION

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

EVAL_LOOP = str(Path(__file__).parents[1] / "fixtures" / "train_scripts" / "eval_loop.py")
MIB = 2**20
# Under a 256 MiB fraction: 100 MiB freed into the cache, then 200 MiB asked for: the allocator must free its
# cache and try again (a retry). A 20 MiB block freed, then 8 MiB taken from it: 12 MiB left in a split block
# (fragmentation), held while the sampler reads it and at the end.
RETRY_AND_SPLIT = """
import time, torch
x = torch.empty(100 * 2**20, dtype=torch.uint8, device="cuda"); del x
y = torch.empty(200 * 2**20, dtype=torch.uint8, device="cuda"); del y
a = torch.empty(20 * 2**20, dtype=torch.uint8, device="cuda"); del a
b = torch.empty(8 * 2**20, dtype=torch.uint8, device="cuda")
time.sleep(1.5)
"""


def test_a_cuda_run_reports_its_allocators_retries_and_fragmentation() -> None:
    result = confirm_command(ConfirmConfig(command=(sys.executable, "-c", RETRY_AND_SPLIT),
                                           memory_budget_bytes=256 * MIB, runs=1, device="cuda"))
    run = result.runs[0]
    memory = run.high_water
    assert run.outcome == FITS and memory is not None, run.output_tail
    assert memory.num_alloc_retries is not None and memory.num_alloc_retries >= 1
    assert memory.max_inactive_split_bytes is not None and memory.max_inactive_split_bytes >= 8 * MIB
    assert memory.max_unallocated_reserved_bytes is not None and memory.max_unallocated_reserved_bytes >= 8 * MIB
    assert memory.max_reserved_bytes is not None and memory.max_reserved_bytes >= 200 * MIB
    assert memory.peak_bytes >= 200 * MIB


def test_a_cuda_run_for_a_duration_names_the_evaluation_pass_that_raised_its_peak() -> None:
    result = confirm_command(ConfirmConfig(
        command=(sys.executable, EVAL_LOOP, "--batch-size", "64", "--eval-batch-size", "65536", "--width", "256",
                 "--eval-every", "20", "--device", "cuda"),
        memory_budget_bytes=2 << 30, device="cuda", duration_s=15.0))
    run = result.runs[0]
    memory = run.high_water
    assert (run.outcome, run.stopped) == (FITS, True) and memory is not None, run.output_tail
    assert memory.rose and memory.largest_rise is not None and memory.largest_rise.during == EVALUATION
    assert memory.num_evaluations >= 1 and memory.num_alloc_retries is not None
