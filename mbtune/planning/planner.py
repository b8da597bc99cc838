"""Predict configurations with the calibrated simulator, check their memory, rank them. Pure: no torch.

Scaling to another number of stages: the cost model holds per-block costs (calibrate.py), so a stage of
any split costs the sum of its blocks, split as the runner would split them (by parameter count). A what-if
deeper model (`num_blocks` above the workload's) keeps the first and last blocks and repeats the mean of
the interior ones. Where no depth is chosen and a point has more stages than the workload has blocks, that
point alone is planned one block per stage: a prediction depends only on its own configuration, never on
which other schedules are listed beside it. Beyond this machine, the stage-to-stage hand-over costs the link's latency plus the
boundary activation (bytes per sample x micro-batch size) over its bandwidth; data-parallel replicas add a
ring all-reduce of each rank's fp32 gradients after the pipeline (not overlapped: an upper bound). Compute
costs stay those of the profiled device: the plan is for devices like it.

Where the cost model knows how measured durations scatter (CostModel.spread), a prediction is the median
of several simulated steps with costs drawn from that scatter (fixed seeds, so the same point always gets
the same answer and every point sees the same draws), as the measured step time is the median of steps.
With scatter "none" (with_scatter) the spread is dropped and one simulated step of average costs is the
prediction: the scatter of a busy machine is part of what it predicts, so a plan for a quieter target can
leave it out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from mbtune.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMPUTE_KINDS, FORWARD
from mbtune.pipeline.point import SweepPoint, micro_batch_size_for
from mbtune.pipeline.theory import (
    DEFAULT_STAGES_PER_RANK,
    check_point,
    schedule_info,
    stage_to_rank,
    stages_per_rank_of,
    theoretical_bubble,
)
from mbtune.planning.calibrate import point_orders
from mbtune.planning.hardware import Link, allreduce_s, transfer_s
from mbtune.planning.memory import activation_bytes, point_split
from mbtune.planning.orders import RankOrders
from mbtune.planning.records import (
    SCATTER_MEASURED,
    SCATTER_MODES,
    SCATTER_NONE,
    BlockCost,
    BlockFacts,
    CostModel,
    LinearCost,
    PlanReport,
    Prediction,
    Simulation,
    SkippedPoint,
    Spread,
    StageCost,
    Validation,
)
from mbtune.planning.simulate import Jitter, Overheads, simulate_draws

SPREAD_SAMPLES = 15  # simulated steps behind one prediction where the spread is known
SAMPLED_ACTIONS = 1_500_000  # at most this many simulated actions per prediction (but 3 steps at least): a huge
# pipeline joins so many actions that one simulated step already shows most of what the scatter costs


@dataclass(frozen=True, kw_only=True)
class PlanGrid:
    """The configurations to predict: every schedule x micro-batch count, at one size of the pipeline."""

    num_ranks: int  # pipeline ranks
    micro_batches: tuple[int, ...]
    schedules: tuple[str, ...]
    data_parallel_size: int = 1
    micro_batch_size: int | None = None  # or derived from global_batch
    global_batch: int | None = None
    grad_accum_steps: int = 1
    stages_per_rank: int = DEFAULT_STAGES_PER_RANK
    num_blocks: int | None = None  # what-if deeper model for every point; None: the workload's own
    deepen_as_needed: bool = True  # without num_blocks, a point with too few blocks gets one block per stage
    recompute: tuple[str, ...] = ("none",)  # activation recompute modes, every point in each


def with_scatter(model: CostModel, scatter: str) -> CostModel:
    """The model as the scatter mode predicts with it: measured keeps the calibrated spread (costs drawn from
    it), none drops it (average costs, one deterministic simulated step)."""
    if scatter not in SCATTER_MODES:
        raise ValueError(f"unknown scatter mode {scatter!r}; known: {', '.join(SCATTER_MODES)}")
    return replace(model, spread=Spread()) if scatter == SCATTER_NONE and model.spread.known else model


def without_per_sample_memory(facts: BlockFacts) -> BlockFacts:
    """The facts with no activation bytes per sample: a calibration over them takes each measured peak less
    parameter state as the base, and predicted memory per rank is that base plus parameter state."""
    return replace(facts, saved_bytes_per_sample=())


def point_depth(num_blocks: int, point: SweepPoint) -> int:
    """The blocks a point is planned with when no depth is chosen: the workload's own where they give every
    stage one, else one per stage (ranks x stages per rank)."""
    return max(num_blocks, point.num_ranks * point.stages_per_rank)


def deepen(model: CostModel, num_blocks: int) -> CostModel:
    """The cost model of the same workload with `num_blocks` blocks: first and last kept, interior repeated
    as their mean (costs, parameters, weights, activation sizes)."""
    facts = model.facts
    if num_blocks == facts.num_blocks:
        return model
    if facts.num_blocks < 3 or num_blocks < 3:
        raise ValueError(f"cannot resize a {facts.num_blocks}-block workload to {num_blocks} blocks: "
                         "resizing repeats interior blocks, so both need at least 3")
    interior = range(1, facts.num_blocks - 1)
    count = num_blocks - 2

    def repeat_interior(values: Sequence, mean: object) -> tuple:
        return (values[0], *([mean] * count), values[-1]) if values else ()

    def avg(values: Sequence[float]) -> float:
        return sum(values[i] for i in interior) / len(interior)

    mean_block = BlockCost(**{kind: _mean_cost([getattr(model.blocks[i], kind) for i in interior])
                              for kind in COMPUTE_KINDS})
    new_facts = BlockFacts(
        num_blocks=num_blocks, parameters=repeat_interior(facts.parameters, round(avg(facts.parameters))),
        split_weights=repeat_interior(facts.split_weights, avg(facts.split_weights)) if facts.split_weights else (),
        weights=repeat_interior(facts.weights, avg(facts.weights)), weight_source=facts.weight_source,
        output_bytes_per_sample=repeat_interior(facts.output_bytes_per_sample, round(avg(facts.output_bytes_per_sample)))
        if facts.output_bytes_per_sample else (),
        saved_bytes_per_sample=repeat_interior(facts.saved_bytes_per_sample, round(avg(facts.saved_bytes_per_sample)))
        if facts.saved_bytes_per_sample else (),
    )
    return replace(model, blocks=repeat_interior(model.blocks, mean_block), facts=new_facts)


def _mean_cost(costs: Sequence[LinearCost]) -> LinearCost:
    return LinearCost(fixed_s=sum(c.fixed_s for c in costs) / len(costs),
                      per_sample_s=sum(c.per_sample_s for c in costs) / len(costs))


def stage_costs(model: CostModel, split: Sequence[Sequence[int]], micro_batch_size: int,
                recompute: str = "none") -> tuple[StageCost, ...]:
    """Seconds per micro-batch of every stage of a split: the sum of its blocks (loss on the last). With full
    recompute a backward runs the stage's forward again; split in an input and a weight part, each part
    does (two autograd calls, each recomputing)."""
    costs = []
    for stage, blocks in enumerate(split):
        parts = {kind: sum(getattr(model.blocks[b], kind).at(micro_batch_size) for b in blocks)
                 for kind in COMPUTE_KINDS}
        again = parts[FORWARD] if recompute == "full" else 0.0
        loss = model.loss.at(micro_batch_size) if stage == len(split) - 1 else 0.0
        costs.append(StageCost(forward_s=parts[FORWARD], backward_s=parts[BACKWARD] + again,
                               backward_input_s=parts[BACKWARD_INPUT] + again,
                               backward_weight_s=parts[BACKWARD_WEIGHT] + again, loss_s=loss))
    return tuple(costs)


def simulate_point(model: CostModel, point: SweepPoint, *, link: Link | None = None,
                   orders_of: Callable[[SweepPoint], RankOrders] = point_orders,
                   keep_timeline: bool = False, seed: int | None = None) -> Simulation:
    """Simulate one optimizer step's pipeline part of a point (ValueError where its schedule cannot run).
    Where the spread is known, the median of several draws, or the one draw `seed` (a median's seed again
    gives that median, timeline and all, for a fraction of the work)."""
    split = point_split(point, model.facts)
    owners = stage_to_rank(point.schedule, point.num_ranks, len(split))
    size = point.micro_batch_size
    transfers = tuple(transfer_s(model, link, blocks[-1], size,
                                  crosses=link is not None and link.crosses(owners[s], owners[s + 1]))
                      for s, blocks in enumerate(split[:-1]))
    overheads = Overheads(transfer_s=transfers, send_s=model.send_s, gap_s=model.gap_s, start_s=model.start_s)
    orders = orders_of(point)
    costs = stage_costs(model, split, size, point.recompute)

    def run(jitters: Sequence[Jitter | None], keep: bool) -> list[Simulation]:
        return simulate_draws(orders, stage_to_rank=owners, stage_costs=costs, overheads=overheads,
                              num_accum=point.grad_accum_steps, keep_timeline=keep, jitters=jitters)

    if not model.spread.known:
        return run([None], keep_timeline)[0]
    seeds = [seed] if seed is not None else range(spread_samples(sum(map(len, orders)) * point.grad_accum_steps))
    steps = sorted(run([Jitter(model.spread, s) for s in seeds], False), key=lambda sim: sim.pipeline_s)
    median = steps[len(steps) // 2]
    return run([Jitter(model.spread, median.seed)], True)[0] if keep_timeline and median.seed is not None else median


def spread_samples(actions: int) -> int:
    """Simulated steps behind one prediction where the spread is known, for a point of `actions` actions a
    step: as many as SAMPLED_ACTIONS allows, 3 to SPREAD_SAMPLES, odd (the median is one of them)."""
    return max(3, min(SPREAD_SAMPLES, SAMPLED_ACTIONS // max(1, actions))) | 1


def point_actions(point: SweepPoint) -> int:
    """Compute actions one optimizer step of a point simulates: a forward and a backward (split in an input
    and a weight part by the zero-bubble schedules) per stage and micro-batch, every accumulation step (at
    most, for dualpipev, which splits some of its backwards)."""
    kinds = 3 if schedule_info(point.schedule).splits_backward else 2
    return kinds * point.num_ranks * point.stages_per_rank * point.num_micro_batches * point.grad_accum_steps


def simulated_actions(point: SweepPoint, scatter: str = SCATTER_MEASURED) -> int:
    """Actions simulated to predict a point (at most: without a measured spread it is simulated once)."""
    actions = point_actions(point)
    return actions * spread_samples(actions) if scatter == SCATTER_MEASURED else actions


def predict(model: CostModel, point: SweepPoint, *, link: Link | None = None, memory_limit_bytes: float | None = None,
            tokens_per_sample: int | None = None, orders_of: Callable[[SweepPoint], RankOrders] = point_orders,
            keep_timeline: bool = False, seed: int | None = None) -> Prediction:
    """Predict one point: step time (pipeline + data-parallel all-reduce + update), throughput, bubble, and
    memory per rank checked against the limit. `seed`: see simulate_point."""
    sim = simulate_point(model, point, link=link, orders_of=orders_of, keep_timeline=keep_timeline, seed=seed)
    split = point_split(point, model.facts)
    owners = stage_to_rank(point.schedule, point.num_ranks, len(split))
    params = [0] * point.num_ranks
    for stage, blocks in enumerate(split):
        params[owners[stage]] += sum(model.facts.parameters[b] for b in blocks)
    allreduce = allreduce_s(max(params), point.data_parallel_size, link, model, num_ranks=point.num_ranks)
    update = model.update_fixed_s + model.update_per_parameter_s * max(params)
    step = sim.pipeline_s + allreduce + update
    per_stage = stage_memory_bytes(model, split, sim.peak_in_flight, point.micro_batch_size, point.recompute)
    memory = [model.base_bytes] * point.num_ranks
    for stage, stage_bytes in enumerate(per_stage):
        memory[owners[stage]] += stage_bytes
    rate = point.global_batch / step if step > 0 else 0.0
    return Prediction(
        point=point, blocks_per_stage=tuple(len(b) for b in split), step_time_s=step, pipeline_s=sim.pipeline_s,
        allreduce_s=allreduce, update_s=update, samples_per_s=rate,
        tokens_per_s=rate * tokens_per_sample if tokens_per_sample else None, bubble=sim.bubble,
        bubble_theoretical=theoretical_bubble(point.schedule, num_ranks=point.num_ranks,
                                              num_micro_batches=point.num_micro_batches,
                                              stages_per_rank=point.stages_per_rank),
        peak_in_flight=sim.peak_in_flight, stage_memory_bytes=per_stage, memory_bytes=tuple(memory),
        memory_limit_bytes=memory_limit_bytes,
        fits=None if memory_limit_bytes is None else max(memory) <= memory_limit_bytes, timeline=sim.timeline,
        seed=sim.seed,
    )


def stage_memory_bytes(model: CostModel, split: Sequence[Sequence[int]], held: Sequence[int],
                       micro_batch_size: int, recompute: str = "none") -> tuple[float, ...]:
    """Per stage: its parameter state (weights, gradients, optimizer state) and its peak in-flight activations
    (micro-batches held x micro-batch size x saved bytes per sample of its blocks). With full recompute a
    held micro-batch keeps only each block's input (the previous block's output), and one block's saved
    activations come back at a time, in its backward."""
    return tuple(
        model.state_bytes_per_parameter * sum(model.facts.parameters[b] for b in blocks)
        + activation_bytes(model.facts, blocks, held[stage], micro_batch_size, recompute)
        for stage, blocks in enumerate(split))


def grid_points(grid: PlanGrid, num_blocks: int | None) -> tuple[list[SweepPoint], list[SkippedPoint]]:
    """The grid's points, and those that cannot run with why (schedule constraints, blocks, batch split)."""
    points, skipped = [], []
    for schedule in grid.schedules:
        v = stages_per_rank_of(schedule, grid.stages_per_rank)
        for m in grid.micro_batches:
            size, bad_split = _micro_batch_size(grid, m)
            for recompute in grid.recompute:
                point = SweepPoint(schedule=schedule, num_ranks=grid.num_ranks, num_micro_batches=m,
                                   grad_accum_steps=grid.grad_accum_steps, micro_batch_size=size, stages_per_rank=v,
                                   data_parallel_size=grid.data_parallel_size, recompute=recompute)
                reason = bad_split or check_point(schedule, v * grid.num_ranks, grid.num_ranks, m,
                                                  num_blocks=num_blocks)
                if reason and "blocks, too few" in reason:
                    reason += "; plan a deeper model of the same blocks (--blocks)"
                (skipped.append(SkippedPoint(point=point, reason=reason)) if reason else points.append(point))
    return points, skipped


