"""How a sweep of the user's own command fills its placeholders and reads its processes' reports (pure)."""

from __future__ import annotations

import pytest

from mbtune.errors import ConfigError
from mbtune.pipeline.point import SweepPoint
from mbtune.sweeping.command import _peaks_by_rank, check_sweep_template, command_for
from mbtune.sweeping.config import SweepConfig

COMMAND = ("torchrun", "--nproc-per-node", "{stages}", "train.py", "--batch-size={batch}", "--m", "{micro_batches}",
           "--accum", "{accum}", "--schedule", "{schedule}", "--mbs", "{micro_batch_size}")


def test_each_placeholder_is_filled_from_the_point() -> None:
    point = SweepPoint(schedule="1f1b", num_ranks=2, num_micro_batches=4, grad_accum_steps=3, micro_batch_size=8)
    assert command_for(check_sweep_template(COMMAND), point) == [
        "torchrun", "--nproc-per-node", "2", "train.py", "--batch-size=32", "--m", "4", "--accum", "3", "--schedule",
        "1f1b", "--mbs", "8"]


def test_a_template_the_sweep_cannot_fill_is_refused() -> None:
    with pytest.raises(ConfigError, match="placeholder {lr}, which a sweep does not fill"):
        check_sweep_template(["python", "train.py", "{batch}", "{lr}"])
    with pytest.raises(ConfigError, match="no placeholder"):
        check_sweep_template(["python", "train.py", "--batch-size", "64"])
    with pytest.raises(ConfigError, match="no command to sweep"):
        check_sweep_template([])


def test_a_command_sweep_names_itself_after_its_script_and_refuses_what_needs_a_workload() -> None:
    config = SweepConfig(command=COMMAND, device="cpu", micro_batch_size=(8,))
    assert config.workload == "train" and SweepConfig(command=COMMAND, name="mine", device="cpu").workload == "mine"
    for setting, value in (("strategy", "quick"), ("balance", "time"), ("launcher", "torchrun")):
        with pytest.raises(ConfigError, match=f"{setting} {value} does not go with a command"):
            SweepConfig(command=COMMAND, device="cpu", **{setting: value})
    with pytest.raises(ConfigError, match="steps_from_output is for a sweep of your own command"):
        SweepConfig(workload="mlp", steps_from_output="step")
    with pytest.raises(ConfigError, match="grid is for a sweep of your own command"):
        SweepConfig(workload="mlp", grid=("lr=1,2",))


def test_each_ranks_peak_is_its_process_and_replicas_fold_onto_their_stage() -> None:
    agent = {"rank": None, "peak_bytes": 0, "step_times_s": []}  # torchrun's own process
    workers = [{"rank": r, "peak_bytes": 100 * (r + 1), "step_times_s": [0.1]} for r in (3, 0, 2, 1)]
    assert _peaks_by_rank([agent, *workers], 2) == (300, 400)  # ranks 0 and 2 on stage 0, 1 and 3 on stage 1
    unranked = [{"peak_bytes": 5, "step_times_s": [0.1], "started": 2.0}, {"peak_bytes": 7, "step_times_s": [0.1],
                                                                           "started": 1.0}]
    assert _peaks_by_rank(unranked, 2) == (7, 5)  # in the order they started


def test_the_commands_own_settings_join_the_grid_and_fill_its_placeholders() -> None:
    from mbtune.sweeping.grid import plan_grid

    command = ("python", "train.py", "--batch-size", "{batch}", "--lr", "{lr}", "--opt", "{opt}")
    config = SweepConfig(command=command, device="cpu", schedules=("gpipe",), micro_batches=(2,),
                         grad_accum_steps=(1,), micro_batch_size=(4,), grid=("lr=1e-4,3e-4", "opt=adamw,sgd"))
    assert config.grid == (("lr", ("1e-4", "3e-4")), ("opt", ("adamw", "sgd")))
    points = plan_grid(config, num_blocks=100).points
    assert [dict(p.grid) for p in points] == [{"lr": "1e-4", "opt": "adamw"}, {"lr": "1e-4", "opt": "sgd"},
                                              {"lr": "3e-4", "opt": "adamw"}, {"lr": "3e-4", "opt": "sgd"}]
    assert points[1].label.endswith("mbs=4 lr=1e-4 opt=sgd")
    assert command_for(config.command, points[1]) == ["python", "train.py", "--batch-size", "8", "--lr", "1e-4",
                                                      "--opt", "sgd"]
    assert SweepPoint.from_dict(points[1].to_dict()) == points[1]  # the journal and the profile keep it
    from mbtune.settings import build
    assert build(SweepConfig, {"command": command, "grid": {"lr": "1e-4,3e-4", "opt": ["adamw", "sgd"]},
                               "device": "cpu"}).grid == config.grid


@pytest.mark.parametrize(("grid", "message"), [
    (("lr",), "is not NAME=v1,v2"), (("lr=",), "needs its values"), (("lr=1,1",), "needs its values, each once"),
    (("schedule=a,b",), "not one of the sweep's own"), (("lr=1", "lr=2"), "given twice"),
    (("lr=1", "wd=0,0.1"), "--grid wd has no {wd} in the command")])
def test_a_grid_setting_that_cannot_be_swept_is_refused(grid: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SweepConfig(command=("python", "t.py", "{batch}", "{lr}"), device="cpu", grid=grid)


def test_a_placeholder_without_its_grid_setting_says_how_to_add_it() -> None:
    with pytest.raises(ConfigError) as caught:
        SweepConfig(command=("python", "t.py", "{batch}", "{lr}"), device="cpu")
    assert "--grid lr=v1,v2" in str(caught.value)
