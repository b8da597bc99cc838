"""The one rule for what crosses a stage boundary (mbtune.actions), which the measured timeline, the
calibration and the simulator share."""

from __future__ import annotations

import pytest

from mbtune.actions import (
    ACTION_KINDS,
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMPUTE_KINDS,
    FORWARD,
    LOSS,
    find_input,
    input_stage,
    output_stage,
    producer_kinds,
)

LAST = 3  # four stages: 0 1 2 3


def test_the_kinds_are_the_timeline_words() -> None:
    assert COMPUTE_KINDS == ("forward", "backward", "backward_input", "backward_weight")
    assert ACTION_KINDS == (*COMPUTE_KINDS, "loss")


@pytest.mark.parametrize(("kind", "inputs", "outputs"), [
    (FORWARD, (None, 0, 1, 2), (1, 2, 3, None)),
    (BACKWARD, (1, 2, 3, None), (None, 0, 1, 2)),
    (BACKWARD_INPUT, (1, 2, 3, None), (None, 0, 1, 2)),
    (BACKWARD_WEIGHT, (None,) * 4, (None,) * 4),
    (LOSS, (None,) * 4, (None,) * 4),
])
def test_each_kind_takes_from_and_hands_to_its_neighbour(kind: str, inputs: tuple, outputs: tuple) -> None:
    assert tuple(input_stage(kind, s, LAST) for s in range(LAST + 1)) == inputs
    assert tuple(output_stage(kind, s, LAST) for s in range(LAST + 1)) == outputs


@pytest.mark.parametrize("kind", ACTION_KINDS)
def test_one_stage_crosses_no_boundary(kind: str) -> None:
    assert input_stage(kind, 0, 0) is None and output_stage(kind, 0, 0) is None


@pytest.mark.parametrize("last", [0, 1, 2, 7])
def test_every_hand_over_is_received_by_the_action_it_is_for(last: int) -> None:
    # What stage s hands to t is what t takes from s, with the producer's kind among the receiver's producers.
    for kind in ACTION_KINDS:
        for s in range(last + 1):
            t = output_stage(kind, s, last)
            if t is not None:
                assert abs(t - s) == 1
                assert any(input_stage(k, t, last) == s and kind in producer_kinds(k) for k in ACTION_KINDS)
            source = input_stage(kind, s, last)
            if source is not None:
                assert any(output_stage(k, source, last) == s for k in producer_kinds(kind))


def test_find_input_looks_up_the_neighbours_result_of_the_same_micro_batch() -> None:
    results = {(FORWARD, 1, 0, 5): "f1", (BACKWARD_INPUT, 3, 0, 5): "i3", (BACKWARD, 2, 1, 5): "b2 other accum",
               (BACKWARD_WEIGHT, 2, 0, 5): "w2", (FORWARD, 2, 0, 4): "f2 other micro-batch"}
    assert find_input(results, FORWARD, 2, 0, 5, LAST) == "f1"
    assert find_input(results, BACKWARD, 2, 0, 5, LAST) == "i3"  # a split backward's input part sends the gradient
    assert find_input(results, BACKWARD_INPUT, 2, 0, 5, LAST) == "i3"
    assert find_input(results, BACKWARD, 1, 0, 5, LAST) is None  # stage 2's weight part sends nothing
    assert find_input(results, BACKWARD, 1, 1, 5, LAST) == "b2 other accum"
    assert find_input(results, FORWARD, 3, 0, 5, LAST) is None  # stage 2 forward ran on micro-batch 4 only
    assert find_input(results, FORWARD, 0, 0, 5, LAST) is None
    assert find_input(results, BACKWARD_WEIGHT, 2, 0, 5, LAST) is None
    assert find_input(results, LOSS, 3, 0, 5, LAST) is None