def _micro_batch_size(grid: PlanGrid, m: int) -> tuple[int, str | None]:
    if grid.global_batch is None:
        return grid.micro_batch_size or 1, None
    return micro_batch_size_for(grid.global_batch, num_micro_batches=m, grad_accum_steps=grid.grad_accum_steps,
                                data_parallel_size=grid.data_parallel_size)


def plan(model: CostModel, grid: PlanGrid, *, link: Link | None = None, memory_limit_bytes: float | None = None,
         memory_limit_source: str = "", tokens_per_sample: int | None = None,
         orders_of: Callable[[SweepPoint], RankOrders] = point_orders, validation: Validation | None = None,
         warnings: Sequence[str] = (), scatter: str = SCATTER_MEASURED, per_sample_memory: bool = True) -> PlanReport:
    """Predict every point of the grid, rank them (fitting ones by throughput first, then those whose memory
    is unknown, then those that do not fit) and recommend the best that fits. `scatter`: see with_scatter.
    `per_sample_memory` False leaves in-flight activations out of memory per rank (its base should then be
    calibrated without them too, see without_per_sample_memory)."""
    if grid.num_blocks is not None:
        model = deepen(model, grid.num_blocks)
    model = with_scatter(model, scatter)
    if not per_sample_memory:
        model = replace(model, facts=without_per_sample_memory(model.facts))
    auto = grid.num_blocks is None and grid.deepen_as_needed and model.facts.num_blocks >= 3
    points, skipped = grid_points(grid, None if auto else model.facts.num_blocks)
    models = {model.facts.num_blocks: model}
    predictions = []
    for point in points:
        depth = point_depth(model.facts.num_blocks, point) if auto else model.facts.num_blocks
        if depth not in models:
            models[depth] = deepen(model, depth)
        deep = models[depth]
        try:
            predictions.append(predict(deep, point, link=link, memory_limit_bytes=memory_limit_bytes,
                                       tokens_per_sample=tokens_per_sample, orders_of=orders_of))
        except ValueError as exc:
            skipped.append(SkippedPoint(point=point, reason=getattr(exc, "message", str(exc))))
    ranked = sorted(predictions, key=lambda p: ({True: 0, None: 1, False: 2}[p.fits], -p.samples_per_s))
    recommended = 0 if ranked and ranked[0].fits is not False else None
    notes = list(warnings) + _depth_notes(model, ranked) + plan_notes(
        model, data_parallel=grid.data_parallel_size > 1, link=link, scatter=scatter,
        memory_limit_bytes=memory_limit_bytes)
    return PlanReport(workload=model.workload, workload_options=dict(model.workload_options), model=model,
                      num_blocks=model.facts.num_blocks, scatter=scatter, per_sample_memory=per_sample_memory,
                      predictions=tuple(ranked), skipped=tuple(skipped),
                      recommended=recommended, validation=validation, warnings=tuple(notes),
                      memory_limit_bytes=memory_limit_bytes, memory_limit_source=memory_limit_source,
                      link_bandwidth_bytes_per_s=link.bandwidth_bytes_per_s if link else None,
                      link_latency_s=link.latency_s if link else None,
                      ranks_per_node=link.ranks_per_node if link else None)


