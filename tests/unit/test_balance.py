"""Balancing stages by measured cost: the pure parts (imbalance, per-stage compute, the split by times)."""

from __future__ import annotations

import pytest

from mbtune.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, LOSS
from mbtune.pipeline.balance import stage_compute_s, stage_imbalance
from mbtune.pipeline.split import split_blocks
from mbtune.pipeline.timeline import ActionRecord
from mbtune.records import TimelineAction


def _action(stage: int, kind: str, start_s: float, end_s: float, microbatch: int = 0) -> ActionRecord:
    return ActionRecord(step=0, accum=0, stage=stage, kind=kind, microbatch=microbatch, start_s=start_s, end_s=end_s)


def test_imbalance_is_slowest_over_fastest():
    assert stage_imbalance([1.0, 3.0, 2.0]) == pytest.approx(3.0)
    assert stage_imbalance([2.0, 2.0]) == pytest.approx(1.0)


@pytest.mark.parametrize("times", [[], [1.0], [0.0, 1.0], [-1.0, 1.0]])
def test_imbalance_is_none_without_two_stages_that_worked(times):
    assert stage_imbalance(times) is None


def test_stage_compute_sums_every_compute_kind_and_gives_the_loss_to_its_stage():
    actions = [
        _action(0, FORWARD, 0.0, 1.0), _action(0, BACKWARD, 5.0, 7.0),
        _action(1, FORWARD, 1.0, 1.5), _action(1, LOSS, 1.5, 1.75),
        _action(1, BACKWARD_INPUT, 2.0, 3.0), _action(1, BACKWARD_WEIGHT, 3.0, 3.5),
        _action(1, FORWARD, 4.0, 4.5, microbatch=1),
    ]
    assert stage_compute_s(actions, 3) == pytest.approx((3.0, 2.75, 0.0))


def test_stage_compute_reads_saved_timeline_actions_too():
    actions = [TimelineAction(rank=r, stage=r, kind=FORWARD, microbatch=0, accum=0, start_s=0.0, end_s=0.25 * (r + 1))
               for r in range(2)]
    assert stage_compute_s(actions, 2) == pytest.approx((0.25, 0.5))


def test_stage_compute_skips_kinds_that_are_not_stage_work():
    assert stage_compute_s([_action(0, "send", 0.0, 9.0)], 1) == (0.0,)


def test_stage_compute_refuses_an_action_outside_the_stages():
    with pytest.raises(ValueError, match="stage 2 is outside the 2 model stages"):
        stage_compute_s([_action(2, FORWARD, 0.0, 1.0)], 2)


def test_a_block_ten_times_heavier_by_time_gets_a_stage_with_fewer_blocks():
    by_parameters = split_blocks(6, 3, [1000] * 6)
    by_time = split_blocks(6, 3, [1.0, 1.0, 10.0, 1.0, 1.0, 1.0])
    assert by_parameters == ((0, 1), (2, 3), (4, 5))
    heavy_stage = next(blocks for blocks in by_time if 2 in blocks)
    assert len(heavy_stage) < len(next(blocks for blocks in by_parameters if 2 in blocks))
    assert by_time == ((0, 1), (2,), (3, 4, 5))


def test_balanced_by_time_the_stages_come_out_more_even():
    times = [1.0, 1.0, 10.0, 1.0, 1.0, 1.0]

    def per_stage(split):
        return [sum(times[b] for b in blocks) for blocks in split]

    even = stage_imbalance(per_stage(split_blocks(6, 3, times)))
    by_count = stage_imbalance(per_stage(split_blocks(6, 3, [1.0] * 6)))
    assert even is not None and by_count is not None and even < by_count
