"""Qualification checks, specs, JUnit and comparisons: pure logic on synthetic records."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from mbtune.errors import ConfigError
from mbtune.pipeline.point import SweepPoint
from mbtune.qualifying.compare import check_same_device, compare_profiles
from mbtune.qualifying.judge import (
    AGGREGATE,
    BEST,
    EXIT_INCONCLUSIVE,
    against_baseline,
    against_thresholds,
    exit_code,
    judge,
    run_errors,
)
from mbtune.qualifying.records import CHECK_ERROR, FAIL, INCONCLUSIVE, PASS, Check, Verdict
from mbtune.qualifying.spec import QualifySpec
from mbtune.qualifying.specfile import load_spec, read_spec
from mbtune.records import DeviceInfo
from mbtune.report.qualify import PER_POINT_TITLE, junit_xml, per_point_table, verdict_table
from mbtune.saving.profiles import Metadata, Profile
from mbtune.sweeping.ranking import rank_results
from mbtune.sweeping.records import PointResult, SweepReport
from tests.unit.test_records import sample_probe
from tests.unit.test_report import render, sweep_report


def statuses(checks) -> dict[str, str]:
    return {c.name: c.status for c in checks}


def grid(rates, *, spread=0.0, repeats=3) -> SweepReport:
    """A sweep of one point per rate (gpipe, m = 1, 2, ...), each with samples/s min-max of +-spread/2."""
    results = []
    for m, rate in enumerate(rates, start=1):
        point = SweepPoint(schedule="gpipe", num_ranks=2, num_micro_batches=m, grad_accum_steps=1, micro_batch_size=4)
        results.append(PointResult(point=point, status="ok", samples_per_s=rate, num_repeats=repeats,
                                   samples_per_s_min=rate * (1 - spread / 2), samples_per_s_max=rate * (1 + spread / 2)))
    ranking, pareto = rank_results(results, "throughput")
    return SweepReport(workload="mlp", device=DeviceInfo(backend="cpu", name="Test CPU"), objective="throughput",
                       results=tuple(results), ranking=ranking, pareto=pareto, repeats=repeats)


def verdict_of(checks) -> Verdict:
    return Verdict(checks=tuple(checks), tolerance=0.1)


def test_same_results_pass_and_shortfalls_beyond_tolerance_fail():
    probe, sweep = sample_probe(), sweep_report()
    assert set(statuses(against_baseline(probe, sweep, probe, sweep, tolerance=0.1)).values()) == {"PASS"}
    worse_probe = replace(probe, ceiling=3, first_failing=4, safe_batch=3)  # 75% and 100% of baseline
    slower = replace(sweep, results=tuple(replace(r, samples_per_s=r.samples_per_s * 0.85) if r.ok else r
                                          for r in sweep.results))
    checks = against_baseline(probe, sweep, worse_probe, slower, tolerance=0.1)
    got = statuses(checks)
    assert got["ceiling"] == "FAIL" and got["safe batch"] == "PASS"
    assert got[BEST] == "FAIL" and got[AGGREGATE] == "FAIL"
    assert got["throughput 1f1b p=2 m=4 accum=1 mbs=4"] == "FAIL"
    assert [c.name for c in checks if not c.gating] == ["throughput gpipe p=2 m=2 accum=1 mbs=4",
                                                         "throughput 1f1b p=2 m=4 accum=1 mbs=4"]
    assert statuses(against_baseline(probe, sweep, worse_probe, slower, tolerance=0.3))["ceiling"] == "PASS"


def test_one_noisy_point_cannot_fail_the_verdict():
    rates = [100.0 + i for i in range(30)]
    baseline = grid(rates, spread=0.04)
    now = grid([r * 0.5 if i == 3 else r for i, r in enumerate(rates)], spread=0.04)
    checks = against_baseline(None, baseline, None, now, tolerance=0.1)
    got = {c.name: c for c in checks}
    noisy = got["throughput gpipe p=2 m=4 accum=1 mbs=4"]
    assert noisy.status == FAIL and not noisy.gating
    assert got[AGGREGATE].gating and got[AGGREGATE].status == PASS and got[BEST].status == PASS
    assert verdict_of(checks).status == PASS


def test_the_aggregate_fails_when_every_point_is_slower():
    rates = [100.0, 120.0, 140.0, 90.0]
    checks = against_baseline(None, grid(rates, spread=0.05), None, grid([r * 0.7 for r in rates], spread=0.05),
                              tolerance=0.1)
    aggregate = next(c for c in checks if c.name == AGGREGATE)
    assert aggregate.status == FAIL and aggregate.gating and aggregate.measured == pytest.approx(0.7)
    # Every ratio the same, so no scatter: the spread is the points' own 5% on each side, combined in
    # quadrature (the ratio's), averaged over 4 points.
    assert aggregate.spread_pct == pytest.approx(5 * 2**0.5 / 2)
    assert verdict_of(checks).status == FAIL


def test_a_spread_wider_than_the_tolerance_is_inconclusive_with_its_figures():
    rates = [100.0, 150.0]
    checks = against_baseline(None, grid(rates, spread=0.05), None, grid([r * 0.95 for r in rates], spread=0.34),
                              tolerance=0.1)
    best = next(c for c in checks if c.name == BEST)
    assert best.status == INCONCLUSIVE and best.spread_pct == pytest.approx(100 * (0.05**2 + 0.34**2) ** 0.5)
    assert "spread 34% (baseline, over 3 repeats; now, over 3 repeats) is wider than the 10% tolerance" in best.detail
    assert verdict_of(checks).status == INCONCLUSIVE


def test_a_shortfall_beyond_a_wide_spread_still_fails():
    rates = [100.0, 150.0, 120.0]
    checks = against_baseline(None, grid(rates, spread=0.05), None, grid([r * 0.5 for r in rates], spread=0.3),
                              tolerance=0.1)
    best = next(c for c in checks if c.name == BEST)
    assert best.status == FAIL and "short by more than the spread 30%" in best.detail


def test_a_shortfall_measured_on_a_busy_machine_is_inconclusive_not_fail():
    from mbtune.records import MachineLoad

    rates = [100.0, 150.0, 120.0]
    load = MachineLoad(other_cpu_share=0.7, num_cpus=2, busy=True, reason="other processes took 70% of the 2 CPUs")
    slow = grid([r * 0.5 for r in rates], spread=0.05)
    busy = replace(slow, results=tuple(replace(r, load=load) for r in slow.results))
    got = {c.name: c for c in against_baseline(None, grid(rates, spread=0.05), None, busy, tolerance=0.1)}
    assert got[BEST].status == INCONCLUSIVE and "other processes took 70%" in got[BEST].detail
    assert got[AGGREGATE].status == INCONCLUSIVE and "3 of 3 points" in got[AGGREGATE].detail
    one_busy = replace(slow, results=(replace(slow.results[0], load=load),) + slow.results[1:])
    got = {c.name: c for c in against_baseline(None, grid(rates, spread=0.05), None, one_busy, tolerance=0.1)}
    assert got[AGGREGATE].status == FAIL and got[BEST].status == FAIL  # the fastest point ran on a quiet machine
    light = replace(load, other_cpu_share=0.3, reason="other processes took 30% of the 2 CPUs")
    much_slower = grid([r * 0.2 for r in rates], spread=0.05)
    much_slower = replace(much_slower, results=tuple(replace(r, load=light) for r in much_slower.results))
    got = statuses(against_baseline(None, grid(rates, spread=0.05), None, much_slower, tolerance=0.1))
    assert got[BEST] == FAIL and got[AGGREGATE] == FAIL  # more than a 30% load can explain


def test_judge_decides_against_the_spread():
    from mbtune.qualifying.spreads import Spread

    wide = Spread(share=0.2, basis="now, over 3 repeats")
    assert judge("x", 95.0, 90.0, rule="", spread=wide, tolerance=0.1).status == INCONCLUSIVE
    assert judge("x", 200.0, 90.0, rule="", spread=wide, tolerance=0.1).status == PASS  # clears the low end
    assert judge("x", 60.0, 90.0, rule="", spread=wide, tolerance=0.1).status == FAIL
    narrow = Spread(share=0.05, basis="baseline, over 3 steps")
    assert judge("x", 91.0, 90.0, rule="", spread=narrow, tolerance=0.1).status == PASS
    assert judge("x", 88.0, 90.0, rule="", spread=narrow, tolerance=0.1).status == INCONCLUSIVE  # within spread
    assert judge("x", 80.0, 90.0, rule="", spread=narrow, tolerance=0.1).status == FAIL
    unknown = judge("x", 80.0, 90.0, rule="")
    assert unknown.status == FAIL and unknown.spread_pct is None and "spread unknown" in unknown.detail
    assert judge("x", 0.4, 0.5, rule="", upper=True).status == PASS
    assert judge("x", 0.6, 0.5, rule="", upper=True).status == FAIL
    assert judge("x", None, 0.5, rule="").status == CHECK_ERROR


def test_a_ceiling_bracket_wider_than_the_tolerance_is_inconclusive():
    probe = replace(sample_probe(), ceiling=100, first_failing=130, safe_batch=85)
    now = replace(probe, ceiling=95, first_failing=96)
    got = {c.name: c for c in against_baseline(probe, None, now, None, tolerance=0.1)}
    assert got["ceiling"].status == INCONCLUSIVE and got["ceiling"].spread_pct == pytest.approx(29.0)
    assert "fits at 100, fails at 130" in got["ceiling"].detail
    exact = {c.name: c.status for c in against_baseline(now, None, now, None, tolerance=0.1)}
    assert exact == {"ceiling": PASS, "safe batch": PASS}


def test_verdict_status_orders_error_fail_inconclusive_pass_over_gating_checks_only():
    def check(status, gating=True):
        return Check(name=status, status=status, gating=gating)

    assert verdict_of([check(PASS)]).status == PASS
    assert verdict_of([check(PASS), check(INCONCLUSIVE)]).status == INCONCLUSIVE
    assert verdict_of([check(INCONCLUSIVE), check(FAIL)]).status == FAIL
    assert verdict_of([check(FAIL), check(CHECK_ERROR), check(INCONCLUSIVE)]).status == CHECK_ERROR
    assert verdict_of([check(PASS), check(FAIL, gating=False), check(CHECK_ERROR, gating=False)]).status == PASS
    assert [exit_code(s) for s in (PASS, FAIL, CHECK_ERROR, INCONCLUSIVE)] == [0, 1, 3, EXIT_INCONCLUSIVE]
    assert EXIT_INCONCLUSIVE == 4


def test_junit_skips_inconclusive_and_non_gating_checks():
    checks = (Check(name="ceiling", status=PASS, measured=4, rule=">= 90% of baseline 4"),
              Check(name=BEST, status=INCONCLUSIVE, measured=95.0, rule=">= 90% of baseline 100.0", spread_pct=34.0,
                    detail="spread 34% (now, over 3 repeats) is wider than the 10% tolerance"),
              Check(name="throughput gpipe", status=FAIL, measured=50.0, rule=">= 90% of baseline 100.0",
                    gating=False))
    verdict = Verdict(checks=checks, device=sample_probe().device, baseline="base.json", tolerance=0.1, repeats=3)
    root = ET.fromstring(junit_xml(verdict))
    suite = root.find("testsuite")
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) == ("3", "0", "0", None)
    assert suite.get("skipped") == "2"
    cases = {c.get("name"): c for c in root.findall("./testsuite/testcase")}
    skipped = cases[BEST].find("skipped")
    assert skipped is not None and skipped.get("message").startswith("INCONCLUSIVE: measured 95, expected >= 90%")
    assert "spread 34.0%" in skipped.get("message") and "wider than the 10% tolerance" in skipped.get("message")
    assert cases["throughput gpipe"].find("failure") is None
    assert cases["throughput gpipe"].find("skipped").get("message").startswith("not gating: FAIL")
    assert cases["ceiling"].find("skipped") is None


def test_report_shows_spread_and_per_point_rows_apart_and_json_keeps_them():
    rates = [100.0, 150.0]
    checks = against_baseline(None, grid(rates, spread=0.05), None, grid(rates, spread=0.05), tolerance=0.1)
    verdict = verdict_of(checks)
    main = render(verdict_table(verdict), 200)
    header = next(line for line in main.splitlines() if line.strip().startswith("check"))
    assert header.split() == ["check", "status", "measured", "expected", "spread", "detail"]
    assert "throughput gpipe" not in main and AGGREGATE in main and "verdict: PASS" in main
    points = render(per_point_table(verdict), 200)
    assert PER_POINT_TITLE in points and "throughput gpipe p=2 m=2 accum=1 mbs=4" in points and "7.1%" in points
    data = json.loads(json.dumps(verdict.to_dict()))
    assert [c["gating"] for c in data["checks"]] == [True, True, False, False]
    assert Verdict.from_dict(data) == verdict


def test_points_skipped_now_fail_and_crashes_are_errors_once():
    probe, sweep = sample_probe(), sweep_report()
    crashed = replace(sweep.results[1], status="error", error="rank 0: boom", samples_per_s=None)
    now = replace(sweep, results=(crashed,), skipped=(), ranking=(), pareto=())
    checks = against_baseline(probe, sweep, probe, now, tolerance=0.1) + run_errors(None, now)
    got = statuses(checks)
    assert got["throughput gpipe p=2 m=2 accum=1 mbs=4"] == "FAIL"  # not run here
    assert "throughput 1f1b p=2 m=4 accum=1 mbs=4" not in got
    assert got["ran 1f1b p=2 m=4 accum=1 mbs=4"] == "ERROR" and got["probe ran"] == "PASS"
    assert statuses(run_errors("no CUDA device", None)) == {"probe ran": "ERROR"}


def test_absolute_thresholds():
    got = statuses(against_thresholds({"min_ceiling": 5, "min_safe_batch": 2, "min_best_samples_per_s": 100,
                                        "max_best_bubble": 0.2}, sample_probe(), sweep_report()))
    assert got == {"ceiling": "FAIL", "safe batch": "PASS", "best throughput": "PASS",
                   "best point's measured bubble": "FAIL"}


def test_verdict_status_and_junit_failures_and_errors():
    probe, sweep = sample_probe(), sweep_report()
    checks = tuple(against_thresholds({"min_ceiling": 5}, probe, sweep) + run_errors("killed by SIGKILL", None))
    verdict = Verdict(checks=checks, device=probe.device, baseline="base.json", tolerance=0.1)
    assert verdict.status == "ERROR"
    root = ET.fromstring(junit_xml(verdict))
    assert root.get("tests") == "2" and root.get("failures") == "1" and root.get("errors") == "1"
    cases = root.findall("./testsuite/testcase")
    assert [c.get("name") for c in cases] == ["ceiling", "probe ran"]
    assert cases[0].find("failure") is not None and cases[1].find("error").get("message") == "killed by SIGKILL"
    assert Verdict(checks=checks[:1]).status == "FAIL"


def test_spec_from_toml(tmp_path):
    spec_path = tmp_path / "ci" / "qualify.toml"
    spec_path.parent.mkdir()
    spec_path.write_text('workload = "mlp"\ndevice = "cpu"\nmemory_budget = "512MiB"\ntolerance = "5%"\n'
                         'baseline = "../profiles/base.json"\n[options]\nlayers = 2\n[probe]\ngranularity = 8\n'
                         '[sweep]\nstages = 2\nschedules = ["gpipe"]\nmicro_batches = [2, 4]\naccum = [1]\n'
                         '[thresholds]\nmin_ceiling = 100\n')
    spec = load_spec(spec_path)
    assert spec.tolerance == 0.05 and spec.thresholds == (("min_ceiling", 100.0),)
    assert spec.baseline == str((tmp_path / "profiles" / "base.json").resolve())
    assert spec.probe.memory_budget_bytes == 512 * 2**20 and spec.probe.granularity == 8
    assert spec.probe.workload_options == (("layers", 2),)
    assert spec.sweep.num_ranks == 2 and spec.sweep.micro_batches == (2, 4) and spec.sweep.grad_accum_steps == (1,)
    assert load_spec(spec_path, tolerance=0.2).tolerance == 0.2  # the flag wins


def test_spec_repeats_flag_file_and_default(tmp_path, monkeypatch):
    path = tmp_path / "q.toml"
    path.write_text('baseline = "base.json"\n')
    monkeypatch.delenv("MBTUNE_REPEATS", raising=False)
    assert read_spec(path).repeats is None  # until known
    monkeypatch.setenv("MBTUNE_REPEATS", "3")
    assert read_spec(path).repeats == 3
    path.write_text('baseline = "base.json"\nrepeats = 5\n')
    assert read_spec(path).repeats == 5 and read_spec(path, repeats=2).repeats == 2
    path.write_text('workload = "mlp"\ndevice = "cpu"\n[sweep]\nstages = 1\nrepeats = 4\n')
    loaded = read_spec(path)
    assert loaded.repeats == 4 and loaded.spec.sweep.repeats == 4
    path.write_text('baseline = "base.json"\nrepeats = 0\n')
    with pytest.raises(ConfigError, match="repeats=0"):
        read_spec(path)


@pytest.mark.parametrize(("text", "message"), [
    ("workload = 'mlp'\nspeed = 3\n", "unknown key"),
    ("workload = 'mlp'\n[probe]\nmargins = 0.1\n", r"\[probe\] in the spec"),
    ("workload = 'mlp'\n[thresholds]\nmin_speed = 1\n", "thresholds"),
    ("workload = [", "not valid TOML"),
    ("tolerance = '10%'\n", "nothing to qualify against"),
])
def test_bad_specs_are_clear(tmp_path, text, message):
    path = tmp_path / "q.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_spec(path)


def test_no_baseline_and_no_spec_is_bad_input():
    with pytest.raises(ConfigError, match="nothing to qualify against"):
        QualifySpec()


def test_compare_profiles_and_device_refusal():
    meta = Metadata(mbtune_version="0", torch_version="0", python_version="0", host="h", platform="p",
                    command_line="", created_at="")
    a = Profile(schema_version=1, metadata=meta, probe=sample_probe(), sweep=sweep_report())
    faster = replace(sweep_report(), results=tuple(
        replace(r, samples_per_s=r.samples_per_s * 2) if r.ok else r for r in sweep_report().results))
    b = replace(a, sweep=faster)
    rows = {r.quantity: r for r in compare_profiles(a, b)}
    assert rows["ceiling"].ratio == 1.0 and rows["best throughput (samples/s)"].ratio == 2.0
    assert rows["samples/s gpipe p=2 m=2 accum=1 mbs=4"].ratio == 2.0
    with pytest.raises(ConfigError, match="different devices"):
        check_same_device("cuda: NVIDIA H200", "cuda: NVIDIA A100", allow=False, what="the profiles")
    check_same_device("cuda: NVIDIA H200", "cuda: NVIDIA A100", allow=True, what="the profiles")
    assert isinstance(sweep_report().results[0], PointResult)


def test_pooled_ratios_narrow_as_agreeing_points_add_up_and_widen_when_they_disagree():
    from mbtune.qualifying.spreads import Spread, pool_ratios

    own = [Spread(share=0.08, basis="x")] * 4
    mean, agree = pool_ratios([0.0, 0.0, 0.0, 0.0], own)
    assert mean == 0.0 and agree.share == pytest.approx(0.04) and "agree within" in agree.basis
    mean, disagree = pool_ratios([-0.3, 0.3, -0.3, 0.3], own)
    assert mean == pytest.approx(0.0) and disagree.share > 0.2 and "scatter" in disagree.basis
    # Where they agree within their intervals, a precise point outweighs a vague one.
    mean, _ = pool_ratios([0.0, -0.05], [Spread(share=0.01, basis="x"), Spread(share=0.2, basis="x")])
    assert -0.001 < mean < 0


def test_pooled_ratios_without_their_own_intervals_fall_back_to_their_scatter():
    from mbtune.intervals import t975
    from mbtune.qualifying.spreads import pool_ratios

    logs = [0.1, 0.0, -0.1]
    mean, spread = pool_ratios(logs, [None, None, None])
    assert mean == pytest.approx(0.0) and spread.share == pytest.approx(t975(2) * 0.1 / 3**0.5)
    assert pool_ratios([0.1, -0.1], [None, None])[1] is None


def test_a_baseline_is_re_run_with_its_own_precision_optimizer_and_learning_rate():
    from mbtune.qualifying.run import _qualify_configs

    meta = Metadata(mbtune_version="0", torch_version="0", python_version="0", host="h", platform="p",
                    command_line="", created_at="")
    sweep = replace(sweep_report(), precision="bf16", optimizer="sgd", lr=0.01, measured_steps=4, warmup_steps=2)
    baseline = Profile(schema_version=1, metadata=meta, probe=sample_probe(), sweep=sweep)
    _, config = _qualify_configs(QualifySpec(baseline="b.json"), baseline, repeats=None)
    assert (config.precision, config.optimizer, config.lr) == ("bf16", "sgd", 0.01)
    assert (config.measured_steps, config.warmup_steps) == (4, 2)
    assert config.points == tuple(r.point for r in sweep.results if r.ok)


def test_an_inconclusive_check_names_the_spread_that_would_decide_it():
    wide = judge("x", 95.0, 90.0, rule="", spread=_spread(0.2), tolerance=0.1)  # above the bound, too wide
    assert wide.status == INCONCLUSIVE and "a spread under 10.0% would pass it (about 4.0x the measurements)" in wide.detail
    short = judge("x", 85.0, 90.0, rule="", spread=_spread(0.08), tolerance=0.1)  # short by less than 8%
    assert short.status == INCONCLUSIVE and "a spread under 5.9% would fail it (about 1.8x" in short.detail
    # The figure that would decide it, decides it: the same measurement with that spread.
    assert judge("x", 85.0, 90.0, rule="", spread=_spread(0.058), tolerance=0.1).status == FAIL
    assert judge("x", 95.0, 90.0, rule="", spread=_spread(0.1), tolerance=0.1).status == PASS


def _spread(share: float):
    from mbtune.qualifying.spreads import Spread

    return Spread(share=share, basis="x")


def test_a_baseline_of_the_users_own_command_is_re_run_with_that_command():
    from mbtune.qualifying.run import _qualify_configs

    meta = Metadata(mbtune_version="0", torch_version="0", python_version="0", host="h", platform="p",
                    command_line="", created_at="")
    command = ("torchrun", "--nproc-per-node", "{stages}", "train.py", "--batch-size", "{batch}", "--lr", "{lr}")
    report = sweep_report()
    points = tuple(replace(r, point=replace(r.point, grid=(("lr", "1e-4"),))) for r in report.results)
    sweep = replace(report, workload="train", command=command, grid=(("lr", ("1e-4", "3e-4")),),
                    steps_from_output=r"^step \d+", results=points)
    probe = replace(sample_probe(), workload="train", command=("python", "train.py", "--batch-size", "{batch}"))
    baseline = Profile(schema_version=1, metadata=meta, probe=probe, sweep=sweep)
    probe_config, config = _qualify_configs(QualifySpec(baseline="b.json"), baseline, repeats=None)
    assert probe_config.command == probe.command
    assert config.command == command and config.grid == sweep.grid and config.steps_from_output == r"^step \d+"
    assert config.workload == "train" and all(p.grid == (("lr", "1e-4"),) for p in config.points)
