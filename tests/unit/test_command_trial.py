"""How a run of the user's own command becomes a probe trial (pure: the processes' reports are given)."""

from __future__ import annotations

import pytest

from mbtune.errors import ConfigError
from mbtune.probing.command import check_template, classify, command_at, command_name
from mbtune.probing.confirm import Capped
from mbtune.records import ERROR, OK, OOM, TIMEOUT


def _report(peak=100, steps=(), over="", exception=""):
    return {"peak_bytes": peak, "over_budget": over, "exception": exception, "step_times_s": list(steps)}


def test_every_process_that_reached_the_steps_is_ok_and_the_slowest_sets_each_steps_time() -> None:
    two_workers = [_report(100, (2.0, 0.1, 0.2)), _report(300, (2.5, 0.3, 0.1)), _report(50)]  # and a loader
    outcome = classify(Capped(0, two_workers, "", 4.0, 60), 8, 3)
    assert outcome.status == OK and outcome.step_times_s == (2.5, 0.3, 0.2) and outcome.peak_memory_bytes == 300
    assert outcome.step_time_s == pytest.approx(0.25) and outcome.samples_per_s == pytest.approx(32.0)


def test_past_the_budget_is_oom_even_when_the_script_caught_it_and_exited_0() -> None:
    caught = classify(Capped(0, [_report(over="DefaultCPUAllocator: can't allocate memory")], "", 1.0, 60), 8, 3)
    raised = classify(Capped(1, [_report(exception="torch.OutOfMemoryError: CUDA out of memory")], "", 1.0, 60), 8, 3)
    assert caught.status == raised.status == OOM and "allocate" in caught.error


def test_too_few_steps_a_crash_and_a_hang_are_told_apart() -> None:
    short = classify(Capped(0, [_report(steps=(1.0,))], "done\n", 1.0, 60), 8, 3)
    assert short.status == ERROR and "after 1 optimizer step(s) of the 3" in short.error
    crash = classify(Capped(2, [], "Traceback\nFileNotFoundError: data.csv\n", 1.0, 60), 8, 3)
    assert crash.status == ERROR and crash.error == "exit code 2: FileNotFoundError: data.csv"
    hung = classify(Capped(None, [_report(steps=(1.0,))], "", 61.0, 60), 8, 3)
    assert hung.status == TIMEOUT and "60 s" in hung.error


def test_the_template_and_its_name() -> None:
    command = check_template(["python", "train.py", "--batch-size={batch}", "--out", "run-{batch}"])
    assert command_at(command, 64) == ["python", "train.py", "--batch-size=64", "--out", "run-64"]
    assert command_name(command) == "train"
    assert command_name(["torchrun", "--nproc-per-node", "2", "-m", "mypkg.train", "--bs", "{batch}"]) == "mypkg.train"
    assert command_name(["./train.sh", "{batch}"]) == "train.sh"
    with pytest.raises(ConfigError, match="placeholder {mbs}"):
        check_template(["python", "train.py", "{batch}", "{mbs}"])
