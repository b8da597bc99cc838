"""Qualification checks, specs, JUnit and comparisons: pure logic on synthetic records."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from mbtune.config import QualifySpec
from mbtune.errors import ConfigError
from mbtune.qualify import against_baseline, against_thresholds, check_same_device, compare_profiles, run_errors
from mbtune.records import Metadata, Profile, TrialResult, Verdict
from mbtune.report.qualify import junit_xml
from mbtune.specfile import load_spec
from tests.unit.test_records import sample_probe
from tests.unit.test_report import sweep_report


def statuses(checks) -> dict[str, str]:
    return {c.name: c.status for c in checks}


def test_same_results_pass_and_shortfalls_beyond_tolerance_fail():
    probe, sweep = sample_probe(), sweep_report()
    assert set(statuses(against_baseline(probe, sweep, probe, sweep, tolerance=0.1)).values()) == {"PASS"}
    worse_probe = replace(probe, ceiling=3, safe_batch=3)  # 75% and 100% of baseline
    slower = replace(sweep, results=tuple(replace(r, samples_per_s=r.samples_per_s * 0.85) if r.ok else r
                                          for r in sweep.results))
    got = statuses(against_baseline(probe, sweep, worse_probe, slower, tolerance=0.1))
    assert got["ceiling"] == "FAIL" and got["safe batch"] == "PASS"
    assert got["best throughput (samples/s)"] == "FAIL"
    assert got["throughput 1f1b p=2 m=4 accum=1 mbs=4"] == "FAIL"
    assert statuses(against_baseline(probe, sweep, worse_probe, slower, tolerance=0.3))["ceiling"] == "PASS"


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


def test_verdict_status_and_junit():
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
    assert spec.sweep.num_stages == 2 and spec.sweep.micro_batches == (2, 4) and spec.sweep.accum_steps == (1,)
    assert load_spec(spec_path, tolerance=0.2).tolerance == 0.2  # the flag wins


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
    assert isinstance(sweep_report().results[0], TrialResult)
