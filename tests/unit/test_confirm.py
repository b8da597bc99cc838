"""`mbtune confirm`'s verdict from what the command's processes reported (pure logic)."""

from __future__ import annotations

import os

import pytest

from mbtune.probing.confirm import (
    CAP_FOLDER,
    COUNTER_FILE,
    CRASHED,
    FITS,
    OUT_OF_MEMORY,
    Capped,
    ConfirmResult,
    ConfirmRun,
    _classify,
    cap_environment,
)


def _report(peak=100, over="", exception=""):
    return {"peak_bytes": peak, "over_budget": over, "exception": exception}


def test_a_run_fits_when_it_exits_0_and_no_process_went_past_the_budget():
    run = _classify(Capped(0, [_report(100), _report(300)], "done\n", 1.0, 60))
    assert (run.outcome, run.peak_bytes, run.processes) == (FITS, 300, 2)


def test_a_process_past_the_budget_is_out_of_memory_even_when_the_script_caught_it_and_exited_0():
    run = _classify(Capped(0, [_report(100, over="DefaultCPUAllocator: can't allocate memory: ...")], "", 1.0, 60))
    assert run.outcome == OUT_OF_MEMORY and "can't allocate" in run.cause


def test_an_uncaught_cuda_out_of_memory_error_is_out_of_memory():
    run = _classify(Capped(1, [_report(exception="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")], "x\n", 1.0, 60))
    assert run.outcome == OUT_OF_MEMORY


def test_any_other_failure_is_a_crash_with_its_last_line_a_signal_or_the_timeout():
    assert _classify(Capped(2, [_report()], "Traceback\nValueError: bad\n", 1.0, 60)).cause == "exit code 2: ValueError: bad"
    assert "SIGKILL" in _classify(Capped(-9, [], "", 1.0, 60)).cause
    timed_out = _classify(Capped(None, [], "", 61.0, 60))
    assert timed_out.outcome == CRASHED and "--timeout" in timed_out.cause


def test_the_exit_code_is_1_for_any_out_of_memory_then_3_for_any_crash_else_0():
    def result(*outcomes):
        return ConfirmResult(command=("python",), device="cpu", memory_budget_bytes=1, runs=tuple(
            ConfirmRun(outcome=o, exit_code=0, peak_bytes=1, processes=1, wall_s=1.0) for o in outcomes))

    assert [result(FITS, FITS).exit_code, result(FITS, CRASHED, OUT_OF_MEMORY).exit_code,
            result(FITS, CRASHED).exit_code] == [0, 1, 3]


def test_the_cap_goes_first_on_the_commands_path_before_the_users_own(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/users/own")
    env = cap_environment(512, "cpu", "/reports")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(CAP_FOLDER), "/users/own"]
    assert (CAP_FOLDER / "sitecustomize.py").is_file() and COUNTER_FILE.is_file()
    assert env["MBTUNE_CAP_BUDGET"] == "512" and env["MBTUNE_CAP_REPORT"] == "/reports"


def test_a_run_stopped_at_its_duration_fits_unless_a_process_went_past_the_budget():
    stopped = _classify(Capped(None, [_report(100)], "", 10.0, 60, stopped=True))
    assert (stopped.outcome, stopped.stopped) == (FITS, True)
    over = _classify(Capped(0, [_report(100, over="DefaultCPUAllocator: can't allocate")], "", 10.0, 60, stopped=True))
    assert over.outcome == OUT_OF_MEMORY


def test_runs_and_timeout_default_by_the_duration_and_a_timeout_must_outlast_it():
    from mbtune.errors import ConfigError
    from mbtune.probing.confirm import DEFAULT_RUNS, DEFAULT_TIMEOUT_S, ConfirmConfig

    plain = ConfirmConfig(command=("python",), memory_budget_bytes=1)
    timed = ConfirmConfig(command=("python",), memory_budget_bytes=1, duration_s=1800.0)
    assert (plain.num_runs, plain.run_timeout_s) == (DEFAULT_RUNS, DEFAULT_TIMEOUT_S)
    assert timed.num_runs == 1 and timed.run_timeout_s > 1800.0
    with pytest.raises(ConfigError, match="timeout"):
        ConfirmConfig(command=("python",), memory_budget_bytes=1, duration_s=1800.0, timeout_s=600.0)


def test_the_cap_watches_memory_from_its_own_file():
    from mbtune.probing.confirm import WATCH_FILE

    assert cap_environment(512, "cpu", "/reports")["MBTUNE_CAP_WATCH"] == str(WATCH_FILE) and WATCH_FILE.is_file()
