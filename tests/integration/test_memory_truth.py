"""Memory answers held against what really runs: predictions against measured peaks, one size's outcome
the same in every fresh process, and a probe's safe batch in a training loop nobody here wrote for mbtune
(examples/nanogpt/train.py, a plain loop) under `mbtune confirm`."""

from __future__ import annotations

import sys

import pytest

from mbtune.cli import main
from mbtune.pipeline.launch import run_pipeline_point
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.probing.config import ProbeConfig, TrialConfig
from mbtune.probing.run import probe_workload
from mbtune.probing.trial import run_trial
from mbtune.worker import run_isolated

pytestmark = pytest.mark.integration

NANOGPT = "examples.nanogpt.workload:gpt"
BUDGET = 128 * 2**20


def _predicted_rank_peaks(spec: PipelineSpec) -> tuple[int, ...]:
    from mbtune.pipeline.rank_memory import predict_rank_peaks

    return predict_rank_peaks(spec)


def _predicted_trial_peak(config: TrialConfig) -> int:
    from mbtune.probing.ceiling_prediction import predict_trial_peak

    return predict_trial_peak(config)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved-1f1b", "zbv"])
def test_every_ranks_predicted_peak_is_the_peak_it_measures(schedule):
    spec = PipelineSpec(workload="gpt", schedule=schedule, num_ranks=2, num_micro_batches=4, micro_batch_size=2,
                        measured_steps=1)
    predicted = run_isolated(_predicted_rank_peaks, spec, timeout_s=300)
    measured = run_pipeline_point(spec, timeout_s=300)
    assert predicted.status == "ok" and measured.ok, (predicted.error, measured.error)
    for guess, real in zip(predicted.value, measured.peak_memory_bytes, strict=True):
        # The same bytes counted the same way: equal in every run measured; 1% leaves room for a Python
        # object cycle whose collection moves a free by a few operators.
        assert real is not None and abs(guess - real) <= 0.01 * real, (predicted.value, measured.peak_memory_bytes)


def test_a_trials_predicted_peak_is_the_peak_the_trial_measures():
    config = TrialConfig(workload=NANOGPT, batch_size=6, device="cpu", memory_budget_bytes=2**30, threads=1)
    predicted = run_isolated(_predicted_trial_peak, config, timeout_s=300)
    measured = run_trial(config, timeout_s=300)
    assert predicted.status == "ok" and measured.ok, (predicted.error, measured.error)
    assert abs(predicted.value - measured.budget_used_bytes) <= 0.01 * measured.budget_used_bytes


@pytest.fixture(scope="module")
def probed():
    return probe_workload(ProbeConfig(workload=NANOGPT, device="cpu", memory_budget_bytes=BUDGET, threads=1,
                                      resolution=1))


def test_the_probe_starts_from_the_prediction_and_confirms_it_in_a_few_trials(probed):
    assert probed.predicted is not None and probed.first_failing == probed.ceiling + 1
    if probed.predicted.ceiling == probed.ceiling:  # landed: the top, the size above it, the safe batch
        assert len(probed.trials) <= 4
    assert abs(probed.predicted.ceiling - probed.ceiling) <= 1, (probed.predicted, probed.ceiling)


def test_near_the_ceiling_a_size_fits_or_fails_the_same_way_in_every_fresh_process(probed):
    for size, expected in ((probed.ceiling, "ok"), (probed.ceiling + 1, "oom")):
        outcomes = {run_trial(TrialConfig(workload=NANOGPT, batch_size=size, device="cpu", memory_budget_bytes=BUDGET,
                                          threads=1), timeout_s=300).status for _ in range(2)}
        assert outcomes == {expected}, (size, outcomes)


def _confirm(batch: int, capsys) -> int:
    with pytest.raises(SystemExit) as ended:
        main(["-q", "confirm", "--memory-budget", "128MiB", "--runs", "2", "-d", "cpu", "-f", "json", "--",
              sys.executable, "-m", "examples.nanogpt.train", "--batch-size", str(batch)])
    capsys.readouterr()
    return int(ended.value.code or 0)


def test_the_safe_batch_fits_the_users_own_loop_and_fifteen_percent_over_the_ceiling_does_not(probed, capsys):
    assert _confirm(probed.safe_batch, capsys) == 0
    assert _confirm(int(probed.ceiling * 1.15) + 1, capsys) == 1
