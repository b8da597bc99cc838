"""Real sweeps on CPU/gloo: they complete, skip what cannot run, measure a bubble that behaves, survive hangs."""

from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import time

import pytest

from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.run import sweep_workload
from tests.unit.test_cli import mbtune

pytestmark = pytest.mark.integration


def test_small_sweep_json_parses_and_skips_with_reasons():
    result = mbtune("sweep", "-w", "mlp", "-O", "layers=2", "-O", "width=64", "-d", "cpu", "-p", "2",
                    "--schedules", "gpipe,1f1b", "-m", "1,2,4", "--accum", "1,2", "--micro-batch-size", "4",
                    "--steps", "2", "--format", "json", "--no-save")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    statuses = [r["status"] for r in report["results"]]
    assert statuses == ["ok"] * 10
    assert [s["point"]["num_micro_batches"] for s in report["skipped"]] == [1, 1]
    assert "1f1b needs at least as many micro-batches" in report["skipped"][0]["reason"]
    best = report["results"][report["ranking"][0]]
    assert best["samples_per_s"] == max(r["samples_per_s"] for r in report["results"])
    for r in report["results"]:
        p = r["point"]
        assert r["bubble_theoretical"] == pytest.approx(1 / (p["num_micro_batches"] + 1))
        assert 0 <= r["bubble_measured"] < 1 and len(r["peak_memory_bytes"]) == 2
        idle = r["idle"]
        assert min(idle.values()) >= 0 and sum(idle.values()) == pytest.approx(r["bubble_measured"], abs=1e-6)
        kinds = {a["kind"] for a in r["timeline"]}
        assert {"forward", "backward"} <= kinds
        assert r["nvml"]["available"] is False  # no GPU driver here: reported, not fatal


def test_data_parallel_points_run_every_replica_and_time_the_all_reduce():
    result = mbtune("sweep", "-w", "mlp", "-O", "layers=2", "-O", "width=64", "-d", "cpu", "-p", "2",
                    "--schedules", "1f1b", "-m", "2", "--accum", "1", "--data-parallel", "1,2", "--global-batch", "16",
                    "--steps", "2", "--format", "json", "--no-save")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_dp = {r["point"]["data_parallel_size"]: r for r in report["results"]}
    assert sorted(by_dp) == [1, 2] and all(r["status"] == "ok" for r in by_dp.values())
    assert by_dp[1]["point"]["micro_batch_size"] == 8 and by_dp[2]["point"]["micro_batch_size"] == 4
    assert by_dp[1]["allreduce_s"] is None
    replicated = by_dp[2]
    assert 0 < replicated["allreduce_s"] < replicated["step_time_median_s"]
    assert replicated["ran_as"].startswith("4 process(es)") and len(replicated["peak_memory_bytes"]) == 2
    reduces = [a for a in replicated["timeline"] if a["kind"] == "allreduce"]
    assert sorted(a["rank"] for a in reduces) == [0, 1]  # one per pipeline rank, after its share of the pipeline
    for a in reduces:
        compute_end = max(c["end_s"] for c in replicated["timeline"] if c["rank"] == a["rank"] and c is not a
                          and c["kind"] != "allreduce")
        assert compute_end <= a["start_s"] < a["end_s"]


def test_gpipe_bubble_is_measured_at_each_micro_batch_count():
    # What the bubble measures at each m (and that it falls with m, by timing) is bench/sweep.py's bubble table:
    # on a busy machine one point's bubble can differ by more than the fall from m=2 to m=8, so the test
    # asserts what holds by construction.
    config = SweepConfig(workload="mlp", workload_options=(("layers", 4), ("width", 512)), device="cpu",
                         num_ranks=2, schedules=("gpipe",), micro_batches=(2, 8), grad_accum_steps=(1,),
                         micro_batch_size=64, measured_steps=3, threads=1)
    report = sweep_workload(config)
    by_m = {r.point.num_micro_batches: r for r in report.results}
    assert all(r.ok for r in by_m.values()), [r.error for r in by_m.values()]
    assert not any("states no spread" in w for w in report.warnings)  # three steps state one
    assert by_m[8].bubble_theoretical < by_m[2].bubble_theoretical
    for result in by_m.values():
        assert 0 <= result.bubble_measured < 1
        # A pipeline of two ranks with one stage each always has some schedule idle (the fill of rank 1 and
        # the drain of rank 0).
        assert result.idle.schedule > 0


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


