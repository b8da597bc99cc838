"""`mbtune probe -- COMMAND` on CUDA: each trial's processes held to the per-process memory fraction on the
device LOCAL_RANK names, the steps counted by the optimizer-step hook, the peak read from the allocator."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mbtune.probing.command import CommandTrial, run_command_trial, search_command
from mbtune.records import OK, OOM

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCRIPT = str(Path(__file__).parents[1] / "fixtures" / "train_scripts" / "plain_loop.py")
COMMAND = (sys.executable, SCRIPT, "--batch-size", "{batch}", "--width", "1024", "--device", "cuda")
BUDGET = 1 << 30


def test_a_cuda_command_trial_fits_or_runs_out_of_memory_under_the_fraction() -> None:
    trial = CommandTrial(command=COMMAND, memory_budget_bytes=BUDGET, device="cuda", steps=3)
    small = run_command_trial(trial, 64)
    assert small.status == OK and small.peak_memory_bytes and small.peak_memory_bytes < BUDGET, small.error_tail
    assert len(small.step_times_s) == 3
    huge = run_command_trial(trial, 1 << 20)
    assert huge.status == OOM, huge.error_tail


def test_a_cuda_command_probe_brackets_its_ceiling() -> None:
    trial = CommandTrial(command=COMMAND, memory_budget_bytes=BUDGET, device="cuda", steps=3)
    found = search_command(trial, granularity=1024, resolution=1024, confirm=2)
    assert found.ceiling and found.first_failing == found.ceiling + 1024 and found.safe_batch
