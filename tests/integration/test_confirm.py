"""`mbtune confirm` on real commands: the cap in every Python process of the command, the environment's
own sitecustomize still run, and the exit codes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mbtune.cli import main
from mbtune.probing.command import CommandTrial, run_command_trial
from mbtune.probing.confirm import CRASHED, FITS, OUT_OF_MEMORY, ConfirmConfig, ConfirmResult, confirm_command
from mbtune.probing.high_water import EVALUATION
from mbtune.probing.records import ProbeResult
from mbtune.records import OK

pytestmark = pytest.mark.integration

ALLOCATE = "import sys, torch; kept = [torch.empty(int(sys.argv[1]), dtype=torch.uint8) for _ in range(4)]"


def test_a_command_fits_or_runs_out_of_memory_by_its_live_tensor_bytes():
    budget = 64 * 2**20
    fits = confirm_command(ConfirmConfig(
        command=[sys.executable, "-c", ALLOCATE, str(8 * 2**20)],
        memory_budget_bytes=budget, runs=1))
    over = confirm_command(ConfirmConfig(
        command=[sys.executable, "-c", ALLOCATE, str(20 * 2**20)],
        memory_budget_bytes=budget, runs=1))
    assert fits.runs[0].outcome == FITS and fits.runs[0].peak_bytes == 4 * 8 * 2**20 and fits.exit_code == 0
    assert over.runs[0].outcome == OUT_OF_MEMORY and over.exit_code == 1
    assert over.runs[0].peak_bytes == 3 * 20 * 2**20  # the fourth never held


def test_every_python_process_of_the_command_is_capped_and_the_environments_sitecustomize_still_runs(tmp_path, monkeypatch):
    own = tmp_path / "own"
    own.mkdir()
    marker = tmp_path / "marker"
    (own / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    monkeypatch.setenv("PYTHONPATH", str(own))
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {ALLOCATE!r}, str(30 * 2**20)], check=True)"
    result = confirm_command(ConfirmConfig(
        command=[sys.executable, "-c", child],
        memory_budget_bytes=64 * 2**20, runs=1))
    assert result.runs[0].outcome == OUT_OF_MEMORY  # the grandchild held 90 MiB of a 64 MiB budget
    assert result.runs[0].processes == 2 and marker.read_text() == "ran\nran\n"


def test_a_crash_exits_3_and_says_why(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["-q", "confirm", "--memory-budget", "64MiB", "--runs", "1", "-d", "cpu", "--", sys.executable, "-c",
              "import torch; raise SystemExit('the data is missing')"])
    out = capsys.readouterr().out
    assert ended.value.code == 3 and "the data is missing" in out and CRASHED in out


EVAL_LOOP = str(Path(__file__).parents[1] / "fixtures" / "train_scripts" / "eval_loop.py")


def test_a_run_for_a_duration_names_the_evaluation_pass_that_raised_its_peak(tmp_path, capsys):
    # The script's evaluation (batch 2048, every 3 steps) holds more than its training steps (batch 8) by
    # construction; a checkpoint follows it. The duration leaves a loaded machine's start-up (import torch
    # took 5 s here beside two other test runs) time for a few steps.
    with pytest.raises(SystemExit) as ended:
        main(["-q", "confirm", "--memory-budget", "64MiB", "-d", "cpu", "--duration", "15s", "-f", "json", "--",
              sys.executable, EVAL_LOOP, "--batch-size", "8", "--eval-every", "3",
              "--checkpoint", str(tmp_path / "model.pt")])
    result = ConfirmResult.from_dict(json.loads(capsys.readouterr().out))
    run = result.runs[0]
    assert ended.value.code == 0 and result.duration_s == 15.0 and (run.outcome, run.stopped) == (FITS, True)
    memory = run.high_water
    assert memory is not None and memory.num_evaluations >= 1 and memory.num_checkpoints >= 1
    assert memory.rose and memory.peak_bytes == run.peak_bytes
    assert memory.settled_peak_bytes is not None and memory.settled_peak_bytes < memory.peak_bytes
    rise = memory.largest_rise
    assert rise is not None and rise.during == EVALUATION and rise.to_bytes == memory.peak_bytes
    assert any(p.kind == EVALUATION and p.raised for p in memory.passes)
    assert memory.samples and memory.num_alloc_retries is None  # CPU: no allocator to retry


def test_trials_count_the_evaluation_passes_and_checkpoints_their_steps_reached(tmp_path):
    command = (sys.executable, EVAL_LOOP, "--batch-size", "{batch}", "--checkpoint", str(tmp_path / "model.pt"))
    budget = 64 * 2**20
    before = run_command_trial(CommandTrial(command=(*command, "--eval-after", "600"), memory_budget_bytes=budget), 8)
    every = run_command_trial(CommandTrial(command=(*command, "--eval-every", "1"), memory_budget_bytes=budget), 8)
    assert before.status == OK and (before.num_evaluations, before.num_checkpoints) == (0, 0), before.error_tail
    assert every.status == OK and every.num_evaluations >= 2 and every.num_checkpoints >= 2, every.error_tail


def test_a_probe_confirms_its_safe_batch_over_a_run(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["-q", "probe", "--memory-budget", "64MiB", "-d", "cpu", "--no-save", "--granularity", "8",
              "--max-batch", "8", "--margin", "0", "--confirm-duration", "10s", "-f", "json", "--",
              sys.executable, EVAL_LOOP, "--batch-size", "{batch}", "--eval-every", "3"])
    probe = ProbeResult.from_dict(json.loads(capsys.readouterr().out))
    assert ended.value.code == 0 and probe.safe_batch == 8 and probe.confirmed is not None
    run = probe.confirmed.runs[0]
    assert run.outcome == FITS and probe.confirmed.command[-3:] == ("8", "--eval-every", "3")
    assert run.high_water is not None and run.high_water.settled_steps == probe.steps
    # The trials' steps (2) came before the first evaluation (after step 3).
    assert all(t.num_evaluations == 0 and t.num_checkpoints == 0 for t in probe.trials if t.ok)
