"""Failures say what happened: a non-finite loss is its own status, a failed point names its rank, that
rank's blocks and its traceback, and a worker that never started is the harness's fault, not the workload's."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from rich.console import Console

from mbtune.errors import WorkloadBrokenError
from mbtune.probing.config import ProbeConfig, TrialConfig
from mbtune.probing.run import probe_workload
from mbtune.probing.trial import run_trial
from mbtune.report.profile import print_profile
from mbtune.report.sweep import failure_lines
from mbtune.saving.profiles import SCHEMA_VERSION, Metadata, Profile
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.records import PointResult
from mbtune.sweeping.run import sweep_workload
from mbtune.worker import run_isolated
from tests.unit.test_cli import ROOT, mbtune

pytestmark = pytest.mark.integration

FIXTURES = "tests.fixtures.workloads"


def _refuse_nan(text: str) -> float:
    raise AssertionError(f"non-finite number {text} in JSON")


def _two_stage_sweep(workload: str) -> SweepConfig:
    return SweepConfig(workload=f"{FIXTURES}:{workload}", device="cpu", num_ranks=2, schedules=("gpipe",),
                       micro_batches=(2,), grad_accum_steps=(1,), micro_batch_size=2, measured_steps=1, threads=1)


def _render_profile(report, *, errors: bool) -> str:
    meta = Metadata(mbtune_version="0", torch_version="0", python_version="3.11", host="h", platform="p",
                    command_line="mbtune sweep", created_at="now")
    profile = Profile(schema_version=SCHEMA_VERSION, metadata=meta, sweep=report)
    console = Console(file=io.StringIO(), width=160, color_system=None)
    print_profile(console, profile, "table", path="p.json", errors=errors)
    return console.file.getvalue()


def test_a_trial_names_the_block_that_failed():
    outcome = run_trial(TrialConfig(workload=f"{FIXTURES}:broken", batch_size=2, threads=1), timeout_s=60)
    assert outcome.status == "error"
    assert outcome.error.startswith("in block 0 (given the batch (2, 8) float32): ValueError: shape mismatch in user "
                                    "block"), outcome.error


def test_a_nan_loss_ends_the_trial_as_nonfinite_at_its_step():
    outcome = run_trial(TrialConfig(workload=f"{FIXTURES}:nan_loss", batch_size=2, threads=1), timeout_s=60)
    assert outcome.status == "nonfinite"
    assert outcome.error.startswith("the loss is nan at step 1: ")
    assert outcome.loss is None and outcome.error_kind == "workload"
    assert "NonFiniteLossError" in outcome.error_tail
    json.dumps(outcome.to_dict(), allow_nan=False)


def test_a_probe_of_a_loss_that_is_nan_from_the_first_step_is_a_workload_defect_not_an_oom():
    with pytest.raises(WorkloadBrokenError) as raised:
        probe_workload(ProbeConfig(workload=f"{FIXTURES}:nan_loss", device="cpu", max_batch=8, threads=1))
    assert re.fullmatch(r"the workload's loss is not finite in the first trial \(batch \d+\): the loss is nan at "
                        r"step 1", raised.value.message)
    assert "loss(outputs, targets)" in raised.value.hint and raised.value.exit_code == 2


def test_a_nan_loss_sweep_point_fails_with_its_reason_and_the_json_stays_valid():
    # Micro-batches of 4 (m=1) give a NaN loss, micro-batches of 2 (m=2) do not.
    result = mbtune("sweep", "-w", f"{FIXTURES}:nan_loss", "-O", "nan_from_batch=4", "-d", "cpu", "-p", "2",
                    "--schedules", "gpipe", "-m", "1,2", "--accum", "1", "--global-batch", "4", "--steps", "1",
                    "--no-save", "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout, parse_constant=_refuse_nan)
    point, fine = report["results"]
    assert fine["status"] == "ok" and report["ranking"] == [1]
    assert point["status"] == "nonfinite" and point["loss"] is None
    assert point["error"].startswith("rank 1 (blocks 2-3): the loss is nan at step 1: ")
    assert point["failed_rank"] == 1 and point["failed_blocks"] == [2, 3]
    assert "NonFiniteLossError" in point["error_tail"]


def test_a_rank_that_fails_is_named_with_its_blocks_and_its_traceback():
    report = sweep_workload(_two_stage_sweep("fails_on_last_stage"))
    [result] = report.results
    assert result.status == "error" and result.error_kind == "workload"
    assert result.failed_rank == 1 and result.failed_blocks == (2, 3)
    assert result.error.startswith("rank 1 (blocks 2-3): ValueError: the last block refuses its input")
    assert result.error_tail.startswith("Traceback (most recent call last):")
    assert 'raise ValueError("the last block refuses its input")' in result.error_tail
    assert len(result.error_tail.splitlines()) <= 20
    assert PointResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    [line] = failure_lines(report)
    assert line.plain.startswith("#1 error: gpipe p=2 m=2 accum=1 mbs=2: rank 1 (blocks 2-3): ValueError")
    shown = _render_profile(report, errors=True)
    assert "sweep point gpipe p=2 m=2 accum=1 mbs=2: error, workload, rank 1 (blocks 2, 3)" in shown
    assert "Traceback" in shown and 'raise ValueError("the last block refuses its input")' in shown
    assert "Traceback" not in _render_profile(report, errors=False)


_NO_GUARD = """
    import json
    from mbtune.probing.config import ProbeConfig
    from mbtune.probing.trial import run_classified_trial
    from mbtune.pipeline.launch import run_pipeline_point
    from mbtune.pipeline.point_spec import PipelineSpec
    c = ProbeConfig(workload="mlp", device="cpu")
    print(json.dumps(run_classified_trial(c.trial(batch_size=4, device="cpu"), 60).to_dict()))
    spec = PipelineSpec(workload="mlp", schedule="gpipe", num_ranks=2, num_micro_batches=2, micro_batch_size=2,
                        measured_steps=1, device="cpu")
    outcome = run_pipeline_point(spec, timeout_s=60)
    print(json.dumps({"status": outcome.status, "error": outcome.error, "error_kind": outcome.error_kind}))
"""


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    script = tmp_path / "noguard.py"
    script.write_text(textwrap.dedent(_NO_GUARD))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert done.returncode == 0, done.stderr
    trial, point = (json.loads(line) for line in done.stdout.splitlines())
    for outcome in (trial, point):
        assert outcome["status"] == "error" and outcome["error_kind"] == "harness"
        assert 'under `if __name__ == "__main__":`' in outcome["error"]
        assert "re-import the main script" in outcome["error"]
    assert "bootstrapping phase" not in done.stderr  # ended before multiprocessing's own RuntimeError


def test_a_worker_that_dies_before_its_trial_is_the_harness_not_the_workload(tmp_path):
    # The target's module is importable here but not in the child, so the child dies unpickling it,
    # before any of mbtune's code runs there.
    (tmp_path / "mbtune_vanishing_target.py").write_text("def target():\n    return 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import mbtune_vanishing_target
    finally:
        sys.path.remove(str(tmp_path))
    try:
        result = run_isolated(mbtune_vanishing_target.target, timeout_s=60)
    finally:
        del sys.modules["mbtune_vanishing_target"]
    assert result.status == "error" and result.error_kind == "harness"
    assert "before the trial began" in result.error and "the workload never ran" in result.error
