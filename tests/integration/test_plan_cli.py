"""`mbtune sweep --strategy quick --plot --trace` and `mbtune plan` end to end on CPU."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_cli import mbtune

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    root = tmp_path_factory.mktemp("swept")
    result = mbtune("sweep", "-w", "mlp", "-O", "layers=2", "-O", "width=128", "-d", "cpu", "-p", "2",
                    "--schedules", "gpipe,1f1b,interleaved-1f1b", "-m", "2,4,8", "--accum", "1,2",
                    "--micro-batch-size", "16", "--steps", "2", "--strategy", "quick", "--plot", str(root / "plots"),
                    "--trace", str(root / "best.json"), "--profiles-dir", str(root / "profiles"), "--format", "json")
    assert result.returncode == 0, result.stderr
    return root, json.loads(result.stdout)


def test_quick_strategy_runs_part_of_the_grid_and_says_what_it_left(swept):
    _, report = swept
    ran, left = len(report["results"]), [s for s in report["skipped"] if s["reason"].startswith("not run (quick")]
    assert report["strategy"] == "quick" and report["num_grid_points"] == 18
    assert 3 <= ran <= 6 and ran + len(left) == 18  # at most a third of the grid
    assert any("quick strategy ran" in n for n in report["notes"])


def test_plots_and_trace_are_written(swept):
    root, report = swept
    for name in ("timeline.png", "throughput.png", "bubble.png", "memory.png"):
        path = root / "plots" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    trace = json.loads((root / "best.json").read_text())
    tracks = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e.get("ph") == "X"}
    best = report["results"][report["ranking"][0]]
    assert len(tracks) == len({a["stage"] for a in best["timeline"]}) == 2


def test_plan_predicts_beyond_the_machine_and_validates_on_what_ran(swept, tmp_path):
    root, _ = swept
    [profile] = (root / "profiles").glob("cpu-*/mlp.json")
    result = mbtune("plan", str(profile), "--stages", "8", "-m", "8,16", "--schedules", "gpipe,1f1b",
                    "--data-parallel", "4", "--blocks", "16", "--link-bandwidth", "50GB/s", "--link-latency", "5us",
                    "--format", "json", "--plot", str(tmp_path / "plots"), "--trace", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    predictions = plan["predictions"]
    assert {p["point"]["num_ranks"] for p in predictions} == {8} and len(predictions) == 4
    assert plan["recommended"] is not None
    assert all(p["point"]["data_parallel_size"] == 4 for p in predictions)
    assert plan["validation"]["rows"]  # predicted vs measured for the points the sweep ran
    summary = plan["summary"]
    assert summary["scatter"] == "measured" and summary["noise_floor_kind"] == "within-run"  # no --repeats
    assert summary["noise_floor_median"] is not None and summary["median_step_error_within_noise_floor"] is not None
    assert (tmp_path / "plots" / "plan_throughput.png").exists()
    tracks = {(e["pid"], e["tid"]) for e in json.loads((tmp_path / "plan.json").read_text())["traceEvents"]
              if e.get("ph") == "X"}
    assert len(tracks) == 8


def test_plan_without_scatter_says_so(swept):
    root, _ = swept
    [profile] = (root / "profiles").glob("cpu-*/mlp.json")
    result = mbtune("plan", str(profile), "--stages", "4", "-m", "4,8", "--schedules", "gpipe", "--scatter", "none",
                    "--validation", "none")
    assert result.returncode == 0, result.stderr
    assert "(scatter: none)" in result.stdout


def test_plan_bad_input_is_one_line(swept):
    root, _ = swept
    [profile] = (root / "profiles").glob("cpu-*/mlp.json")
    result = mbtune("plan", str(profile), "--link-bandwidth", "fast")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_cluster_plan_splits_the_gpus_every_way_for_the_global_batch(swept, tmp_path):
    root, _ = swept
    profile = next((root / "profiles").rglob("*.json"))
    result = mbtune("plan", str(profile), "--gpus", "8", "--global-batch", "64", "--blocks", "16",
                    "--device-memory", "1GiB", "--link-bandwidth", "10GB/s", "--validation", "none", "--format", "json",
                    "--plot", str(tmp_path))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["num_gpus"] == 8 and plan["num_candidates"] > plan["num_simulated"] >= len(plan["predictions"]) > 1
    for p in plan["predictions"]:
        point = p["point"]
        assert point["num_ranks"] * point["data_parallel_size"] == 8
        assert point["micro_batch_size"] * point["num_micro_batches"] * point["grad_accum_steps"] * point["data_parallel_size"] == 64
        assert p["memory_limit_bytes"] == 2**30
    assert plan["recommended"] == 0 and plan["predictions"][0]["lost_because"] == ""
    assert all(p["lost_because"] for p in plan["predictions"][1:])
    assert {r for r in plan["summary"]} >= {"recommended"}
    assert {"plan_depth.png", "plan_memory.png"} <= {p.name for p in tmp_path.iterdir()}
