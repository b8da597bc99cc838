"""FLOPs counted for a user's workload in its first trial, where its code runs anyway (never in the parent
or the facts child): a probe's and a sweep's, each checked against the count made here on the meta device."""

from __future__ import annotations

import pytest

from mbtune.probing.config import ProbeConfig
from mbtune.probing.run import probe_workload
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.run import sweep_workload
from mbtune.workloads import load_workload
from mbtune.workloads.flops import count_flops_per_sample

pytestmark = pytest.mark.integration

USER = "tests.fixtures.workloads:user_mlp"


def counted(options: tuple = ()) -> float:
    value = count_flops_per_sample(load_workload(USER, options))
    assert value is not None and value > 0
    return value


def probe(options: tuple = ()):
    return probe_workload(ProbeConfig(workload=USER, workload_options=options, device="cpu", max_batch=2,
                                      threads=1))


def test_a_probe_counts_a_user_workloads_flops_in_its_first_trial():
    result = probe()
    assert result.flops_per_sample == counted()
    # Only until one trial has counted them: the first, which ran.
    assert [t.flops_counted is not None for t in result.trials] == [True] + [False] * (len(result.trials) - 1)
    assert not any("GFLOP per sample" in w for w in result.warnings)


def test_a_typed_figure_far_from_the_count_is_kept_with_a_warning():
    options = (("flops_scale", 2.0),)
    result = probe(options)
    typed = load_workload(USER, options).flops_per_sample
    assert result.flops_per_sample == typed != counted(options)
    warning = next(w for w in result.warnings if "GFLOP per sample" in w)
    assert f"{typed / counted(options) - 1:+.0%}" in warning


def test_a_sweep_counts_them_in_its_first_point_that_ran():
    config = SweepConfig(workload=USER, device="cpu", num_ranks=2, schedules=("gpipe",), micro_batches=(2, 4),
                         grad_accum_steps=(1,), micro_batch_size=1, measured_steps=1, threads=1)
    report = sweep_workload(config)
    assert [r.status for r in report.results] == ["ok", "ok"]
    assert [r.flops_counted for r in report.results] == [counted(), None]
