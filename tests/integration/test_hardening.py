"""Faults and bad input that must end with the right exit code and one line: user code that hangs or
exits while loading, runs that measure nothing, outputs that cannot be written. (Signals, kills and a full
disk mid-run, then resume: test_interrupts.py.)"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.integration.test_faults import SMALL, assert_no_orphans, start
from tests.unit.test_cli import mbtune

pytestmark = pytest.mark.integration


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.slow
def test_a_factory_that_hangs_ends_at_the_load_timeout_exit_3():
    tag = uuid.uuid4().hex
    process = start(["probe", "-w", "tests.fixtures.bad_factories:hangs", "-d", "cpu", "--no-save",
                     "--load-timeout", "3"], tag)
    _, stderr = process.communicate(timeout=90)
    assert process.returncode == 3
    assert "did not finish within 3 s" in one_line(stderr) and "--load-timeout" in stderr
    assert_no_orphans(tag)


@pytest.mark.slow
@pytest.mark.parametrize(("command", "flag"), [("probe", "--trial-timeout"), ("sweep", "--point-timeout")])
def test_a_factory_that_hangs_ends_at_the_trial_timeout_the_user_gave(command, flag):
    tag = uuid.uuid4().hex
    process = start([command, "-w", "tests.fixtures.bad_factories:hangs", "-d", "cpu", "--no-save", flag, "3"], tag)
    _, stderr = process.communicate(timeout=60)  # not the 120 s default load timeout
    assert process.returncode == 3
    assert "did not finish within 3 s" in one_line(stderr)
    assert_no_orphans(tag)


@pytest.mark.parametrize("command", ["probe", "sweep"])
def test_a_factory_that_exits_is_bad_input_even_with_json(command):
    result = mbtune(command, "-w", "tests.fixtures.bad_factories:exits", "-d", "cpu", "--no-save", "-f", "json")
    assert result.returncode == 2 and result.stdout == ""
    assert "sys.exit(0)" in one_line(result.stderr)


def test_a_factory_with_text_for_flops_is_bad_input_before_any_trial(tmp_path):
    result = mbtune("probe", "-w", "tests.fixtures.bad_factories:string_flops", "-d", "cpu",
                    "--profiles-dir", str(tmp_path))
    assert result.returncode == 2
    assert "flops_per_sample is 'lots'" in one_line(result.stderr)
    assert not list(tmp_path.rglob("*"))  # nothing written


def test_a_sweep_whose_settings_let_no_point_run_is_bad_input():
    result = mbtune("sweep", *SMALL, "--schedules", "gpipe", "--global-batch", "7", "-m", "2,4", "--accum", "1",
                    "--no-save")
    assert result.returncode == 2, result.stderr
    assert "--global-batch 7 divides into none" in one_line(result.stderr) and "trial" not in result.stderr


def test_a_sweep_whose_every_point_failed_exits_3_and_keeps_the_profile(tmp_path):
    result = mbtune("sweep", "-w", "tests.fixtures.workloads:broken", "-d", "cpu", "-p", "1", "--schedules", "gpipe",
                    "-m", "1", "--accum", "1", "--micro-batch-size", "2", "--steps", "1",
                    "--profiles-dir", str(tmp_path), "-f", "json")
    assert result.returncode == 3, result.stderr
    assert "no sweep point completed" in result.stderr and "shape mismatch in user block" in result.stderr
    [profile] = tmp_path.glob("cpu-*/*.json")
    assert [r["status"] for r in json.loads(profile.read_text())["sweep"]["results"]] == ["error"]


@pytest.mark.parametrize("flag", ["--plot", "--trace"])
def test_an_output_that_cannot_be_written_is_refused_before_measuring(tmp_path, flag):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    target = blocker / "under-a-file" / "out"
    result = mbtune("sweep", *SMALL, flag, str(target), "--no-save")
    assert result.returncode == 2
    assert "not a folder" in one_line(result.stderr) and "trial 1" not in result.stderr


def test_qualify_refuses_an_unwritable_junit_path_before_running(tmp_path):
    result = mbtune("qualify", "--baseline", str(tmp_path / "missing.json"), "--junit", str(tmp_path))
    assert result.returncode == 2
    assert "is a folder" in one_line(result.stderr)


def test_an_address_space_limit_below_the_budget_is_named_as_the_cause(tmp_path):
    import os
    import subprocess
    import sys

    from tests.unit.test_cli import ROOT

    limit_kib = 6 * 2**20  # ulimit -v 6 GiB, the budget 8 GiB: no trial could honour it
    command = (f"ulimit -v {limit_kib} && exec {sys.executable} -m mbtune probe -w mlp -d cpu "
               f"--memory-budget 8GiB --profiles-dir {tmp_path}")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert result.returncode == 2, result.stderr
    line = one_line(result.stderr)
    assert "--memory-budget 8GiB does not fit this process's address-space limit" in line and "ulimit -v" in line
    assert "trial 1" not in result.stderr and not list(tmp_path.rglob("*.json*"))  # refused before any trial or file
