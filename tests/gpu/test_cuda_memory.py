"""CUDA memory: a trial's peak predicted on fake tensors against the allocator's, and `mbtune confirm`
holding a CUDA script to the per-process memory fraction (skipped where no CUDA device is visible)."""

from __future__ import annotations

import sys

import pytest

from mbtune.probing.config import TrialConfig
from mbtune.probing.confirm import FITS, OUT_OF_MEMORY, ConfirmConfig, confirm_command
from mbtune.probing.trial import run_trial
from mbtune.worker import run_isolated

pytestmark = pytest.mark.gpu

ALLOCATE = ("import sys, torch; kept = [torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda') "
            "for _ in range(4)]")


def _predicted(config: TrialConfig) -> int:
    from mbtune.probing.ceiling_prediction import predict_trial_peak

    return predict_trial_peak(config)


def test_a_cuda_trials_predicted_peak_is_near_its_allocated_peak():
    config = TrialConfig(workload="gpt", device="cuda:0", batch_size=16, precision="bf16")
    predicted = run_isolated(_predicted, config, timeout_s=300)
    measured = run_trial(config, timeout_s=300)
    assert predicted.status == "ok" and measured.ok, (predicted.error, measured.error)
    # The cuBLAS workspaces are added to the fake step's tensors; what is left is a few small buffers.
    error = (predicted.value - measured.peak_memory_bytes) / measured.peak_memory_bytes
    print(f"predicted {predicted.value}, allocated {measured.peak_memory_bytes}: {error:+.2%}")
    assert abs(error) < 0.05


def test_confirm_holds_a_cuda_script_to_the_memory_fraction():
    budget = 1 << 30
    fits = confirm_command(ConfirmConfig(
        command=[sys.executable, "-c", ALLOCATE, str(64 << 20)],
        memory_budget_bytes=budget, runs=1, device="cuda:0"))
    over = confirm_command(ConfirmConfig(
        command=[sys.executable, "-c", ALLOCATE, str(512 << 20)],
        memory_budget_bytes=budget, runs=1, device="cuda:0"))
    assert fits.runs[0].outcome == FITS and fits.runs[0].peak_bytes >= 4 * (64 << 20), fits
    assert over.runs[0].outcome == OUT_OF_MEMORY and over.exit_code == 1, over


def test_a_cuda_ranks_predicted_peak_is_near_its_allocated_peak():
    from mbtune.pipeline.launch import run_pipeline_point
    from mbtune.pipeline.point_spec import PipelineSpec
    from mbtune.pipeline.rank_memory import predict_rank_peaks

    spec = PipelineSpec(workload="gpt", schedule="1f1b", num_ranks=1, num_micro_batches=4, micro_batch_size=8,
                        measured_steps=1, device="cuda", precision="bf16")
    predicted = run_isolated(predict_rank_peaks, spec, timeout_s=300)
    measured = run_pipeline_point(spec, timeout_s=300)
    assert predicted.status == "ok" and measured.ok, (predicted.error, measured.error)
    [guess], [real] = predicted.value, measured.peak_memory_bytes
    print(f"predicted {guess}, allocated {real}: {(guess - real) / real:+.2%}")
    assert abs(guess - real) / real < 0.10
