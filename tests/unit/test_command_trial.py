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


def test_steps_counted_from_printed_lines_and_the_start_up_beside_them() -> None:
    printed = classify(Capped(0, [_report(200)], "", 5.0, 60, (3.0, 3.5, 3.75)), 8, 3, printed=True)
    assert printed.status == OK and printed.step_times_s == pytest.approx((3.0, 0.5, 0.25))
    assert printed.startup_s == pytest.approx(5.0 - 0.75)  # everything but the steps after the first
    short = classify(Capped(0, [_report()], "", 1.0, 60, (0.5,)), 8, 3, printed=True)
    assert short.status == ERROR and "after 1 printed step line(s) of the 3" in short.error
    none = classify(Capped(0, [_report()], "", 1.0, 60), 8, 3)
    assert none.status == ERROR and "--steps-from-output REGEX" in none.error
    stepped_some = classify(Capped(None, [_report(steps=(1.0,))], "", 61.0, 60), 8, 3)
    assert "1 optimizer step(s) of the 3" in stepped_some.error and "--steps-from-output" not in stepped_some.error


def test_a_step_line_that_is_no_regular_expression_and_one_without_a_command_are_refused() -> None:
    from mbtune.probing.command import step_line
    from mbtune.probing.config import ProbeConfig

    assert step_line(r"^step \d+").search("step 12 loss 3.1")
    with pytest.raises(ConfigError, match="is not a regular expression"):
        step_line("step (")
    with pytest.raises(ConfigError, match="is not a regular expression"):
        ProbeConfig(command=("python", "t.py", "{batch}"), steps_from_output="(", memory_budget_bytes=2**20)
    with pytest.raises(ConfigError, match="counts the steps of a command"):
        ProbeConfig(workload="mlp", steps_from_output="step")


@pytest.mark.parametrize(("fixed", "per_sample", "budget"), [
    (25 * 2**20, 16 * 2**10, 64 * 2**20), (2**20, 4 * 2**10, 64 * 2**20), (40 * 2**20, 2**20, 2**30),
    (300 * 2**20, 3 * 2**10, 2**30)])
def test_where_memory_is_a_line_the_search_needs_at_most_5_trials_after_the_first_two_that_draw_it(
        fixed: int, per_sample: int, budget: int) -> None:
    from mbtune.probing.command import CommandTrial, search_command

    def run(command, memory_budget_bytes, device, timeout_s, env=None, steps_from=None):
        size = int(command[-1])
        peak = fixed + per_sample * size
        over = "past the budget" if peak > memory_budget_bytes else ""
        return Capped(0, [_report(min(peak, memory_budget_bytes), () if over else (1.0, 0.1, 0.1), over)], "", 1.0,
                      60)

    found = search_command(CommandTrial(command=("train", "{batch}"), memory_budget_bytes=budget), granularity=8,
                           run=run)
    sizes = [t.batch_size for t in found.trials]
    ceiling = (budget - fixed) // per_sample // 8 * 8
    assert found.ceiling == pytest.approx(ceiling, rel=0.02) and found.first_failing > ceiling
    rising = next(i for i in range(1, len(found.trials))
                  if found.trials[i].peak_memory_bytes > 1.02 * found.trials[i - 1].peak_memory_bytes)
    assert len(sizes) - (rising + 1) <= 5, sizes


def test_a_bad_step_line_on_the_command_line_is_one_line_exit_2(capsys) -> None:
    from mbtune.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["-q", "probe", "-d", "cpu", "--memory-budget", "48MiB", "--no-save", "--steps-from-output", "step (",
              "--", "python", "train.py", "--batch-size", "{batch}"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "--steps-from-output 'step (' is not a regular expression" in err
    assert len(err.strip().splitlines()) == 1
