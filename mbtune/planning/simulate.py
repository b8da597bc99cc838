"""One pipeline step simulated over per-rank action orders: the longest path through its dependency graph.
Pure: numpy, no torch.

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

The step is computed in vectorised passes over the graph's levels (step_graph.py), not one event at a time,
and for many draws of the costs at once: given Jitters, every compute action, hand-over and rank gap is
scaled by a factor drawn from the measured spread, one column of draws per Jitter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mbtune.actions import FORWARD, LOSS
from mbtune.planning.records import OrderedAction, Simulation, Spread, StageCost
from mbtune.planning.step_graph import KINDS, Layout, StepGraph, action_arrays, build_graph, layout, longest_path
from mbtune.records import TimelineAction


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
    """Factors drawn from a Spread by a seeded generator, one per action (compute), per hand-over from
    another rank (transfer) and per gap after an action: the same seed draws the same step."""

    def __init__(self, spread: Spread, seed: int) -> None:
        self.spread = spread
        self.seed = seed

    def draws(self, size: int) -> tuple[np.ndarray | float, np.ndarray | float, np.ndarray | float]:
        """Compute, transfer and gap factors for `size` actions (1.0 where that part has no spread)."""
        rng = np.random.default_rng(self.seed)
        return tuple(np.asarray(q, dtype=float)[rng.integers(0, len(q), size)] if q else 1.0  # type: ignore[return-value]
                     for q in (self.spread.compute, self.spread.transfer, self.spread.gap))


_GRAPHS: dict[tuple, tuple[object, StepGraph]] = {}  # recent graphs by their orders' identity
_GRAPHS_KEPT = 2  # a point's median draws, then its timeline


def step_graph(orders: Sequence[Sequence[OrderedAction]], stage_to_rank: Sequence[int], num_accum: int) -> StepGraph:
    """The orders' graph, built once for a run of simulations of the same orders (schedule_orders caches
    them, so the same point's orders are the same object)."""
    key = (id(orders), tuple(stage_to_rank), num_accum)
    held = _GRAPHS.get(key)
    if held is not None and held[0] is orders:
        return held[1]
    graph = build_graph(orders, stage_to_rank, num_accum)
    if len(_GRAPHS) >= _GRAPHS_KEPT:
        _GRAPHS.pop(next(iter(_GRAPHS)))
    _GRAPHS[key] = (orders, graph)
    return graph


def simulate(orders: Sequence[Sequence[OrderedAction]], *, stage_to_rank: Sequence[int],
             stage_costs: Sequence[StageCost], overheads: Overheads | None = None, num_accum: int = 1,
             keep_timeline: bool = True, jitter: Jitter | None = None) -> Simulation:
    """Simulate `num_accum` back-to-back pipeline steps (one optimizer step) of the given per-rank orders.

    `stage_costs[s]` are stage s's seconds per micro-batch; `stage_to_rank[s]` is the rank that holds it;
    `jitter` scatters the costs (None: every action costs exactly its stage cost).
    ValueError when the orders deadlock (an action waits for one that never runs before it).
    """
    return simulate_draws(orders, stage_to_rank=stage_to_rank, stage_costs=stage_costs, overheads=overheads,
                          num_accum=num_accum, keep_timeline=keep_timeline, jitters=[jitter])[0]


def simulate_draws(orders: Sequence[Sequence[OrderedAction]], *, stage_to_rank: Sequence[int],
                   stage_costs: Sequence[StageCost], overheads: Overheads | None = None, num_accum: int = 1,
                   keep_timeline: bool = False, jitters: Sequence[Jitter | None] = (None,)) -> list[Simulation]:
    """`simulate` for several draws of the costs in one pass, a Simulation per jitter (None: no scatter)."""
    if len(stage_costs) != len(stage_to_rank):
        raise ValueError(f"{len(stage_costs)} stage costs for {len(stage_to_rank)} stages")
    graph = step_graph(orders, stage_to_rank, num_accum)
    if graph.stuck is not None:
        n = graph.stuck
        raise ValueError(f"the action order deadlocks: rank {graph.rank[n]} waits forever at {KINDS[graph.kind[n]]} "
                         f"of stage {graph.stage[n]}, micro-batch {graph.microbatch[n]} (accumulation step "
                         f"{graph.accum[n]})")
    over = overheads or Overheads()
    places = layout(graph)
    duration, after, arrival = _costs(graph, places, stage_to_rank, stage_costs, over, jitters)
    start, end = longest_path(places, duration, after, arrival, over.start_s)
    ranks_of = graph.rank[places.order]
    took = end - start
    busy = np.stack([np.bincount(ranks_of, weights=took[:, column], minlength=graph.num_ranks)
                     for column in range(len(jitters))], axis=1) if graph.size else np.zeros((graph.num_ranks, len(jitters)))
    pipeline = end.max(axis=0) if graph.size else np.zeros(len(jitters))
    one = graph.accum == 0  # the first pipeline step's actions
    held = held_in_flight(graph.stage[one], graph.kind[one], graph.microbatch[one], graph.num_stages)
    out = []
    for column, jitter in enumerate(jitters):
        pipeline_s = float(pipeline[column])
        ranks = max(1, graph.num_ranks)
        bubble = 1.0 - float(busy[:, column].sum()) / (ranks * pipeline_s) if pipeline_s > 0 else 0.0
        timeline = _timeline(graph, places, stage_costs, start[:, column], end[:, column]) if keep_timeline else ()
        out.append(Simulation(pipeline_s=pipeline_s, busy_s=tuple(float(b) for b in busy[:, column]),
                              bubble=min(1.0, max(0.0, bubble)), peak_in_flight=held, timeline=timeline,
                              seed=None if jitter is None else jitter.seed))
    return out