@pytest.mark.slow
def test_hung_rank_is_killed_and_the_sweep_goes_on(tmp_path):
    marker = tmp_path / "hang-once"
    config = SweepConfig(workload="tests.fixtures.workloads:hang_once", workload_options=(("marker", str(marker)),),
                         device="cpu", num_ranks=2, schedules=("gpipe",), micro_batches=(2, 4), grad_accum_steps=(1,),
                         micro_batch_size=2, measured_steps=1, point_timeout_s=15, threads=1)
    started = time.monotonic()
    report = sweep_workload(config)
    assert [r.status for r in report.results] == ["timeout", "ok"]
    assert "still running after 15 s" in report.results[0].error
    assert time.monotonic() - started < 90
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert server is None or _children_of(server) == []


def test_ctrl_c_keeps_finished_points_and_exits_130(tmp_path):
    import signal
    import subprocess
    import sys

    from tests.unit.test_cli import ROOT, SCRATCH

    command = [sys.executable, "-m", "mbtune", "sweep", "-w", "mlp", "-O", "layers=2", "-O", "width=64", "-d", "cpu",
               "-p", "2", "--schedules", "gpipe", "-m", "2,4,8,16,32", "--accum", "1,2,4", "--micro-batch-size", "4",
               "--steps", "20", "--profiles-dir", str(tmp_path)]
    process = subprocess.Popen(command, cwd=SCRATCH, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)})
    seen = ""
    while "trial 2:" not in seen:  # the line for the first finished point, then the second starts
        line = process.stderr.readline()
        assert line, f"mbtune ended early: {seen}"
        seen += line
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "interrupted" in stdout
    [saved] = tmp_path.glob("cpu-*/mlp.json")
    sweep = json.loads(saved.read_text())["sweep"]
    assert sweep["interrupted"] is True
    assert 1 <= len(sweep["results"]) < 15 and all(r["status"] == "ok" for r in sweep["results"])


def test_sweep_takes_the_safe_batch_from_the_saved_probe(tmp_path):
    quick = ["-w", "mlp", "-O", "layers=2", "-O", "width=64", "-d", "cpu", "--profiles-dir", str(tmp_path)]
    assert mbtune("probe", *quick, "--max-batch", "16", "--threads", "1").returncode == 0
    result = mbtune("sweep", *quick, "--schedules", "gpipe", "-m", "2,4", "--accum", "1", "--steps", "1",
                    "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["safe_batch"] == 13 and report["ceiling"] == 16
    # The global batch is held at the default: the largest power of two 2 micro-batches hold at 13 (16),
    # split every way the grid allows, each micro-batch size within the safe batch.
    assert report["global_batches"] == [16] and report["global_batch_default"] is True
    assert {r["point"]["micro_batch_size"] for r in report["results"]} == {8, 4}
    assert any("bounded by the safe batch 13" in w for w in report["warnings"])
    assert any("--steps 1, --repeats 1) states no spread" in w for w in report["warnings"])
    too_big = mbtune("sweep", *quick, "--schedules", "gpipe", "-m", "2", "--accum", "1", "--micro-batch-size", "32",
                     "--format", "json", "--no-save")
    skipped = json.loads(too_big.stdout)["skipped"]
    assert skipped[0]["reason"] == "micro-batch size 32 is above the probed safe batch 13"
    profile = json.loads(next(tmp_path.glob("cpu-*/mlp.json")).read_text())
    assert profile["probe"]["ceiling"] == 16 and profile["sweep"]["results"]  # one profile holds both


def test_the_sweep_itself_reads_no_profile(monkeypatch):
    import mbtune.saving.profiles
    from mbtune.sweeping.config import SweepConfig
    from mbtune.sweeping.run import sweep_workload

    def refuse(path):
        raise AssertionError(f"the sweep read {path}")

    monkeypatch.setattr(mbtune.saving.profiles, "load_profile", refuse)
    config = SweepConfig(workload="mlp", workload_options=(("layers", 2), ("width", 32)), device="cpu", num_ranks=2,
                         schedules=("gpipe",), micro_batches=(2,), grad_accum_steps=(1,), micro_batch_size=2,
                         measured_steps=1, safe_batch=None)
    [result] = sweep_workload(config).results
    assert result.ok, result.error
