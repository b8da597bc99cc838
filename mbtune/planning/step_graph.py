"""A pipeline step's actions as a dependency graph held in arrays, and its longest path in vectorised passes.
Pure: numpy, no torch.

Node n is one action of one accumulation step. It waits for up to three others: the action before it on its
rank (`prev`), the earlier part on its own stage (`own`: a backward its forward, a weight part its input
part), and the neighbour stage's result it takes as input (`nbr`, see mbtune.actions). Nodes are grouped in
levels (each node's predecessors all sit in earlier levels: Kahn's algorithm, one numpy pass per level), so
the times of a whole level are computed at once, and of many draws of the costs at once (a column each).
The graph depends only on the orders, the stage-to-rank map and the accumulation steps: it is built once per
shape and reused for every cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mbtune.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from mbtune.planning.records import OrderedAction

KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)  # kind codes are indices into this
_KEY = np.array([0, 1, 1, 2])  # per kind code, the result it leaves: forward output, input gradient, weight part


@dataclass(frozen=True, eq=False)
class StepGraph:
    """`num_accum` pipeline steps of per-rank orders. Node arrays have one entry per action; index `size`
    (one past the last node) is the sentinel standing for "nothing to wait for"."""

    num_ranks: int
    num_stages: int
    rank: np.ndarray
    stage: np.ndarray
    kind: np.ndarray  # index into KINDS
    microbatch: np.ndarray
    accum: np.ndarray
    step_start: np.ndarray  # bool: the first action of a rank's pipeline step
    prev: np.ndarray
    own: np.ndarray
    nbr: np.ndarray
    levels: tuple[np.ndarray, ...]
    stuck: int | None  # the first node that never runs (the orders deadlock), None: all run
    layout: Layout | None = None  # made once (see layout())

    @property
    def size(self) -> int:
        return len(self.rank)


def action_arrays(order: Sequence[OrderedAction]) -> np.ndarray:
    """One rank's actions as a (3, actions) array: stage, kind code (an index into KINDS), micro-batch."""
    code = {kind: index for index, kind in enumerate(KINDS)}
    try:
        kinds = [code[a.kind] for a in order]
    except KeyError as exc:
        raise ValueError(f"unknown action kind {exc.args[0]!r}") from None
    return np.array([[a.stage for a in order], kinds, [a.microbatch for a in order]], dtype=np.int64).reshape(3, -1)


def build_graph(orders: Sequence[Sequence[OrderedAction]], stage_to_rank: Sequence[int], num_accum: int) -> StepGraph:
    """The graph of `num_accum` back-to-back pipeline steps of the orders."""
    num_ranks, num_stages = len(orders), len(stage_to_rank)
    per_rank = []
    for r, order in enumerate(orders):
        one = action_arrays(order)
        tiled = np.tile(one, (1, num_accum))
        length = one.shape[1]
        accum = np.repeat(np.arange(num_accum), length)
        position = np.tile(np.arange(length), num_accum)
        per_rank.append((np.full(length * num_accum, r), tiled, accum, position))
    rank = np.concatenate([p[0] for p in per_rank]) if per_rank else np.zeros(0, np.int64)
    stage, kind, microbatch = (np.concatenate([p[1][i] for p in per_rank]) if per_rank else np.zeros(0, np.int64)
                               for i in range(3))
    accum = np.concatenate([p[2] for p in per_rank]) if per_rank else np.zeros(0, np.int64)
    position = np.concatenate([p[3] for p in per_rank]) if per_rank else np.zeros(0, np.int64)
    size = len(rank)
    if size and (stage.min() < 0 or stage.max() >= num_stages):
        raise ValueError(f"an action's stage is outside the {num_stages} stages")
    prev = np.arange(-1, size - 1)
    prev[position == 0] = size
    prev[(position == 0) & (accum > 0)] = np.flatnonzero((position == 0) & (accum > 0)) - 1
    own, nbr = _data_dependencies(stage, kind, microbatch, accum, num_stages, num_accum, size)
    levels, stuck = _levels(np.stack([prev, own, nbr]), size, rank)
    return StepGraph(num_ranks=num_ranks, num_stages=num_stages, rank=rank, stage=stage, kind=kind,
                     microbatch=microbatch, accum=accum, step_start=position == 0, prev=prev, own=own, nbr=nbr,
                     levels=levels, stuck=stuck)


