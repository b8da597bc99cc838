"""bench/gpu_check.sh: it parses everywhere, and its CPU dry run goes through every step and writes the
summary JSON (the same steps the GPU run takes, on a tiny model)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def test_script_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_cpu_dry_run_writes_every_figure(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    result = subprocess.run([str(SCRIPT), "--cpu-dry-run"], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(result.stdout) == summary
    assert summary["mode"] == "cpu-dry-run" and summary["device"] == "cpu" and summary["ok"]
    assert set(summary["steps"]) == {"pytest", "probe-device", "probe-budget", "sweep", "warm-ranks", "confirm-memory",
                                     "sweep-command", "plan-memory"}
    # The 8B plan's line on a tiny model (a Llama where transformers and torch pipeline it, else the GPT): every
    # stage's peak, the size that fits.
    [row] = summary["plan_memory"]["rows"]
    assert row["micro_batch_size"] > 0 and len(row["peak_gib"]) == 8 and row["binding_rank"] is not None
    assert all(step["ok"] for step in summary["steps"].values()) and not summary["errors"]
    for key in ("probe_whole_device", "probe_budget"):
        probe = summary[key]
        assert {"ceiling", "safe_batch", "samples_per_s_at_safe_batch", "mfu_pct_at_safe_batch",
                "peak_memory_bytes_at_ceiling"} <= set(probe)
        assert probe["ceiling"] >= probe["safe_batch"] > 0
    [point] = summary["sweep"]["points"]
    assert point["status"] == "ok" and point["samples_per_s"] > 0
    assert {"mfu_pct", "step_time_median_s", "cuda_step_time_median_s", "cuda_over_wall", "peak_memory_bytes",
            "nvml", "load"} <= set(point)
    assert point["cuda_step_time_median_s"] is None and not point["nvml"]["available"]  # no GPU in a CPU run
    # Kept rank processes against fresh ones: the overhead of each, and the same point counting the same bytes.
    warm = summary["warm_ranks"]
    assert set(warm["overhead_s"]) == {"fresh", "kept"} and warm["sets_started"] == 1
    [kept] = warm["points"]
    assert kept["peak_memory_bytes"]["fresh"] == kept["peak_memory_bytes"]["kept"]
    # The confirm run's memory over time: the evaluation pass raised the mark; no allocator to retry on the CPU.
    confirm = summary["confirm_memory"]
    assert confirm["outcome"] == "fits" and confirm["stopped"] and confirm["num_evaluations"] >= 1
    assert confirm["rose"] and confirm["rises"] and confirm["num_alloc_retries"] is None
    # The user's pipelined command: its bubble timed by the cap; no GPU to sample in a CPU run.
    [mine] = summary["sweep_command"]["points"]
    assert mine["status"] == "ok" and mine["bubble_measured"] is not None and mine["bubble_unmeasured"] == ""
    assert not mine["nvml"]["available"]
    for name in ("probe-device.json", "probe-budget.json", "sweep.json", "confirm-memory.json", "sweep-command.json"):
        json.loads((out / name).read_text())


def test_an_unknown_argument_is_refused(tmp_path):
    result = subprocess.run([str(SCRIPT), "--no-such-flag"], capture_output=True, text=True,
                            env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert result.returncode == 2 and "unknown argument" in result.stderr
