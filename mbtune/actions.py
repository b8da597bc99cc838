"""The actions of a pipeline step, and which neighbour stage's result each one needs. No torch import.

A pipeline step is made of actions: one stage does one kind of compute on one micro-batch. These are the
kinds' names (the words of every timeline, measured or simulated), and the one rule for what crosses a stage
boundary, which the measured timeline (idle by cause), the calibration and the simulator all follow:

- a forward at stage s takes its input from the forward of stage s-1 (none at the first stage) and hands
  its output to stage s+1 (none at the last);
- a backward, or its input part, at stage s takes the gradient of its output from the backward (or input
  part) of stage s+1 (none at the last stage) and hands the gradient of its input to stage s-1 (none at the
  first);
- the weight part of a backward and the loss cross no boundary.

Stages are numbered over the whole model, virtual stages included (0 .. last_stage). Whether a boundary is
also a hand-over between ranks depends on which rank holds each stage, which the callers know.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

FORWARD = "forward"
BACKWARD = "backward"  # full backward: input and weight gradients together
BACKWARD_INPUT = "backward_input"  # zero-bubble schedules: the input-gradient part of a backward
BACKWARD_WEIGHT = "backward_weight"  # ... and its weight-gradient part
LOSS = "loss"  # timed after the last stage's forward; not a compute action of its own in the schedules
# Data parallel: a rank's gradient all-reduce over the replicas, after its pipeline step and before the
# update. Timelines show it; it is no stage's compute and crosses no stage boundary.
ALLREDUCE = "allreduce"
COMPUTE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
ACTION_KINDS = (*COMPUTE_KINDS, LOSS)

# Per kind that takes an input from a neighbour stage: the kinds whose result that input is.
_PRODUCER_KINDS: dict[str, tuple[str, ...]] = {
    FORWARD: (FORWARD,),
    BACKWARD: (BACKWARD, BACKWARD_INPUT),
    BACKWARD_INPUT: (BACKWARD, BACKWARD_INPUT),
}

T = TypeVar("T")


def input_stage(kind: str, stage: int, last_stage: int) -> int | None:
    """The neighbour stage whose result an action of `kind` at `stage` needs, or None (see the module docstring)."""
    if kind == FORWARD:
        return stage - 1 if stage > 0 else None
    if kind == BACKWARD or kind == BACKWARD_INPUT:
        return stage + 1 if stage < last_stage else None
    return None


def output_stage(kind: str, stage: int, last_stage: int) -> int | None:
    """The neighbour stage an action of `kind` at `stage` hands its result to, or None."""
    if kind == FORWARD:
        return stage + 1 if stage < last_stage else None
    if kind == BACKWARD or kind == BACKWARD_INPUT:
        return stage - 1 if stage > 0 else None
    return None


def producer_kinds(kind: str) -> tuple[str, ...]:
    """The kinds of the action at `input_stage` whose result an action of `kind` needs (empty: none)."""
    return _PRODUCER_KINDS.get(kind, ())


def find_input(results: Mapping[tuple[str, int, int, int], T], kind: str, stage: int, accum: int,
               microbatch: int, last_stage: int) -> T | None:
    """The entry of `results`, keyed (kind, stage, accum, micro-batch), of the neighbour action whose result
    this action needs; None where it needs none or that action is not in `results`."""
    source = input_stage(kind, stage, last_stage)
    if source is None:
        return None
    for producer in _PRODUCER_KINDS[kind]:
        found = results.get((producer, source, accum, microbatch))
        if found is not None:
            return found
    return None
