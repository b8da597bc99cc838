"""The simulator mbtune planned with before the vectorised one: one event at a time, in plain Python. Kept
here as the reference the vectorised simulator (mbtune/planning/simulate.py) is held to: the same orders and
costs give the same step, action by action."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from mbtune.actions import BACKWARD_WEIGHT, COMPUTE_KINDS, FORWARD, LOSS, input_stage, output_stage
from mbtune.planning.records import OrderedAction, Simulation, StageCost
from mbtune.planning.simulate import Overheads, peak_in_flight
from mbtune.records import TimelineAction

_GRAD = "grad"
_WEIGHT = "weight"

Neighbours = dict[str, tuple[int | None, ...]]


@functools.lru_cache(maxsize=64)
def _neighbours(num_model_stages: int) -> tuple[Neighbours, Neighbours]:
    last = num_model_stages - 1
    stages = range(num_model_stages)
    return ({kind: tuple(input_stage(kind, s, last) for s in stages) for kind in COMPUTE_KINDS},
            {kind: tuple(output_stage(kind, s, last) for s in stages) for kind in COMPUTE_KINDS})


class Scale:
    """Fixed factors in place of drawn ones (the reference draws nothing)."""

    def __init__(self, compute: float = 1.0, transfer: float = 1.0, gap: float = 1.0) -> None:
        self.compute_factor, self.transfer_factor, self.gap_factor = compute, transfer, gap

    def compute(self) -> float:
        return self.compute_factor

    def transfer(self) -> float:
        return self.transfer_factor

    def gap(self) -> float:
        return self.gap_factor


def simulate_events(orders: Sequence[Sequence[OrderedAction]], *, stage_to_rank: Sequence[int],
                    stage_costs: Sequence[StageCost], overheads: Overheads | None = None, num_accum: int = 1,
                    scale: Scale | None = None) -> Simulation:
    run = _Run(orders, stage_to_rank, stage_costs, overheads or Overheads(), num_accum, True, scale or Scale())
    run.execute()
    return run.result()


class _Run:
    """The state of one simulation: per-rank cursors, finish times, and who waits for what."""

    def __init__(self, orders: Sequence[Sequence[OrderedAction]], stage_to_rank: Sequence[int],
                 stage_costs: Sequence[StageCost], overheads: Overheads, num_accum: int, keep: bool,
                 jitter: Any) -> None:
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
