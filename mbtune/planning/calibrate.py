"""Fit the simulator's cost model to measured timelines. Pure: no torch.

What is measured, and how each cost is read from it (every PointResult keeps the action timeline of its median
measured optimizer step, each rank's times relative to its own start after the step's barrier; a timeline of
another step is first scaled by the point's median step over that step, see typical_step_scale):

- Compute. Each action's duration, shared among the stage's blocks in proportion to the blocks' weights
  (forward FLOPs, see BlockFacts), gives per-block samples; per block and kind, the trimmed mean at each
  micro-batch size, fitted as fixed + per-sample over the sizes measured. A stage of any other split costs
  the sum of its blocks, which is how costs measured on this machine's split carry over to more stages.
  Where the backward ran whole, its input and weight parts are taken as half each (both are one matmul
  per forward matmul) until a zero-bubble point measures them.
- Rank overheads. The gap between two actions of one rank whose next action's inputs were already on that
  rank: after an action that sends its result to another rank it is `send_s` (posting the send), otherwise
  `gap_s`; trimmed means, like compute, since a step pays the sum of its gaps, not their median.
- Transfer. Ranks leave the step's barrier a few milliseconds apart, so their clocks disagree by an unknown
  offset. The forward gap (stage s ends, stage s+1 starts on the same micro-batch) carries +offset and the
  backward gap (stage s+1's backward ends, stage s's starts) -offset; the smallest of each is a hand-over
  to an idle receiver, which takes the same time both ways, so half their difference is the offset (as NTP
  estimates it). With the offset taken out, every hand-over whose receiver was idle when the data left is a
  sample; their trimmed mean less the sender's `send_s` is the transfer time (a mean, not the minimum: on a
  busy machine hand-overs have a long tail, and a step pays for it).
- Update. The measured step minus the end of its last action and its all-reduce: optimizer step and
  barriers, charged per parameter of the rank that holds the most.
- All-reduce (data-parallel points). The ring volume of the gradients of the rank that holds the most
  over the measured all-reduce time: an effective bandwidth, the median over the points.
- Spread. Every measured action over its fitted stage cost, every hand-over over the fitted transfer and
  every rank gap over its mean, kept as quantiles: the simulator draws from them (see planner.py), since a
  pipeline waits for the slowest of the actions it joins and costs that are only ever average predict a
  step that is too short.
- Memory. Each rank's measured peak less its parameter state (weights, gradients, optimizer state) and its
  in-flight activations (peak micro-batches held, from the schedule order, x saved bytes per sample; under
  full recompute each block's input and one block's saved activations, see activation_bytes) gives the
  base (runtime, allocator); the median over ranks and points.
- Recompute. A backward under full recompute runs the forward again (a split backward in each of its
  parts): the same micro-batch's measured forward at that stage is taken off it before it is shared
  among the blocks.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
)
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.theory import stage_to_rank
from mbtune.planning.fit import fit_samples, median_or, quantiles, trimmed_mean
from mbtune.planning.memory import (
    STATE_BYTES_PER_PARAMETER,
    allreduce_volume_bytes,
    base_bytes,
    point_split,
    rank_parameters,
)
from mbtune.planning.orders import RankOrders, schedule_orders
from mbtune.planning.records import (
    BlockCost,
    BlockFacts,
    CostModel,
    LinearCost,
    Spread,
)
from mbtune.records import TimelineAction
from mbtune.sweeping.records import PointResult


def point_orders(point: SweepPoint) -> RankOrders:
    """The per-rank action orders of a point's schedule."""
    return schedule_orders(point.schedule, num_ranks=point.num_ranks, num_micro_batches=point.num_micro_batches,
                           stages_per_rank=point.stages_per_rank)


def usable(results: Sequence[PointResult]) -> list[PointResult]:
    """The results a cost model can be fitted to: ok, timed, with a timeline."""
    return [r for r in results if r.ok and r.timeline and r.step_time_median_s]


@dataclass
class _Samples:
    """Everything read from the timelines, before fitting."""

    compute: dict[tuple[int, str], dict[int, list[float]]]  # (block, kind) -> size -> per-block seconds
    loss: dict[int, list[float]]
    send: list[float]
    gap: list[float]
    transfer_gaps: dict[int, list[float]]  # size -> skew-cancelled hand-over gap (send_s not yet taken off)
    inter_node_gaps: dict[int, list[float]]  # the same, of hand-overs that crossed a node boundary (torchrun)
    start: list[float]
    update_per_parameter: list[float]
    allreduce_bytes_per_s: list[float]
    actions: list[tuple[tuple[int, ...], str, int, float]]  # (the stage's blocks, kind, size, seconds)


