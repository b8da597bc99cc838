"""A dependency-driven event simulation of one pipeline step over per-rank action orders. Pure: no torch.

Every rank runs its actions in the order its schedule gives (torch's own `pipeline_order`, see orders.py);
an action starts when its rank is free and its inputs have arrived:

- forward of stage s, micro-batch i: the forward of stage s-1 on i (its output),
- backward (full, or its input part) of stage s on i: its own forward on i, and the backward of stage s+1 on
  i (the gradient of its output); the last stage needs only its forward (and loss),
- backward_weight of stage s on i: the input part of the backward of stage s on i.

What comes from a neighbour stage follows the one rule in mbtune.actions (input_stage, output_stage).

An input from another rank arrives `send_s` (the sender posting it) plus the boundary's transfer time after
the producing action ends; from the same rank it is there at once. With free communication and equal costs
this reproduces the textbook bubbles exactly (tests/unit/test_plan_simulate.py).

Given a Jitter, every compute action, hand-over and rank gap is scaled by a factor drawn from the measured
spread: one simulated step of a machine whose actions scatter as the measured ones did.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from mbtune.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMPUTE_KINDS,
    FORWARD,
    LOSS,
    input_stage,
    output_stage,
)
from mbtune.planning.records import OrderedAction, Simulation, Spread, StageCost
from mbtune.records import TimelineAction

_GRAD = "grad"  # the key of a backward (full or input part): what the previous stage waits for
_WEIGHT = "weight"

Neighbours = dict[str, tuple[int | None, ...]]  # kind -> per stage, the neighbour stage (None: none)


@functools.lru_cache(maxsize=64)
def _neighbours(num_model_stages: int) -> tuple[Neighbours, Neighbours]:
    """Per compute kind and stage, input_stage and output_stage, looked up once per model depth rather
    than called for every simulated action."""
    last = num_model_stages - 1
    stages = range(num_model_stages)
    return ({kind: tuple(input_stage(kind, s, last) for s in stages) for kind in COMPUTE_KINDS},
            {kind: tuple(output_stage(kind, s, last) for s in stages) for kind in COMPUTE_KINDS})


@dataclass(frozen=True, kw_only=True)
class Overheads:
    """The time around the compute: a rank's own bookkeeping and the hand-over between ranks."""

    transfer_s: tuple[float, ...] = ()  # per stage boundary s -> s+1 (both directions); empty: free
    send_s: float = 0.0  # the sender's time to post a result for another rank
    gap_s: float = 0.0  # a rank's time between two actions otherwise
    start_s: float = 0.0  # before the first action of each pipeline step (schedule.step's own set-up)

    def transfer(self, boundary: int) -> float:
        return self.transfer_s[boundary] if boundary < len(self.transfer_s) else 0.0


class Jitter:
    """Factors drawn from a Spread by a seeded generator, so a simulation with the same seed repeats."""

    def __init__(self, spread: Spread, seed: int) -> None:
        self.spread = spread
        self.rng = random.Random(seed)

    def _draw(self, quantiles: tuple[float, ...]) -> float:
        return self.rng.choice(quantiles) if quantiles else 1.0

    def compute(self) -> float:
        return self._draw(self.spread.compute)

    def transfer(self) -> float:
        return self._draw(self.spread.transfer)

    def gap(self) -> float:
        return self._draw(self.spread.gap)


def simulate(orders: Sequence[Sequence[OrderedAction]], *, stage_to_rank: Sequence[int],
             stage_costs: Sequence[StageCost], overheads: Overheads | None = None, num_accum: int = 1,
             keep_timeline: bool = True, jitter: Jitter | None = None) -> Simulation:
    """Simulate `num_accum` back-to-back pipeline steps (one optimizer step) of the given per-rank orders.

    `stage_costs[s]` are stage s's seconds per micro-batch; `stage_to_rank[s]` is the rank that holds it;
    `jitter` scatters the costs (None: every action costs exactly its stage cost).
    ValueError when the orders deadlock (an action waits for one that never runs before it).
    """
    run = _Run(orders, stage_to_rank, stage_costs, overheads or Overheads(), num_accum, keep_timeline,
               jitter or Jitter(Spread(), 0))  # an empty spread draws 1.0
    run.execute()
    return run.result()


