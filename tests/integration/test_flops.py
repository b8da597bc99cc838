"""FLOPs counted for a user's workload in the facts child, where its import and factory already run under a
deadline (never in mbtune's own process, never inside a timed trial): a probe's and a sweep's, each checked
against the count made here on the meta device."""

from __future__ import annotations

import pytest

from mbtune.probing.config import ProbeConfig
from mbtune.probing.run import probe_workload
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.run import sweep_workload
from mbtune.workloads import load_workload
from mbtune.workloads.facts import workload_facts
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


def test_the_facts_child_counts_a_user_workloads_flops():
    options = (("flops_scale", 0.0),)  # options of its own: an answer no other test asked for
    facts = workload_facts(USER, options)
    assert facts.flops_counted == facts.flops_per_sample == counted(options)


def test_a_probe_reports_the_count_made_in_the_facts_child():
    result = probe()
    assert result.flops_per_sample == counted()
    assert not any("GFLOP per sample" in w for w in result.warnings)


def test_a_typed_figure_far_from_the_count_is_kept_with_a_warning():
    options = (("flops_scale", 2.0),)
    result = probe(options)
    typed = load_workload(USER, options).flops_per_sample
    assert result.flops_per_sample == typed != counted(options)
    warning = next(w for w in result.warnings if "GFLOP per sample" in w)
    assert f"{typed / counted(options) - 1:+.0%}" in warning


def test_a_sweep_computes_mfu_from_the_count(monkeypatch):
    import mbtune.device.peak_flops

    peak = 1e12  # a device this CPU is not: MFU is then a number to check
    monkeypatch.setattr(mbtune.device.peak_flops, "peak_flops", lambda name, precision: peak)
    config = SweepConfig(workload=USER, device="cpu", num_ranks=2, schedules=("gpipe",), micro_batches=(2,),
                         grad_accum_steps=(1,), micro_batch_size=1, measured_steps=1, threads=1)
    report = sweep_workload(config)
    [result] = report.results
    assert result.ok, result.error
    assert result.mfu_pct == pytest.approx(100 * counted() * result.samples_per_s / (peak * 2))


@pytest.mark.parametrize("kind", ["raise", "kill", "hang"])
def test_a_forward_the_meta_device_cannot_run_costs_the_count_not_the_load(kind):
    facts = workload_facts("tests.fixtures.workloads:meta_fault", (("kind", kind),), timeout_s=5.0)
    assert facts.num_blocks == 1 and facts.flops_counted is None and facts.flops_per_sample is None
    [warning] = facts.warnings
    assert "could not be counted" in warning and "MFU is unknown" in warning
