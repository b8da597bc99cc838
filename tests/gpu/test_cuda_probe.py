"""Real CUDA trials and probe (marked gpu; skipped with a reason where no CUDA device is visible)."""

from __future__ import annotations

import pytest

from mbtune.probing.config import ProbeConfig, TrialConfig
from mbtune.probing.run import probe_workload
from mbtune.probing.trial import run_trial

pytestmark = pytest.mark.gpu


def test_cuda_trial_reports_allocator_peaks():
    outcome = run_trial(TrialConfig(workload="gpt", device="cuda:0", batch_size=8), timeout_s=300)
    assert outcome.status == "ok", outcome.error
    assert outcome.peak_memory_bytes > 0 and outcome.peak_reserved_bytes >= outcome.peak_memory_bytes
    assert outcome.device.backend == "cuda" and outcome.device.total_memory_bytes > 0


def test_cuda_oom_under_a_budget_is_classified_by_type():
    outcome = run_trial(TrialConfig(workload="gpt", device="cuda:0", batch_size=4096,
                                    memory_budget_bytes=512 * 2**20), timeout_s=300)
    assert outcome.status == "oom", outcome.error
    assert "OutOfMemoryError" in outcome.error or "out of memory" in outcome.error


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_probe_under_a_budget(precision):
    result = probe_workload(ProbeConfig(workload="gpt", device="cuda:0", memory_budget_bytes=2 * 2**30,
                                        granularity=8, precision=precision))
    assert result.ceiling >= 8 and result.ceiling % 8 == 0
    assert result.ceiling < result.first_failing <= result.ceiling + max(8, result.resolution or 8)
    assert result.safe_batch_verified
    assert result.memory_model is not None and result.memory_model.per_sample_bytes > 0
