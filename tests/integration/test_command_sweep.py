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
        # The cap timed its schedule's actions: the bubble is measured, as a workload's, never below nothing.
        assert r["bubble_theoretical"] == pytest.approx(1 / 3) and 0.0 < r["bubble_measured"] <= 1.0
        assert r["bubble_unmeasured"] == ""
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


MLP = str(Path(__file__).parents[1] / "fixtures" / "train_scripts" / "pipe_mlp.py")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipelined_commands_bubble_and_memory_are_those_of_the_same_point_as_a_workload(schedule: str,
                                                                                         capsys) -> None:
    """The user's hand-cut pipelined MLP and the built-in mlp (the same model, split at the same block) at the
    same point: each rank's actions, counted per optimizer step, are the schedule's; its bubble is the
    workload's within what two runs of one point differ by here; each rank's peak within a few percent (the
    same tensors, counted by the same counter)."""
    from mbtune.cli import main

    grid = ["-d", "cpu", "--stages", "2", "--schedules", schedule, "--micro-batches", "4", "--accum", "2",
            "--micro-batch-size", "32", "--repeats", "1", "--steps", "3", "--no-save", "-f", "json"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "{stages}", MLP,
               "--micro-batch-size", "{micro_batch_size}", "--micro-batches", "{micro_batches}", "--accum", "{accum}",
               "--schedule", "{schedule}", "--width", "512"]
    rows = []
    for args in ([*grid, "--", *command], ["-w", "mlp", "-O", "width=512", *grid]):
        with pytest.raises(SystemExit) as ended:
            main(["-q", "sweep", *args])
        assert ended.value.code == 0
        (row,) = json.loads(capsys.readouterr().out)["results"]
        assert row["status"] == "ok", row["error"]
        rows.append(row)
    mine, builtin = rows
    forwards = sorted((a["stage"], a["accum"], a["microbatch"]) for a in mine["timeline"] if a["kind"] == "forward")
    assert forwards == sorted((s, k, m) for s in range(2) for k in range(2) for m in range(4))
    assert len([a for a in mine["timeline"] if a["kind"] == "loss"]) == 8
    assert mine["bubble_theoretical"] == builtin["bubble_theoretical"] == pytest.approx(0.2)
    assert abs(mine["bubble_measured"] - builtin["bubble_measured"]) < 0.15
    for own, theirs in zip(mine["peak_memory_bytes"], builtin["peak_memory_bytes"], strict=True):
        assert own == pytest.approx(theirs, rel=0.05)


def test_a_command_that_runs_no_pipelining_schedule_says_its_bubble_was_not_measured(capsys) -> None:
    from mbtune.cli import main

    script = str(Path(__file__).parents[1] / "fixtures" / "train_scripts" / "plain_loop.py")
    with pytest.raises(SystemExit) as ended:
        main(["-q", "sweep", "-d", "cpu", "--stages", "1", "--schedules", "gpipe", "--micro-batches", "1",
              "--accum", "1", "--micro-batch-size", "8", "--repeats", "1", "--steps", "2", "--no-save", "-f", "json",
              "--", sys.executable, script, "--batch-size", "{batch}", "--width", "64"])
    assert ended.value.code == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["status"] == "ok" and row["bubble_measured"] is None
    assert row["bubble_unmeasured"] == "not measured (no torch.distributed.pipelining schedule ran)"


def test_mbtune_tune_of_a_pipelined_command_probes_its_hungriest_point_sweeps_under_the_budget_and_qualifies(
        tmp_path: Path, capsys) -> None:
    """tune -- COMMAND: the probe steps the command's {micro_batch_size} at the grid's hungriest point (GPipe,
    the most micro-batches); the sweep holds the global batch the safe size gives, each point's micro-batch
    size within it, under the probe's budget; one profile, which qualify --baseline re-runs; a profile of the
    command's sweep alone qualifies its sweep checks."""
    from mbtune.cli import main
    from mbtune.saving.profiles import load_profile

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "{stages}", MLP,
               "--micro-batch-size", "{micro_batch_size}", "--micro-batches", "{micro_batches}", "--schedule",
               "{schedule}", "--width", "64"]
    with pytest.raises(SystemExit) as ended:
        main(["-q", "tune", "-d", "cpu", "--memory-budget", "12MiB", "--resolution", "64", "--probe-steps", "2",
              "--stages", "2", "--schedules", "1f1b,gpipe", "--micro-batches", "2,4", "--accum", "1", "--repeats", "1",
              "--steps", "2", "--profiles-dir", str(tmp_path), "-f", "json", "--", *command])
    assert ended.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    probe, sweep = printed["probe"], printed["sweep"]
    at = probe["command"]
    assert at[at.index("--schedule") + 1] == "gpipe" and at[at.index("--micro-batches") + 1] == "4"
    assert at[at.index("--micro-batch-size") + 1] == "{batch}" and at[at.index("--nproc-per-node") + 1] == "2"
    assert probe["first_failing"] is not None  # the budget drew the line
    safe = probe["safe_batch"]
    points = [r["point"] for r in sweep["results"]]
    assert len({p["micro_batch_size"] * p["num_micro_batches"] for p in points}) == 1  # the global batch held
    assert all(p["micro_batch_size"] <= safe for p in points)
    assert all(r["status"] == "ok" and r["bubble_measured"] is not None for r in sweep["results"])
    (saved,) = tmp_path.glob("*/pipe-mlp.json")
    profile = load_profile(saved)
    assert profile.probe is not None and profile.sweep is not None and profile.sweep.command == tuple(command)

    # The command's sweep alone, saved, then qualified against: its sweep checks, no probe.
    alone = tmp_path / "alone"
    with pytest.raises(SystemExit) as ended:
        main(["-q", "sweep", "-d", "cpu", "--stages", "2", "--schedules", "1f1b", "--micro-batches", "2", "--accum",
              "1", "--micro-batch-size", "16", "--repeats", "1", "--steps", "2", "--profiles-dir", str(alone), "--",
              *command])
    assert ended.value.code == 0
    capsys.readouterr()
    (baseline,) = alone.glob("*/pipe-mlp.json")
    with pytest.raises(SystemExit) as ended:
        main(["-q", "qualify", "--baseline", str(baseline), "--no-history", "--repeats", "1", "-f", "json",
              "--profiles-dir", str(tmp_path / "runs")])
    verdict = json.loads(capsys.readouterr().out)
    names = {c["name"] for c in verdict["checks"]}
    assert "best throughput (samples/s)" in names and not any(n.startswith("ceiling") for n in names)
    assert verdict["sweep"]["results"][0]["point"]["micro_batch_size"] == 16
    assert ended.value.code in (0, 1, 4)