class _Run:
    """The state of one simulation: per-rank cursors, finish times, and who waits for what."""

    def __init__(self, orders: Sequence[Sequence[OrderedAction]], stage_to_rank: Sequence[int],
                 stage_costs: Sequence[StageCost], overheads: Overheads, num_accum: int, keep: bool,
                 jitter: Jitter) -> None:
        if len(stage_costs) != len(stage_to_rank):
            raise ValueError(f"{len(stage_costs)} stage costs for {len(stage_to_rank)} stages")
        self.orders = [tuple(order) for order in orders]
        self.owner = tuple(stage_to_rank)
        self.costs = tuple(stage_costs)
        self.over = overheads
        self.num_accum = num_accum
        self.keep = keep
        self.jitter = jitter
        self.last_stage = len(self.owner) - 1
        self.source, self.target = _neighbours(len(self.owner))
        num_ranks = len(self.orders)
        self.cursor = [0] * num_ranks
        self.free_s = [overheads.start_s] * num_ranks
        self.busy_s = [0.0] * num_ranks
        self.end_s: dict[tuple, float] = {}
        self.waiting: dict[tuple, list[int]] = {}
        self.timeline: list[TimelineAction] = []
        self.length = [len(order) * num_accum for order in self.orders]

    def action(self, rank: int, position: int) -> tuple[int, OrderedAction]:
        per_step = len(self.orders[rank])
        return position // per_step, self.orders[rank][position % per_step]

    def execute(self) -> None:
        ready = list(range(len(self.orders)))
        while ready:
            rank = ready.pop()
            while self.cursor[rank] < self.length[rank]:
                accum, act = self.action(rank, self.cursor[rank])
                deps = self.needs(accum, act)
                missing = next((key for key in deps if key not in self.end_s), None)
                if missing is not None:
                    self.waiting.setdefault(missing, []).append(rank)
                    break
                if accum > 0 and self.cursor[rank] % len(self.orders[rank]) == 0:
                    self.free_s[rank] += self.over.start_s  # each pipeline step starts afresh
                ready.extend(self.run(rank, accum, act, deps))
                self.cursor[rank] += 1
        stuck = [r for r in range(len(self.orders)) if self.cursor[r] < self.length[r]]
        if stuck:
            accum, act = self.action(stuck[0], self.cursor[stuck[0]])
            raise ValueError(f"the action order deadlocks: rank {stuck[0]} waits forever at {act.kind} of stage "
                             f"{act.stage}, micro-batch {act.microbatch} (accumulation step {accum})")

    def needs(self, accum: int, act: OrderedAction) -> list[tuple]:
        """The results an action waits for: the earlier part on its own stage (a backward its forward, a
        weight part its input part), then the neighbour stage's result it takes as input, if any."""
        kind, s, i = act.kind, act.stage, act.microbatch
        if kind not in self.source:
            raise ValueError(f"unknown action kind {kind!r}")
        source = self.source[kind][s]
        if kind == FORWARD:
            return [] if source is None else [(FORWARD, source, accum, i)]
        own = (_GRAD if kind == BACKWARD_WEIGHT else FORWARD, s, accum, i)
        return [own] if source is None else [own, (_GRAD, source, accum, i)]

    def arrival(self, key: tuple, rank: int, stage: int) -> float:
        """When a result is there for `rank` to run an action of `stage`: at once from its own rank, else
        after the send and the hand-over across the boundary between the two (neighbour) stages."""
        source = key[1]
        end = self.end_s[key]
        if self.owner[source] == rank:
            return end
        boundary = min(source, stage)  # the boundary between stages s and s+1 is boundary s
        return end + self.over.send_s + self.over.transfer(boundary) * self.jitter.transfer()

    def run(self, rank: int, accum: int, act: OrderedAction, deps: list[tuple]) -> list[int]:
        """Schedule one action whose inputs are all done; return the ranks its result wakes up."""
        start = self.free_s[rank]
        for key in deps:
            start = max(start, self.arrival(key, rank, act.stage))
        cost = self.costs[act.stage]
        duration = cost.of(act.kind) * self.jitter.compute()
        end = start + duration
        self.record(rank, act, accum, start, end, act.kind)
        if act.kind == FORWARD and act.stage == self.last_stage and cost.loss_s > 0:
            self.record(rank, act, accum, end, end + cost.loss_s, LOSS)
            end += cost.loss_s
        self.busy_s[rank] += end - start
        key = (FORWARD if act.kind == FORWARD else _WEIGHT if act.kind == BACKWARD_WEIGHT else _GRAD,
               act.stage, accum, act.microbatch)
        self.end_s[key] = end
        self.free_s[rank] = end + (self.over.send_s if self.sends(rank, act) else self.over.gap_s) * self.jitter.gap()
        return self.waiting.pop(key, [])

    def sends(self, rank: int, act: OrderedAction) -> bool:
        """Whether the action's result goes to another rank (the rank then posts a send)."""
        target = self.target[act.kind][act.stage]
        return target is not None and self.owner[target] != rank

    def record(self, rank: int, act: OrderedAction, accum: int, start: float, end: float, kind: str) -> None:
        if self.keep:
            self.timeline.append(TimelineAction(rank=rank, stage=act.stage, kind=kind, microbatch=act.microbatch,
                                                accum=accum, start_s=start, end_s=end))

    def result(self) -> Simulation:
        ends = list(self.end_s.values())
        pipeline_s = max(ends) if ends else 0.0
        ranks = max(1, len(self.orders))
        bubble = 1.0 - sum(self.busy_s) / (ranks * pipeline_s) if pipeline_s > 0 else 0.0
        return Simulation(pipeline_s=pipeline_s, busy_s=tuple(self.busy_s), bubble=min(1.0, max(0.0, bubble)),
                          peak_in_flight=peak_in_flight(self.orders, len(self.owner)),
                          timeline=tuple(sorted(self.timeline, key=lambda a: (a.start_s, a.rank))))


def peak_in_flight(orders: Sequence[Sequence[OrderedAction]], num_model_stages: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations are held at once: a micro-batch is held from its
    forward until its backward is done (the weight part, where the backward is split). Exact for any timing,
    since a stage's actions run in its rank's order."""
    splits = {(a.stage, a.microbatch) for order in orders for a in order if a.kind == BACKWARD_WEIGHT}
    held = [0] * num_model_stages
    peak = [0] * num_model_stages
    for order in orders:
        for a in order:
            if a.kind == FORWARD:
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind == BACKWARD_WEIGHT or (a.kind in (BACKWARD, BACKWARD_INPUT)
                                               and (a.stage, a.microbatch) not in splits):
                held[a.stage] -= 1
    return tuple(peak)


def uniform_costs(num_model_stages: int, *, forward_s: float = 1.0, backward_s: float = 2.0,
                  backward_input_s: float | None = None,
                  backward_weight_s: float | None = None) -> tuple[StageCost, ...]:
    """Equal costs on every stage (the textbook case); the split parts default to half the backward each."""
    half = backward_s / 2
    cost = StageCost(forward_s=forward_s, backward_s=backward_s,
                     backward_input_s=half if backward_input_s is None else backward_input_s,
                     backward_weight_s=half if backward_weight_s is None else backward_weight_s)
    return (cost,) * num_model_stages
