"""`mbtune confirm` on real commands: the cap in every Python process of the command, the environment's
own sitecustomize still run, and the exit codes."""

from __future__ import annotations

import sys

import pytest

from mbtune.cli import main
from mbtune.probing.confirm import CRASHED, FITS, OUT_OF_MEMORY, ConfirmConfig, confirm_command

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
