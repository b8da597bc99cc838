"""A probe of the user's own training command, as it is: trials in fresh processes under the probe's cap, ended
after a few optimizer steps by a hook on torch's optimizer step; the safe batch it finds fits the same
script under `confirm`, and one granule above the ceiling does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mbtune.errors import ConfigError
from mbtune.probing.command import CommandTrial, check_template, run_command_trial, search_command
from mbtune.probing.confirm import FITS, OUT_OF_MEMORY, ConfirmConfig, confirm_command
from mbtune.records import ERROR, OK, OOM, TIMEOUT

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).parents[1] / "fixtures" / "train_scripts" / "plain_loop.py")
BUDGET = 48 * 2**20
COMMAND = (sys.executable, SCRIPT, "--batch-size", "{batch}", "--width", "256")


def test_a_trial_ends_the_users_loop_after_its_steps_and_times_them(tmp_path: Path) -> None:
    checkpoint = tmp_path / "model.pt"
    trial = CommandTrial(command=(*COMMAND, "--checkpoint", str(checkpoint)), memory_budget_bytes=BUDGET, steps=4)
    outcome = run_command_trial(trial, 8)
    assert outcome.status == OK, outcome.error_tail
    assert len(outcome.step_times_s) == 4 and outcome.samples_per_s and outcome.peak_memory_bytes
    assert not checkpoint.exists()  # the epochs after the steps never ran, nor the checkpoint at the end
    too_big = run_command_trial(trial, 100_000)
    assert too_big.status == OOM and "budget" in too_big.error


def test_a_script_that_catches_the_oom_and_exits_0_is_an_oom(tmp_path: Path) -> None:
    script = tmp_path / "catches.py"
    script.write_text("import sys, torch\ntry:\n    x = torch.empty(int(sys.argv[1]) * 2**20, dtype=torch.uint8)\n"
                      "except torch.OutOfMemoryError:\n    print('out of memory, skipped')\n")
    outcome = run_command_trial(CommandTrial(command=(sys.executable, str(script), "{batch}"),
                                             memory_budget_bytes=BUDGET), 100)
    assert outcome.status == OOM
    never = run_command_trial(CommandTrial(command=(sys.executable, str(script), "{batch}"),
                                           memory_budget_bytes=BUDGET), 1)
    assert never.status == ERROR and "0 optimizer step(s) of the 3" in never.error


def test_bad_templates_are_refused() -> None:
    with pytest.raises(ConfigError, match="no {batch} placeholder"):
        check_template(["python", "train.py", "--batch-size", "8"])
    with pytest.raises(ConfigError, match="placeholder {micro_batch_size}, which a probe does not fill"):
        check_template(["python", "train.py", "--batch-size", "{batch}", "--mbs", "{micro_batch_size}"])
    with pytest.raises(ConfigError, match="no command"):
        check_template([])


def test_the_safe_batch_of_the_users_script_fits_it_and_above_the_ceiling_does_not() -> None:
    trial = CommandTrial(command=check_template(COMMAND), memory_budget_bytes=BUDGET, steps=3)
    found = search_command(trial, granularity=128, margin=0.15, confirm=1, resolution=128)
    assert found.ceiling and found.safe_batch and found.safe_batch < found.ceiling
    assert found.first_failing == found.ceiling + 128  # bracketed to one granule
    fits = confirm_command(ConfirmConfig(command=[*COMMAND[:3], str(found.safe_batch), *COMMAND[4:], "--epochs", "1"],
                                         memory_budget_bytes=BUDGET, runs=3))
    assert [run.outcome for run in fits.runs] == [FITS] * 3
    above = confirm_command(ConfirmConfig(command=[*COMMAND[:3], str(found.first_failing), *COMMAND[4:],
                                                   "--epochs", "1"], memory_budget_bytes=BUDGET, runs=1))
    assert above.runs[0].outcome == OUT_OF_MEMORY


def test_the_search_reads_the_scripts_errors_and_still_brackets_its_ceiling_to_one_granule() -> None:
    # The line through the sizes that ran first puts the ceiling too high (the loop's peak moves from its
    # optimizer step to its forward as the batch grows): stepping down from the failures one granule at a time
    # took 10 trials after the first failure. Each error names what it asked for and what was live, and the
    # next size comes from them.
    trial = CommandTrial(command=check_template(COMMAND), memory_budget_bytes=BUDGET, steps=3)
    found = search_command(trial, granularity=32, margin=0.15, confirm=1, resolution=32)
    sizes = [t.batch_size for t in found.trials]
    assert found.ceiling and found.first_failing == found.ceiling + 32, sizes  # bracketed to one granule
    failed = [t for t in found.trials if not t.ok]
    assert failed and all(t.status == OOM and t.oom_need_bytes > BUDGET for t in failed)
    first = found.trials.index(failed[0])
    assert len(found.trials) - first <= 5, sizes  # the first failure, the bracket, the safe batch


def test_mbtune_probe_of_a_command_saves_a_profile_named_for_it_and_qualify_re_runs_it(tmp_path: Path, capsys) -> None:
    import json

    from mbtune.cli import main
    from mbtune.saving.profiles import load_profile

    args = ["-q", "probe", "-d", "cpu", "--memory-budget", "48MiB", "--granularity", "256", "--resolution", "256",
            "--profiles-dir", str(tmp_path), "-f", "json", "--", *COMMAND]
    with pytest.raises(SystemExit) as ended:
        main(args)
    assert ended.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    (saved,) = tmp_path.glob("*/plain-loop.json")
    profile = load_profile(saved)
    assert profile.probe is not None and profile.probe.workload == "plain_loop"
    assert printed["ceiling"] == profile.probe.ceiling and profile.probe.safe_batch
    assert profile.probe.num_parameters is None  # the command is the user's own: mbtune built no model of it
    assert tuple(printed["command"]) == COMMAND == profile.probe.command
    # CI qualifies the real job: the baseline's own command is probed again, under the same cap.
    with pytest.raises(SystemExit) as qualified:
        main(["-q", "qualify", "--baseline", str(saved), "--profiles-dir", str(tmp_path / "runs"), "-f", "json"])
    verdict = json.loads(capsys.readouterr().out)
    assert qualified.value.code == 0 and verdict["status"] == "PASS"
    (rerun,) = (tmp_path / "runs").glob("*/plain-loop.json")
    assert load_profile(rerun).probe.command == COMMAND


def test_a_command_without_its_placeholder_is_one_line_exit_2(capsys) -> None:
    from mbtune.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["-q", "probe", "-d", "cpu", "--memory-budget", "48MiB", "--no-save", "--", sys.executable, SCRIPT,
              "--batch-size", "8"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "no {batch} placeholder" in err and len(err.strip().splitlines()) == 1



MANUAL = str(Path(__file__).parents[1] / "fixtures" / "train_scripts" / "manual_sgd.py")


def test_a_script_without_a_torch_optimizer_is_stepped_by_the_line_it_prints() -> None:
    command = (sys.executable, MANUAL, "--batch-size", "{batch}")
    # Long enough for a loaded machine to start python and torch and allocate (5 s was not, once), and steps
    # enough that the script is still training when the deadline ends it.
    endless = (*command, "--steps", "100000000")
    unseen = run_command_trial(CommandTrial(command=endless, memory_budget_bytes=BUDGET, timeout_s=20), 8)
    assert unseen.status == TIMEOUT and "0 optimizer step(s) of the 3" in unseen.error
    assert "--steps-from-output REGEX" in unseen.error and unseen.peak_memory_bytes  # reported when stopped
    printed = run_command_trial(CommandTrial(command=command, memory_budget_bytes=BUDGET,
                                             steps_from_output=r"^step \d+ loss", steps=4), 8)
    assert printed.status == OK, printed.error_tail
    assert len(printed.step_times_s) == 4 and printed.peak_memory_bytes
    assert printed.startup_s is not None and 0 < printed.startup_s <= printed.wall_s
    assert run_command_trial(CommandTrial(command=command, memory_budget_bytes=BUDGET, steps_from_output="^step ",
                                          steps=4), 1_000_000).status == OOM


def _running(marker: str) -> list[str]:
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                args = cmdline.read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in args:
            found.append(pid)
    return found


def test_a_hung_script_is_stopped_at_its_time_with_what_it_made_and_nothing_left_running(tmp_path: Path) -> None:
    marker = str(tmp_path / "hang-marker")  # an argument no other process has
    command = (sys.executable, MANUAL, "--batch-size", "{batch}", "--optimizer", "--hang-at", "1", "--tag", marker)
    # Long enough for a loaded machine to start python and torch and make its one step before it hangs.
    hung = run_command_trial(CommandTrial(command=command, memory_budget_bytes=BUDGET, timeout_s=15), 8)
    assert hung.status == TIMEOUT and "still running after 15 s (--trial-timeout), 1 optimizer step(s) of the 3" \
        in hung.error
    assert hung.peak_memory_bytes and hung.wall_s < 15 + 10
    assert _running(marker) == []