def calibrate(results: Sequence[PointResult], facts: BlockFacts, *, workload: str,
              workload_options: dict[str, Any] | None = None, device: str = "", optimizer: str = "adamw",
              orders_of: Callable[[SweepPoint], RankOrders] = point_orders) -> CostModel:
    """Fit a CostModel to the timelines of the results that ran (see the module docstring for how).

    ValueError when no result has a timeline.
    """
    runs = usable(results)
    if not runs:
        raise ValueError("no point with a measured timeline to calibrate from; run a sweep first")
    samples = _Samples(defaultdict(lambda: defaultdict(list)), defaultdict(list), [], [], defaultdict(list),
                       defaultdict(list), [], [], [], [])
    for result in runs:
        _read(result, facts, samples)
    send_s = trimmed_mean(samples.send) if samples.send else 0.0
    state = STATE_BYTES_PER_PARAMETER.get(optimizer, 16.0)
    blocks, split_measured = _block_costs(samples.compute, facts.num_blocks)
    transfer = fit_samples({size: [max(0.0, g - send_s) for g in gaps] for size, gaps in samples.transfer_gaps.items()},
                           proportional_when_single=False)
    inter_node = fit_samples({size: [max(0.0, g - send_s) for g in gaps]
                              for size, gaps in samples.inter_node_gaps.items()},
                             proportional_when_single=False) if samples.inter_node_gaps else None
    if inter_node is not None and not samples.transfer_gaps:
        transfer = inter_node  # every hand-over measured crossed nodes
    gap_s = trimmed_mean(samples.gap) if samples.gap else 0.0
    notes = _notes(runs, samples, split_measured)
    return CostModel(
        workload=workload, workload_options=dict(workload_options or {}), device=device, blocks=blocks, facts=facts,
        loss=fit_samples(samples.loss), transfer=transfer, send_s=send_s, gap_s=gap_s,
        start_s=median_or(samples.start), update_per_parameter_s=median_or(samples.update_per_parameter),
        base_bytes=base_bytes(runs, facts, state, orders_of), state_bytes_per_parameter=state,
        micro_batch_sizes=tuple(sorted({r.point.micro_batch_size for r in runs})), num_points=len(runs),
        split_backward_measured=split_measured, spread=_spread(samples, blocks, transfer, send_s, gap_s),
        notes=notes, allreduce_bytes_per_s=median_or(samples.allreduce_bytes_per_s) or None,
        allreduce_points=len(samples.allreduce_bytes_per_s), inter_node_transfer=inter_node,
        inter_node_samples=sum(map(len, samples.inter_node_gaps.values())),
    )


def _read(result: PointResult, facts: BlockFacts, samples: _Samples) -> None:
    point = result.point
    split = result.stage_blocks or point_split(point, facts)  # the split that ran, where the result says
    owners = stage_to_rank(point.schedule, point.num_ranks, len(split))
    size = point.micro_batch_size
    spans = _spans(result.timeline, typical_step_scale(result))
    for span in spans.values():
        _share(span, split, facts, size, samples, _recomputed_s(span, spans) if point.recompute == "full" else 0.0)
    _rank_gaps(spans, owners, samples)
    for crossed, gap in _transfer_gaps(spans, owners, result):
        (samples.inter_node_gaps if crossed else samples.transfer_gaps)[size].append(gap)
    first = [s.start_s for s in spans.values() if s.stage == 0 and s.accum == 0]
    if first:
        samples.start.append(min(first))
    _update(result, spans, split, owners, facts, samples)


@dataclass
class _Span:
    """One compute action, with the loss that follows a last-stage forward folded in (end_s includes it)."""

    rank: int
    stage: int
    kind: str
    accum: int
    microbatch: int
    start_s: float
    compute_end_s: float
    end_s: float


def typical_step_scale(result: PointResult) -> float:
    """Median step over the step the timeline was taken from: 1 where the timeline shows the median step (as
    the sweep keeps it); a step that ran slower or faster than usual (a neighbour on a shared machine, a cold
    cache) is scaled to a typical one, assuming the difference spread evenly over its actions."""
    step = result.timeline_step
    if step >= len(result.step_times_s) or not result.step_time_median_s or result.step_times_s[step] <= 0:
        return 1.0
    return result.step_time_median_s / result.step_times_s[step]


