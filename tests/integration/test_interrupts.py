"""Runs stopped from outside, then resumed: SIGTERM and SIGHUP, a trial killed from outside, a full disk at
save time and Ctrl-C mid-tune each keep what finished (the journal, the profile), exit with the signal's
code, and --resume replays what was journaled instead of measuring it again."""

from __future__ import annotations

import json
import signal
import uuid

import pytest

from tests.integration.test_faults import PROBE, SMALL, assert_no_orphans, journal_records, start, wait_for_lines
from tests.unit.test_cli import mbtune

pytestmark = pytest.mark.integration


FOUR_POINTS = ["sweep", *SMALL, "-p", "2", "--schedules", "gpipe,1f1b", "-m", "2,4", "--accum", "1",
               "--micro-batch-size", "4", "--steps", "2"]


@pytest.mark.slow
def test_sigterm_stops_a_sweep_like_ctrl_c(tmp_path):
    signum, code = signal.SIGTERM, 143
    tag = uuid.uuid4().hex
    process = start([*FOUR_POINTS, "--profiles-dir", str(tmp_path)], tag)
    wait_for_lines(process, "trial 2:")
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == code, stderr
    assert_no_orphans(tag)
    [path] = tmp_path.glob("cpu-*/mlp.json")
    saved = json.loads(path.read_text())["sweep"]
    assert saved["interrupted"] is True and len(saved["results"]) >= 1
    finished = journal_records(tmp_path, "sweep_point")
    resumed = mbtune(*FOUR_POINTS, "--profiles-dir", str(tmp_path), "--resume", "--format", "json")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("replayed from the journal") == len(finished)


@pytest.mark.slow
def test_sighup_mid_probe_keeps_the_journal_and_resume_replays_it(tmp_path):
    tag = uuid.uuid4().hex
    args = [*PROBE, "--profiles-dir", str(tmp_path)]
    process = start(args, tag)
    wait_for_lines(process, "trial 2:")
    process.send_signal(signal.SIGHUP)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 129 and "interrupted by SIGHUP" in stderr
    assert_no_orphans(tag)
    finished = journal_records(tmp_path, "probe_trial")
    resumed = mbtune(*args, "--resume", "--format", "json")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("replayed from the journal") == len(finished) >= 2


@pytest.mark.slow
def test_a_trial_killed_from_outside_runs_again_on_resume(tmp_path):
    marker = tmp_path / "killed"
    args = ["probe", "-w", "tests.fixtures.workloads:killed_once", "-O", f"marker={marker}", "-d", "cpu",
            "--max-batch", "16", "--no-predict", "--profiles-dir", str(tmp_path / "profiles")]
    first = mbtune(*args)
    assert first.returncode == 3 and "killed" in first.stderr and "--resume runs it again" in first.stderr
    resumed = mbtune(*args, "--resume", "--format", "json")
    assert resumed.returncode == 0, resumed.stderr
    probe = json.loads(resumed.stdout)
    assert "killed" not in [t["status"] for t in probe["trials"]] and probe["ceiling"] == 16


@pytest.fixture
def small_disk(tmp_path):
    """A 8 KiB tmpfs: room for a small probe's journal, none for its profile (skipped where no mount)."""
    import os
    import subprocess as sp

    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0 or sp.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(folder)],
                                   capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root and the mount capability")
    yield folder
    sp.run(["umount", str(folder)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_at_save_time_keeps_the_journal_and_resume_saves(small_disk):
    import subprocess as sp

    args = ["probe", "-w", "mlp", "-O", "layers=1", "-O", "width=8", "-d", "cpu", "--max-batch", "64",
            "--profiles-dir", str(small_disk)]
    full = mbtune(*args)
    if full.returncode == 0:
        pytest.skip("this machine's profile fitted in 8 KiB: the disk did not fill")
    [error] = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert full.returncode == 3 and "left on device" in error and "--resume" in error
    assert "Traceback" not in full.stderr
    [journal] = small_disk.glob("*/mlp.journal.jsonl")
    finished = [json.loads(line)["record"] for line in journal.read_text().splitlines()[1:]]
    assert finished and not list(small_disk.glob("*/.*tmp*")) and not list(small_disk.glob("*/mlp.json"))
    sp.run(["mount", "-o", "remount,size=1m", str(small_disk)], check=True)  # space freed
    resumed = mbtune(*args, "--resume", "--format", "json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["trials"][: len(finished)] == finished
    assert resumed.stderr.count("replayed from the journal") == len(finished)
    assert list(small_disk.glob("*/mlp.json")) and not list(small_disk.glob("*/mlp.journal.jsonl"))


@pytest.mark.slow
def test_ctrl_c_mid_tune_then_resume_replays_probe_and_sweep(tmp_path):
    tag = uuid.uuid4().hex
    args = ["tune", *SMALL, "--memory-budget", "200MiB", "--max-batch", "64", "-p", "2", "--schedules", "gpipe",
            "-m", "2,4", "--accum", "1", "--steps", "1", "--no-predict", "--profiles-dir", str(tmp_path)]
    process = start(args, tag)
    wait_for_lines(process, "trial 3:")
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert_no_orphans(tag)
    probe_done, sweep_done = journal_records(tmp_path, "probe_trial"), journal_records(tmp_path, "sweep_point")
    resumed = mbtune(*args, "--resume", "--format", "json")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("replayed from the journal") == len(probe_done) + len(sweep_done) >= 3
    report = json.loads(resumed.stdout)
    assert report["probe"]["trials"][: len(probe_done)] == probe_done
    assert all(point in report["sweep"]["results"] for point in sweep_done) and len(report["sweep"]["results"]) == 2
    assert report["sweep"]["check"]["status"] == "PASS"  # tune checks its best row's update