def _costs(graph: StepGraph, places: Layout, stage_to_rank: Sequence[int], stage_costs: Sequence[StageCost],
           over: Overheads, jitters: Sequence[Jitter | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position (level order) and draw: its duration (the loss added to the last stage's forward), the
    time its rank spends after it (the start of the rank's next step included), and the extra time a
    neighbour's result takes to reach it."""
    order, size = places.order, graph.size
    owner = np.asarray(stage_to_rank, dtype=np.int64)
    per_kind = np.array([[c.of(kind) for kind in KINDS] for c in stage_costs], dtype=float).reshape(-1, len(KINDS))
    loss = np.array([c.loss_s for c in stage_costs], dtype=float)
    stage, kind, rank, nbr = graph.stage[order], graph.kind[order], graph.rank[order], graph.nbr[order]
    last = len(stage_to_rank) - 1
    compute = per_kind[stage, kind]
    with_loss = np.where((kind == 0) & (stage == last), loss[stage], 0.0)
    target = np.where(kind == 0, stage + 1, np.where(kind == 3, -1, stage - 1))
    target_rank = np.where((target >= 0) & (target <= last), owner[np.clip(target, 0, last)], -1)
    sends = (target_rank >= 0) & (target_rank != rank)
    crossing = (nbr < size) & (nbr >= 0) & (graph.rank[np.clip(nbr, 0, max(0, size - 1))] != rank)
    boundary = np.where(kind == 0, stage - 1, stage)  # the boundary between stages s and s+1 is boundary s
    transfer = np.array([over.transfer(b) for b in range(max(0, last))] + [0.0])[np.clip(boundary, 0, max(0, last))]
    step = np.where(sends, over.send_s, over.gap_s)
    lead = np.where(places.before_step, over.start_s, 0.0)
    sent = np.where(crossing, over.send_s, 0.0)
    moved = np.where(crossing, transfer, 0.0)
    duration, after, arrival = (np.empty((size, len(jitters))) for _ in range(3))
    for column, jitter in enumerate(jitters):
        c, t, g = jitter.draws(size) if jitter is not None else (1.0, 1.0, 1.0)
        duration[:, column] = compute * c + with_loss
        after[:, column] = step * g + lead
        arrival[:, column] = sent + moved * t
    return duration, after, arrival


def _timeline(graph: StepGraph, places: Layout, stage_costs: Sequence[StageCost], start: np.ndarray,
              end: np.ndarray) -> tuple[TimelineAction, ...]:
    last = len(stage_costs) - 1
    actions = []
    for position, n in enumerate(places.order.tolist()):
        rank, stage, kind = int(graph.rank[n]), int(graph.stage[n]), KINDS[graph.kind[n]]
        accum, microbatch = int(graph.accum[n]), int(graph.microbatch[n])
        loss = stage_costs[stage].loss_s if kind == FORWARD and stage == last else 0.0
        finish = float(end[position]) - loss if loss > 0 else float(end[position])
        actions.append(TimelineAction(rank=rank, stage=stage, kind=kind, microbatch=microbatch, accum=accum,
                                      start_s=float(start[position]), end_s=finish))
        if loss > 0:
            actions.append(TimelineAction(rank=rank, stage=stage, kind=LOSS, microbatch=microbatch, accum=accum,
                                          start_s=finish, end_s=float(end[position])))
    return tuple(sorted(actions, key=lambda a: (a.start_s, a.rank)))


def peak_in_flight(orders: Sequence[Sequence[OrderedAction]], num_model_stages: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations are held at once: a micro-batch is held from its
    forward until its backward is done (the weight part, where the backward is split). Exact for any timing,
    since a stage's actions run in its rank's order."""
    actions = [action_arrays(order) for order in orders]
    stage, kind, microbatch = np.concatenate(actions, axis=1) if actions else np.zeros((3, 0), dtype=np.int64)
    return held_in_flight(stage, kind, microbatch, num_model_stages)


def held_in_flight(stage: np.ndarray, kind: np.ndarray, microbatch: np.ndarray, num_stages: int) -> tuple[int, ...]:
    """peak_in_flight of one pipeline step's actions given as arrays, rank by rank in each rank's order."""
    if not stage.size:
        return (0,) * num_stages
    split = np.zeros((num_stages, int(microbatch.max()) + 1), dtype=bool)
    split[stage[kind == 3], microbatch[kind == 3]] = True
    release = (kind == 3) | (((kind == 1) | (kind == 2)) & ~split[stage, microbatch])
    change = (kind == 0).astype(np.int64) - release
    order = np.argsort(stage, kind="stable")  # a stage's actions in its rank's order
    running = np.cumsum(change[order])
    stages, first = np.unique(stage[order], return_index=True)
    before = np.concatenate([[0], running])[first]  # the running count where each stage's actions begin
    peaks = np.zeros(num_stages, dtype=np.int64)
    peaks[stages] = np.maximum.reduceat(running - np.repeat(before, np.diff(np.append(first, len(order)))), first)
    return tuple(int(x) for x in np.maximum(peaks, 0))


def uniform_costs(num_model_stages: int, *, forward_s: float = 1.0, backward_s: float = 2.0,
                  backward_input_s: float | None = None,
                  backward_weight_s: float | None = None) -> tuple[StageCost, ...]:
    """Equal costs on every stage (the textbook case); the split parts default to half the backward each."""
    half = backward_s / 2
    cost = StageCost(forward_s=forward_s, backward_s=backward_s,
                     backward_input_s=half if backward_input_s is None else backward_input_s,
                     backward_weight_s=half if backward_weight_s is None else backward_weight_s)
    return (cost,) * num_model_stages