def _data_dependencies(stage: np.ndarray, kind: np.ndarray, microbatch: np.ndarray, accum: np.ndarray,
                       num_stages: int, num_accum: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per node, the node of its own stage and of its neighbour stage it waits for (`size`: none; -1: one
    that no order runs, so the node waits forever)."""
    num_mb = int(microbatch.max()) + 1 if size else 1
    table = np.full((3, num_stages, num_accum, num_mb), -1, dtype=np.int64)
    table[_KEY[kind], stage, accum, microbatch] = np.arange(size)
    own = np.full(size, size)
    backward = kind != 0
    own_key = np.where(kind == 3, 1, 0)  # a weight part waits for its input part, a backward for its forward
    own[backward] = table[own_key[backward], stage[backward], accum[backward], microbatch[backward]]
    nbr = np.full(size, size)
    forward_in = (kind == 0) & (stage > 0)
    nbr[forward_in] = table[0, stage[forward_in] - 1, accum[forward_in], microbatch[forward_in]]
    grad_in = ((kind == 1) | (kind == 2)) & (stage < num_stages - 1)
    nbr[grad_in] = table[1, stage[grad_in] + 1, accum[grad_in], microbatch[grad_in]]
    return own, nbr


def _levels(preds: np.ndarray, size: int, rank: np.ndarray) -> tuple[tuple[np.ndarray, ...], int | None]:
    """Kahn's algorithm a level at a time. A node waiting for a missing action (-1) never runs; the first
    node that never runs (the lowest rank's earliest) is returned as stuck."""
    real = (preds >= 0) & (preds < size)
    missing = (preds < 0).any(axis=0)
    indegree = real.sum(axis=0) + missing  # a missing predecessor never arrives
    sources, targets = preds[real], np.broadcast_to(np.arange(size), preds.shape)[real]
    order = np.argsort(sources, kind="stable")
    targets = targets[order]
    starts = np.concatenate([[0], np.cumsum(np.bincount(sources, minlength=size))])
    frontier = np.flatnonzero(indegree == 0)
    levels, done = [], 0
    while frontier.size:
        levels.append(frontier)
        done += frontier.size
        counts = starts[frontier + 1] - starts[frontier]
        total = int(counts.sum())
        if not total:
            break
        offsets = np.repeat(starts[frontier] - np.cumsum(counts) + counts, counts) + np.arange(total)
        reached = targets[offsets]
        np.subtract.at(indegree, reached, 1)
        frontier = np.unique(reached[indegree[reached] == 0])
    if done == size:
        return tuple(levels), None
    ran = np.zeros(size, dtype=bool)
    ran[np.concatenate(levels) if levels else np.zeros(0, np.int64)] = True
    waiting = np.flatnonzero(~ran)
    return tuple(levels), int(waiting[np.argmin(rank[waiting] * size + waiting)])


@dataclass(frozen=True, eq=False)
class Layout:
    """The nodes in level order (a level is a slice of positions), what each position waits on, and which
    positions come right before their rank starts another pipeline step."""

    order: np.ndarray  # position -> node
    bounds: tuple[tuple[int, int], ...]  # each level's [start, end) of positions
    waits: np.ndarray  # (positions, 3): the rows of longest_path's `ready` (rank free, own stage's, neighbour's)
    before_step: np.ndarray  # bool: the rank's next action is the first of a pipeline step


def layout(graph: StepGraph) -> Layout:
    """The graph's level layout, made once and kept on the graph."""
    if graph.layout is not None:
        return graph.layout
    size = graph.size
    order = np.concatenate(graph.levels) if graph.levels else np.zeros(0, np.int64)
    sizes = np.cumsum([0, *(len(level) for level in graph.levels)]).tolist()
    position = np.empty(size + 1, dtype=np.int64)
    position[order] = np.arange(size)
    position[size] = size
    prev, own, nbr = (position[np.where(x[order] < 0, size, x[order])] for x in (graph.prev, graph.own, graph.nbr))
    waits = np.stack([np.where(prev < size, size + prev, 2 * size), np.where(own < size, own, 2 * size + 1),
                      np.where(nbr < size, nbr, 2 * size + 1)], axis=1)
    before_step = np.zeros(size, dtype=bool)
    starts = graph.step_start[order] & (prev < size)
    before_step[prev[starts]] = True
    made = Layout(order=order, bounds=tuple(zip(sizes[:-1], sizes[1:], strict=True)), waits=waits,
                  before_step=before_step)
    object.__setattr__(graph, "layout", made)
    return made


def longest_path(places: Layout, duration: np.ndarray, after: np.ndarray, arrival: np.ndarray,
                 start_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Start and end of every position (level order), a column per draw of the costs: a node starts when
    its rank is free (the previous node's end + its `after`; `start_s` before a rank's first step) and its
    inputs are there (own stage's: at its end; neighbour's: at its end + `arrival`); it lasts `duration`.
    Arrays are (positions, draws); `after` already holds the `start_s` before each later step.

    What a level waits for is one gather from `ready`: every position's end (rows 0..n-1), when its rank is
    free after it (rows n..2n-1), the start of a rank's first step (row 2n) and nothing (row 2n+1, zero)."""
    size, draws = duration.shape
    ready = np.zeros((2 * size + 2, draws))
    ready[2 * size] = start_s
    end, free = ready[:size], ready[size:2 * size]
    start = np.empty((size, draws))
    waits = places.waits
    for a, b in places.bounds:
        found = ready[waits[a:b]]  # (level, 3, draws): rank free, own stage's end, neighbour's end
        found[:, 2] += arrival[a:b]
        begin = found.max(axis=1)
        start[a:b] = begin
        np.add(begin, duration[a:b], out=end[a:b])
        np.add(end[a:b], after[a:b], out=free[a:b])
    return start, end.copy()
