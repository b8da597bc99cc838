"""Faults mbtune must survive: each ends with its documented exit code, loses nothing that finished, and
leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.fixtures.commands import PROBE, SMALL, SWEEP
from tests.fixtures.processes import orphans
from tests.unit.test_cli import ROOT, SCRATCH, mbtune

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def assert_no_orphans(tag: str) -> None:
    assert orphans(tag) == set()


def start(args: list[str], tag: str) -> subprocess.Popen:
    env = {**os.environ, "COLUMNS": "200", "MBTUNE_TEST_TAG": tag, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "mbtune", *args], cwd=SCRATCH, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_lines(process: subprocess.Popen, marker: str) -> str:
    seen = ""
    while marker not in seen:
        line = process.stderr.readline()
        assert line, f"mbtune ended early: {seen}"
        seen += line
    return seen


def journal_records(directory: Path, kind: str) -> list[dict]:
    [journal] = directory.glob("cpu-*/*.journal.jsonl")
    lines = [json.loads(line) for line in journal.read_text().splitlines()[1:] if line.strip()]
    return [line["record"] for line in lines if line["kind"] == kind]


def test_sigkill_mid_sweep_then_resume_loses_and_repeats_nothing(tmp_path):
    tag = uuid.uuid4().hex
    process = start([*SWEEP, "--profiles-dir", str(tmp_path)], tag)
    wait_for_lines(process, "trial 3:")
    process.kill()
    process.wait(timeout=30)
    assert_no_orphans(tag)
    finished = journal_records(tmp_path, "sweep_point")
    assert len(finished) >= 3

    resumed = mbtune(*SWEEP, "--profiles-dir", str(tmp_path), "--resume", "--format", "json")
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert len(report["results"]) == 12
    assert resumed.stderr.count("replayed from the journal") == len(finished)
    by_point = {json.dumps(r["point"], sort_keys=True): r for r in report["results"]}
    for record in finished:  # the finished points came back exactly as measured (their rounds were the killed
        # run's: not paired round by round with this run's, whose rounds start again from one)
        assert by_point[json.dumps(record["point"], sort_keys=True)] == {**record, "repeat_rounds": []}
    assert not list(tmp_path.glob("cpu-*/*.journal.jsonl"))  # done: the journal is gone


def test_sigkill_mid_probe_then_resume_replays_the_finished_trials(tmp_path):
    tag = uuid.uuid4().hex
    args = [*PROBE, "--profiles-dir", str(tmp_path)]
    process = start(args, tag)
    wait_for_lines(process, "trial 3:")
    process.kill()
    process.wait(timeout=30)
    assert_no_orphans(tag)
    finished = journal_records(tmp_path, "probe_trial")
    assert len(finished) >= 3

    resumed = mbtune(*args, "--resume", "--format", "json")
    assert resumed.returncode == 0, resumed.stderr
    probe = json.loads(resumed.stdout)
    assert probe["trials"][: len(finished)] == finished
    assert resumed.stderr.count("replayed from the journal") == len(finished)
    assert probe["ceiling"] == 2000 or probe["first_failing"] == probe["ceiling"] + 1


def test_resume_refuses_a_different_run_and_a_missing_journal(tmp_path):
    nothing = mbtune("probe", *SMALL, "--profiles-dir", str(tmp_path), "--resume")
    assert nothing.returncode == 2 and "nothing to resume" in nothing.stderr


def test_trial_killed_like_the_oom_killer_is_reported_exit_3():
    tag = uuid.uuid4().hex
    process = start(["probe", "-w", "tests.fixtures.workloads:oom_killed", "-d", "cpu", "--no-save"], tag)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 3
    assert "killed" in stderr and "SIGKILL" in stderr and "Traceback" not in stderr
    assert_no_orphans(tag)


def test_rank_crash_mid_step_fails_that_point_and_the_sweep_goes_on(tmp_path):
    tag = uuid.uuid4().hex
    marker = tmp_path / "crashed"
    process = start(["sweep", "-w", "tests.fixtures.workloads:crash_once", "-O", f"marker={marker}", "-d", "cpu",
                     "-p", "2", "--schedules", "gpipe", "-m", "2,4", "--accum", "1", "--micro-batch-size", "2",
                     "--steps", "2", "--no-save", "--format", "json"], tag)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    results = json.loads(stdout)["results"]
    assert [r["status"] for r in results] == ["error", "ok"]
    assert "injected crash in the middle of a step" in results[0]["error"]
    assert_no_orphans(tag)


def test_unwritable_profiles_dir_fails_before_measuring(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    started = time.monotonic()
    result = mbtune("probe", *SMALL, "--profiles-dir", str(blocker))
    assert result.returncode == 2
    assert "cannot write under" in result.stderr and "--profiles-dir" in result.stderr
    assert "trial 1" not in result.stderr and time.monotonic() - started < 60


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> Path:
    """A profiles folder holding one small probe's profile (each test damages its own copy)."""
    folder = tmp_path_factory.mktemp("probed")
    assert mbtune("probe", *SMALL, "--max-batch", "2", "--confirm", "1", "--profiles-dir", str(folder)).returncode == 0
    return folder


@pytest.mark.parametrize("damage", ["corrupt", "newer"])
def test_damaged_profiles_are_reported_never_overwritten(tmp_path, damage, probed):
    import shutil

    shutil.copytree(probed, tmp_path, dirs_exist_ok=True)
    [path] = tmp_path.glob("cpu-*/mlp.json")
    if damage == "corrupt":
        path.write_text(path.read_text()[:100])
    else:
        data = json.loads(path.read_text())
        data["schema_version"] += 1
        path.write_text(json.dumps(data))
    damaged = path.read_text()
    shown = mbtune("show", str(path))
    assert shown.returncode == 2 and ("not readable JSON" in shown.stderr or "newer than this mbtune" in shown.stderr)
    again = mbtune("probe", *SMALL, "--max-batch", "2", "--confirm", "1", "--profiles-dir", str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert path.read_text() == damaged  # kept as it was; the new results went beside it
    assert len(list(tmp_path.glob("cpu-*/mlp.*.json"))) == 1


def test_two_runs_on_one_profile_do_not_corrupt_it(tmp_path):
    tag = uuid.uuid4().hex
    first = start([*SWEEP, "--steps", "100", "--profiles-dir", str(tmp_path)], tag)  # slow enough to overlap
    wait_for_lines(first, "trial 1:")
    second = mbtune(*SWEEP, "--profiles-dir", str(tmp_path))
    assert second.returncode == 3 and "another mbtune run is writing" in second.stderr
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=120)
    assert first.returncode == 130
    [path] = tmp_path.glob("cpu-*/mlp.json")
    assert json.loads(path.read_text())["sweep"]["interrupted"] is True
    assert_no_orphans(tag)