def _spans(timeline: Sequence[TimelineAction], scale: float = 1.0) -> dict[tuple[str, int, int, int], _Span]:
    spans: dict[tuple[str, int, int, int], _Span] = {}
    losses = []
    for a in timeline:
        if a.kind not in ACTION_KINDS:
            continue  # the all-reduce: no stage's compute (see _update)
        if a.kind == LOSS:
            losses.append(a)
            continue
        spans[(a.kind, a.stage, a.accum, a.microbatch)] = _Span(
            a.rank, a.stage, a.kind, a.accum, a.microbatch, a.start_s * scale, a.end_s * scale, a.end_s * scale)
    for a in losses:
        owner = spans.get((FORWARD, a.stage, a.accum, a.microbatch))
        if owner is not None:
            owner.end_s = max(owner.end_s, a.end_s * scale)
    return spans


def _recomputed_s(span: _Span, spans: dict[tuple[str, int, int, int], _Span]) -> float:
    """Under full recompute, the forward a backward ran again: that micro-batch's own forward at that stage,
    as measured. A backward split in an input and a weight part runs it in each part (two autograd calls,
    and a non-reentrant checkpoint recomputes for each)."""
    if span.kind not in (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
        return 0.0
    forward = spans.get((FORWARD, span.stage, span.accum, span.microbatch))
    return forward.compute_end_s - forward.start_s if forward is not None else 0.0


def _share(span: _Span, split: Sequence[Sequence[int]], facts: BlockFacts, size: int, samples: _Samples,
           recomputed_s: float = 0.0) -> None:
    """The span's compute shared among its stage's blocks, less the forward it ran again (recompute)."""
    duration = max(0.0, span.compute_end_s - span.start_s - recomputed_s)
    blocks = split[span.stage]
    weights = [max(facts.weights[b], 1e-3 * max(facts.weights)) for b in blocks]
    total = sum(weights)
    for block, weight in zip(blocks, weights):
        samples.compute[(block, span.kind)][size].append(duration * weight / total)
    samples.actions.append((tuple(blocks), span.kind, size, duration))
    if span.end_s > span.compute_end_s:
        samples.loss[size].append(span.end_s - span.compute_end_s)


def _needs_remote(span: _Span, owners: Sequence[int]) -> bool:
    source = input_stage(span.kind, span.stage, len(owners) - 1)
    return source is not None and owners[source] != span.rank


def _sends_remote(span: _Span, owners: Sequence[int]) -> bool:
    target = output_stage(span.kind, span.stage, len(owners) - 1)
    return target is not None and owners[target] != span.rank


def _rank_gaps(spans: dict, owners: Sequence[int], samples: _Samples) -> None:
    by_rank: dict[int, list[_Span]] = defaultdict(list)
    for span in spans.values():
        by_rank[span.rank].append(span)
    for rank_spans in by_rank.values():
        rank_spans.sort(key=lambda s: s.start_s)
        for before, after in itertools.pairwise(rank_spans):
            if before.accum != after.accum or _needs_remote(after, owners):
                continue
            gap = max(0.0, after.start_s - before.end_s)
            (samples.send if _sends_remote(before, owners) else samples.gap).append(gap)


def _transfer_gaps(spans: dict, owners: Sequence[int], result: PointResult) -> list[tuple[bool, float]]:
    """Hand-over gaps where the receiver was idle, with the two ranks' clock offset taken out, each with
    whether it crossed a node boundary.

    Per stage boundary between two ranks, the offset is half the difference between the smallest backward
    and the smallest forward gap (a hand-over to an idle receiver takes the same time both ways)."""
    previous = _previous_on_rank(spans)
    last = len(owners) - 1
    found: list[tuple[bool, float]] = []
    for s in range(last):
        if owners[s] == owners[s + 1]:
            continue
        crossed = result.crosses_nodes(owners[s], owners[s + 1])
        forward = [(span, sender) for span in spans.values() if span.kind == FORWARD and span.stage == s + 1
                   and (sender := _sender(spans, span, last)) is not None]
        backward = [(span, sender) for span in spans.values() if span.kind in (BACKWARD, BACKWARD_INPUT)
                    and span.stage == s and (sender := _sender(spans, span, last)) is not None]
        if not forward or not backward:
            continue
        forward_gaps = [r.start_s - snd.end_s for r, snd in forward]
        backward_gaps = [r.start_s - snd.compute_end_s for r, snd in backward]
        offset = (min(backward_gaps) - min(forward_gaps)) / 2  # receiver's clock origin minus sender's
        for (receiver, sender), gap in zip(forward, forward_gaps):
            before = previous.get(id(receiver))
            if before is None or before.end_s + offset <= sender.end_s:
                found.append((crossed, gap + offset))
        for (receiver, sender), gap in zip(backward, backward_gaps):
            before = previous.get(id(receiver))
            if before is None or before.end_s - offset <= sender.compute_end_s:
                found.append((crossed, gap - offset))
    return found


def _sender(spans: dict[tuple[str, int, int, int], _Span], receiver: _Span, last_stage: int) -> _Span | None:
    """The span of the neighbour stage whose result `receiver` takes as input (see mbtune.actions)."""
    return find_input(spans, receiver.kind, receiver.stage, receiver.accum, receiver.microbatch, last_stage)


def _previous_on_rank(spans: dict) -> dict[int, _Span]:
    by_rank: dict[int, list[_Span]] = defaultdict(list)
    for span in spans.values():
        by_rank[span.rank].append(span)
    previous = {}
    for rank_spans in by_rank.values():
        rank_spans.sort(key=lambda s: s.start_s)
        previous.update({id(after): before for before, after in itertools.pairwise(rank_spans)})
    return previous


def _update(result: PointResult, spans: dict, split: Sequence[Sequence[int]], owners: Sequence[int],
            facts: BlockFacts, samples: _Samples) -> None:
    step_s = result.step_time_median_s  # the spans are scaled to a typical step
    last_end = max(s.end_s for s in spans.values())
    most = max(rank_parameters(split, owners, facts))
    allreduce_s = result.allreduce_s or 0.0
    if step_s and most > 0:
        samples.update_per_parameter.append(max(0.0, step_s - last_end - allreduce_s) / most)
    if allreduce_s > 0 and most > 0 and result.point.data_parallel_size > 1:
        samples.allreduce_bytes_per_s.append(allreduce_volume_bytes(most, result.point.data_parallel_size)
                                             / allreduce_s)


def _block_costs(compute: dict, num_blocks: int) -> tuple[tuple[BlockCost, ...], bool]:
    measured_split = any(kind == BACKWARD_INPUT for (_, kind) in compute)
    blocks = []
    for b in range(num_blocks):
        fit = {kind: fit_samples(compute[(b, kind)]) if (b, kind) in compute else None
               for kind in COMPUTE_KINDS}
        forward = fit[FORWARD] or LinearCost()
        full = fit[BACKWARD]
        inp, weight = fit[BACKWARD_INPUT], fit[BACKWARD_WEIGHT]
        if full is None:
            full = (inp or LinearCost()).plus(weight or LinearCost()) if inp or weight else forward.scaled(2.0)
        blocks.append(BlockCost(forward=forward, backward=full, backward_input=inp or full.scaled(0.5),
                                backward_weight=weight or full.scaled(0.5)))
    return tuple(blocks), measured_split


def _spread(samples: _Samples, blocks: Sequence[BlockCost], transfer: LinearCost, send_s: float,
            gap_s: float) -> Spread:
    """Each sample over what the fitted model says it costs (see the module docstring)."""
    compute = []
    for stage_blocks, kind, size, seconds in samples.actions:
        fitted = sum(getattr(blocks[b], kind).at(size) for b in stage_blocks)
        if fitted > 0:
            compute.append(seconds / fitted)
    measured = samples.transfer_gaps or samples.inter_node_gaps  # the ones `transfer` was fitted to
    hand_overs = [max(0.0, g - send_s) / transfer.at(size) for size, gaps in measured.items()
                  for g in gaps if transfer.at(size) > 0]
    gaps = [g / send_s for g in samples.send if send_s > 0] + [g / gap_s for g in samples.gap if gap_s > 0]
    return Spread(compute=quantiles(compute), transfer=quantiles(hand_overs), gap=quantiles(gaps))


def _notes(runs: Sequence[PointResult], samples: _Samples, split_measured: bool) -> tuple[str, ...]:
    notes = []
    sizes = sorted({r.point.micro_batch_size for r in runs})
    if len(sizes) == 1:
        notes.append(f"one micro-batch size measured ({sizes[0]}): compute is taken as proportional to it and "
                     "transfer as a fixed latency; other sizes are extrapolated")
    if not split_measured:
        notes.append("no zero-bubble point measured: backward input and weight parts are each taken as half the "
                     "full backward")
    inter = sum(map(len, samples.inter_node_gaps.values()))
    if not samples.transfer_gaps and not inter:
        notes.append("no stage-to-stage hand-over measured (one rank): transfer is taken as free")
    elif inter:
        within = ("; within a node, as measured there" if samples.transfer_gaps else
                  "; none within a node was measured, so within a node they are taken as the same")
        notes.append(f"{inter} hand-over(s) measured across nodes, calibrated apart (plan --ranks-per-node "
                     f"says which boundaries cross){within}")
    return tuple(notes)