def plan_notes(model: CostModel, *, data_parallel: bool, link: Link | None, scatter: str,
               memory_limit_bytes: float | None) -> list[str]:
    """What a plan says of its own inputs: the model's notes, the scatter, where the all-reduce and the
    hand-overs between nodes come from, and whether memory is checked."""
    notes = list(model.notes)
    if scatter == SCATTER_MEASURED and not model.spread.known:
        notes.append("no scatter measured: predictions use the average costs")
    if data_parallel and (link is None or link.bandwidth_bytes_per_s is None):
        if model.allreduce_bytes_per_s:
            notes.append(f"data-parallel all-reduce charged at {model.allreduce_bytes_per_s / 1e9:.2f} GB/s, the "
                         f"effective ring bandwidth measured over {model.allreduce_points} data-parallel point(s)")
        else:
            notes.append("data-parallel all-reduce taken as free: no data-parallel point was measured; sweep "
                         "with --data-parallel 2, or give --link-bandwidth")
    if link is not None and link.ranks_per_node is not None:
        across = ("the given link" if link.given else f"{model.inter_node_transfer.at(1) * 1e3:.3g} ms at one sample, "
                  f"calibrated on {model.inter_node_samples} hand-over(s) measured across nodes"
                  if model.inter_node_transfer is not None else
                  "as within a node: no hand-over across nodes was measured (sweep with --launcher torchrun "
                  "--nnodes 2, or give --link-bandwidth)")
        notes.append(f"{link.ranks_per_node} pipeline rank(s) per node: hand-overs between nodes cost {across}")
    if memory_limit_bytes is None:
        notes.append("no probed ceiling: memory per rank is predicted but not checked")
    return notes


def _depth_notes(model: CostModel, predictions: Sequence[Prediction]) -> list[str]:
    """Which schedules were planned deeper than the model, and that throughputs of different depths are of
    different models."""
    own = model.facts.num_blocks
    deeper: dict[int, list[str]] = {}
    for p in predictions:
        if p.num_blocks != own and p.point.schedule not in deeper.setdefault(p.num_blocks, []):
            deeper[p.num_blocks].append(p.point.schedule)
    if not deeper:
        return []
    planned = "; ".join(f"{', '.join(names)} as {depth} blocks" for depth, names in sorted(deeper.items()))
    note = (f"the {model.workload} model has {own} blocks, too few for one per stage: planned {planned}, its "
            "interior blocks repeated")
    if len({p.num_blocks for p in predictions}) > 1:
        note += "; rows of different depth are different models (choose one depth for all with --blocks)"
    return [note]
