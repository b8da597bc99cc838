"""`mbtune qualify` and `mbtune compare` end to end on CPU: verdicts, JUnit files and exit codes."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from tests.unit.test_cli import mbtune

pytestmark = pytest.mark.integration

TINY = ["-w", "mlp", "-O", "layers=1", "-O", "width=32", "-d", "cpu"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("baseline")
    made = mbtune("tune", *TINY, "--max-batch", "32", "--schedules", "gpipe", "-m", "2", "--accum", "1",
                  "--steps", "2", "--profiles-dir", str(root))
    assert made.returncode == 0, made.stderr
    [path] = root.glob("cpu-*/mlp.json")
    return path


def junit(path):
    root = ET.parse(path).getroot()
    return int(root.get("tests")), int(root.get("failures")), int(root.get("errors"))


def test_requalifying_the_same_machine_gives_a_verdict_its_exit_code_and_junit(baseline, tmp_path):
    # Throughput on a shared machine moves a lot between runs, so whether a self-qualification is PASS or
    # INCONCLUSIVE is the machine's noise: assert the mechanics and what holds by construction. The ceiling
    # stopped at --max-batch both times, so it matches exactly.
    result = mbtune("qualify", "--baseline", str(baseline), "--tolerance", "90%", "--repeats", "2",
                    "--junit", str(tmp_path / "q.xml"), "--profiles-dir", str(tmp_path / "runs"), "--format", "json")
    verdict = json.loads(result.stdout)
    assert verdict["status"] in ("PASS", "INCONCLUSIVE"), result.stdout + result.stderr
    assert result.returncode == {"PASS": 0, "INCONCLUSIVE": 4}[verdict["status"]]
    assert verdict["repeats"] == 2
    checks = {c["name"]: c for c in verdict["checks"]}
    assert list(checks) == ["probe ran", "ceiling", "safe batch", "best throughput (samples/s)",
                            "throughput, all common points (geometric mean of now/baseline ratios)",
                            "throughput gpipe p=2 m=2 accum=1 mbs=16",  # global batch 32 (the default rule at safe batch 27)
                            "machine state against the baseline"]
    assert checks["ceiling"]["status"] == "PASS" and checks["ceiling"]["spread_pct"] == 0.0
    assert [c["gating"] for c in checks.values()] == [True] * 5 + [False, False]
    # The state it ran in, recorded by the baseline's tune and by this run, read from this machine's /proc.
    assert verdict["state"]["num_samples"] >= 2 and verdict["state"]["versions"]["torch"]
    assert verdict["state"]["gpus"] == []
    # The run is the first of its history, beside the measurements; too few runs to name a step.
    assert verdict["run"] == 1 and verdict["changes"] == []
    [kept] = (tmp_path / "runs" / "history").glob("*/mlp-*.json")
    assert verdict["history"] == str(kept)
    assert [r["status"] for r in json.loads(kept.read_text())["runs"]] == [verdict["status"]]
    tests, failures, errors = junit(tmp_path / "q.xml")
    assert (tests, failures, errors) == (len(checks), 0, 0)
    assert list((tmp_path / "runs").glob("cpu-*/mlp.json"))  # measured results saved apart from the baseline

    compared = mbtune("compare", str(baseline), str(next((tmp_path / "runs").glob("cpu-*/mlp.json"))))
    assert compared.returncode == 0 and "B / A" in compared.stdout and "ceiling" in compared.stdout


def test_a_spread_no_measurement_can_decide_is_inconclusive_exit_4(baseline, tmp_path):
    # A baseline point whose samples/s is known to within a billion-fold (its 95% interval, and its range
    # for a record without one): no throughput measured now, at any load, can clear or miss its bound by
    # more than that, so the throughput checks are INCONCLUSIVE by construction.
    wide = tmp_path / "wide.json"
    data = json.loads(baseline.read_text())
    for result in data["sweep"]["results"]:
        result["samples_per_s_min"], result["samples_per_s_max"] = 0.0, 1e9
        result["ci_half_pct"] = 1e11
    wide.write_text(json.dumps(data))
    result = mbtune("qualify", "--baseline", str(wide), "--repeats", "1", "--junit", str(tmp_path / "q.xml"),
                    "--no-save", "--format", "json")
    assert result.returncode == 4, result.stdout + result.stderr
    verdict = json.loads(result.stdout)
    best = next(c for c in verdict["checks"] if c["name"] == "best throughput (samples/s)")
    assert verdict["status"] == "INCONCLUSIVE" and best["status"] == "INCONCLUSIVE"
    assert "is wider than the 10% tolerance" in best["detail"]
    skipped = ET.parse(tmp_path / "q.xml").getroot().find(".//testcase[@name='best throughput (samples/s)']/skipped")
    assert skipped is not None and skipped.get("message").startswith("INCONCLUSIVE")


def test_a_missed_threshold_fails_with_exit_1(baseline, tmp_path):
    spec = tmp_path / "qualify.toml"
    spec.write_text(f'baseline = "{baseline}"\ntolerance = "90%"\n[thresholds]\nmin_ceiling = 1000\n')
    result = mbtune("qualify", "--spec", str(spec), "--junit", str(tmp_path / "q.xml"), "--no-save")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL" in result.stdout
    tests, failures, errors = junit(tmp_path / "q.xml")
    assert failures == 1 and errors == 0


def test_a_baseline_from_another_device_is_refused_unless_allowed(baseline, tmp_path):
    other = tmp_path / "other.json"
    data = json.loads(baseline.read_text())
    data["probe"]["device"]["name"] = "Some Other CPU Model"
    other.write_text(json.dumps(data))
    refused = mbtune("qualify", "--baseline", str(other), "--no-save")
    assert refused.returncode == 2 and "different devices" in refused.stderr
    assert "--allow-different-device" in refused.stderr
    allowed = mbtune("qualify", "--baseline", str(other), "--allow-different-device", "--tolerance", "90%",
                     "--no-save")
    assert allowed.returncode != 2, allowed.stderr


def test_no_device_is_an_error_exit_3_with_junit_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    spec = tmp_path / "qualify.toml"
    spec.write_text('workload = "mlp"\ndevice = "cuda"\n[thresholds]\nmin_ceiling = 1\n')
    result = mbtune("qualify", "--spec", str(spec), "--junit", str(tmp_path / "q.xml"), "--no-save")
    assert result.returncode == 3, result.stdout + result.stderr
    tests, failures, errors = junit(tmp_path / "q.xml")
    assert (tests, failures, errors) == (2, 0, 2)  # the probe could not run, so the ceiling was not measured
    assert "no CUDA device is visible" in ET.parse(tmp_path / "q.xml").getroot().find(".//error").get("message")


def test_corrupt_baseline_is_bad_input(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = mbtune("qualify", "--baseline", str(bad), "--no-save")
    assert result.returncode == 2 and "not readable JSON" in result.stderr


def test_a_damaged_history_is_refused_before_anything_is_measured(baseline, tmp_path):
    from mbtune.qualifying.history import history_path
    from mbtune.saving.profiles import load_profile

    kept = history_path(tmp_path / "runs", load_profile(baseline), str(baseline))
    kept.parent.mkdir(parents=True)
    kept.write_text("{ half a file")
    result = mbtune("qualify", "--baseline", str(baseline), "--repeats", "1", "--profiles-dir", str(tmp_path / "runs"))
    assert result.returncode == 2 and "is not readable JSON" in result.stderr and "Traceback" not in result.stderr
    assert kept.read_text() == "{ half a file"
    assert not list((tmp_path / "runs").glob("cpu-*"))  # nothing was measured
    skipped = mbtune("qualify", "--baseline", str(baseline), "--repeats", "1", "--tolerance", "90%",
                     "--profiles-dir", str(tmp_path / "runs"), "--no-history", "--format", "json")
    assert skipped.returncode in (0, 4) and json.loads(skipped.stdout)["history"] is None
