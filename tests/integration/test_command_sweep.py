"""A sweep of the user's own pipelined training command (torch.distributed.pipelining under torchrun, gloo on
the CPU), as it is: each point the command with its placeholders filled in, ended after its steps by the
step hook; the grid, ranking and profile as a workload sweep's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).parents[1] / "fixtures" / "train_scripts" / "pipe_loop.py")
COMMAND = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "{stages}", SCRIPT, "--batch-size",
           "{batch}", "--micro-batches", "{micro_batches}", "--accum", "{accum}", "--schedule", "{schedule}",
           "--width", "{width}"]


def test_mbtune_sweep_of_a_pipelined_command_measures_each_point_as_its_own_job(tmp_path: Path, capsys) -> None:
    from mbtune.cli import main
    from mbtune.saving.profiles import load_profile

    args = ["-q", "sweep", "-d", "cpu", "--stages", "2", "--schedules", "1f1b", "--micro-batches", "2",
            "--accum", "1", "--micro-batch-size", "8", "--repeats", "1", "--steps", "2", "--grid", "width=64,256",
            "--profiles-dir", str(tmp_path), "-f", "json", "--", *COMMAND]
    with pytest.raises(SystemExit) as ended:
        main(args)
    assert ended.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["workload"] == "pipe_loop" and printed["command"] == COMMAND
    results = printed["results"]
    assert sorted((r["point"]["schedule"], dict(r["point"]["grid"])["width"]) for r in results) == [
        ("1f1b", "256"), ("1f1b", "64")]
    for r in results:
        assert r["status"] == "ok", r["error"]
        assert len(r["step_times_s"]) == 2 and r["samples_per_s"] > 0  # the warm-up step left out
        assert len(r["peak_memory_bytes"]) == 2 and all(r["peak_memory_bytes"])  # each stage's own process
        assert r["bubble_theoretical"] == pytest.approx(1 / 3) and r["bubble_measured"] is None
    assert len(printed["ranking"]) == 2
    # The command's own setting reached it: 16x the weights (and 4x the activations) hold more on every rank.
    peaks = {(r["point"]["schedule"], dict(r["point"]["grid"])["width"]): r["peak_memory_bytes"] for r in results}
    assert all(wide > 2 * narrow for wide, narrow in zip(peaks["1f1b", "256"], peaks["1f1b", "64"]))
    (saved,) = tmp_path.glob("*/pipe-loop.json")
    sweep = load_profile(saved).sweep
    assert sweep is not None and sweep.command == tuple(COMMAND)


def test_a_sweep_command_with_a_placeholder_it_does_not_fill_is_one_line_exit_2(capsys) -> None:
    from mbtune.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["-q", "sweep", "-d", "cpu", "--no-save", "--", sys.executable, SCRIPT, "--batch-size", "{bs}"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "placeholder {bs}, which a sweep does not fill" in err
    assert len(err.strip().splitlines()) == 1
