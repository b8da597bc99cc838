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
    with pytest.raises(ConfigError, match="counts the steps of a command"):
        SweepConfig(workload="mlp", steps_from_output="step")


def test_each_ranks_peak_is_its_process_and_replicas_fold_onto_their_stage() -> None:
    agent = {"rank": None, "peak_bytes": 0, "step_times_s": []}  # torchrun's own process
    workers = [{"rank": r, "peak_bytes": 100 * (r + 1), "step_times_s": [0.1]} for r in (3, 0, 2, 1)]
    assert _peaks_by_rank([agent, *workers], 2) == (300, 400)  # ranks 0 and 2 on stage 0, 1 and 3 on stage 1
    unranked = [{"peak_bytes": 5, "step_times_s": [0.1], "started": 2.0}, {"peak_bytes": 7, "step_times_s": [0.1],
                                                                           "started": 1.0}]
    assert _peaks_by_rank(unranked, 2) == (7, 5)  # in the order they started
