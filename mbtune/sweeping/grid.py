"""The sweep: plan the grid (dropping points that cannot run, with the reason), run each point as a real
pipeline through pipeline/, turn what it measured into a PointResult, and rank the results.

Planning and ranking are pure functions; `run_point` is the one place that starts processes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mbtune.actions import ALLREDUCE
from mbtune.device.load import busy_warning
from mbtune.pipeline.point import SweepPoint, micro_batch_size_for
from mbtune.pipeline.theory import check_point, stages_per_rank, theoretical_bubble
from mbtune.records import OK, MachineLoad, TimelineAction
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.records import PointResult, SkippedPoint, SweepReport

if TYPE_CHECKING:
    from mbtune.pipeline.timeline import PipelineOutcome, StageReport

STABILITY_CV_PCT = 10.0


@dataclass(frozen=True, kw_only=True)
class Grid:
    """What the sweep will run and what it will not, with why."""

    points: tuple[SweepPoint, ...]
    skipped: tuple[SkippedPoint, ...]


def default_micro_batch_size(config: SweepConfig) -> int:
    """Without --micro-batch-size or --global-batch: the probed safe batch spread over the most
    micro-batches of the grid (so every pipeline step fits what one device held whole), else 4."""
    if config.safe_batch is None:
        return 4
    return max(1, config.safe_batch // max(config.micro_batch_counts))


def plan_grid(config: SweepConfig, *, num_blocks: int, num_ranks: int | None = None,
              max_processes: int | None = None, nnodes: int = 1) -> Grid:
    """Every (schedule, micro-batches, accumulation, replicas, micro-batch size) point, or the config's
    explicit points, split into runnable and skipped (with the reason). `max_processes`: the most ranks
    the device can hold (GPUs: one rank each); `nnodes`: the nodes a point's processes split over evenly."""
    points, skipped = [], []
    for point, reason in _candidates(config, num_ranks or config.num_ranks):
        reason = reason or check_point(point.schedule, point.stages_per_rank * point.num_ranks, point.num_ranks,
                                       point.num_microbatches, num_blocks=num_blocks)
        if reason is None and point.num_processes % nnodes:
            reason = f"{point.num_processes} process(es) do not split evenly over {nnodes} nodes"
        if reason is None and max_processes is not None and point.num_processes > max_processes:
            reason = (f"{point.num_ranks} stages x {point.data_parallel_size} replicas need {point.num_processes} "
                      f"GPUs, {max_processes} visible")
        safe = config.safe_batch_for(point.recompute)
        if reason is None and safe is not None and point.micro_batch_size > safe:
            with_recompute = " with full recompute" if point.recompute == "full" and config.recompute_safe_batch else ""
            reason = f"micro-batch size {point.micro_batch_size} is above the probed safe batch {safe}{with_recompute}"
        if reason:
            skipped.append(SkippedPoint(point=point, reason=reason))
        else:
            points.append(point)
    return Grid(points=tuple(points), skipped=tuple(skipped))


def _candidates(config: SweepConfig, p: int) -> list[tuple[SweepPoint, str | None]]:
    if config.points is not None:
        return [(replace(point, num_ranks=min(point.num_ranks, p)), None) for point in config.points]
    candidates = []
    for global_batch in config.global_batches or (None,):
        for schedule in config.schedules:
            v = stages_per_rank(schedule, config.virtual_stages)
            for m in config.micro_batch_counts:
                for accum in config.grad_accum_steps:
                    for dp in config.data_parallel_size:
                        for mbs, reason in _micro_batch_sizes(config, global_batch, m, accum, dp):
                            for recompute in config.recompute:
                                candidates.append((SweepPoint(
                                    schedule=schedule, num_ranks=p, num_microbatches=m, grad_accum_steps=accum,
                                    micro_batch_size=mbs, stages_per_rank=v, data_parallel_size=dp,
                                    recompute=recompute), reason))
    return candidates


def _micro_batch_sizes(config: SweepConfig, global_batch: int | None, m: int, accum: int,
                       dp: int) -> list[tuple[int, str | None]]:
    if global_batch is None:
        return [(size, None) for size in config.micro_batch_size or (default_micro_batch_size(config),)]
    return [micro_batch_size_for(global_batch, num_microbatches=m, grad_accum_steps=accum, data_parallel_size=dp)]


def summarize_point(point: SweepPoint, outcome: PipelineOutcome, *, tokens_per_sample: int | None,
                    flops_per_sample: float | None, peak_flops_total: float | None) -> PointResult:
    """Turn a pipeline outcome (pipeline.PipelineOutcome) into the sweep's PointResult."""
    theory = theoretical_bubble(point.schedule, num_ranks=point.num_ranks, num_microbatches=point.num_microbatches,
                                virtual_stages=point.stages_per_rank)
    if outcome.status != OK:
        return PointResult(point=point, status=outcome.status, error=outcome.error, bubble_theoretical=theory,
                           wall_s=outcome.wall_s, failed_rank=outcome.failed_rank,
                           failed_blocks=tuple(outcome.failed_blocks), error_kind=outcome.error_kind,
                           error_tail=outcome.error_detail)
    steps = tuple(outcome.step_times_s)
    median = statistics.median(steps)
    cv = 100.0 * statistics.pstdev(steps) / statistics.mean(steps) if len(steps) > 1 else 0.0
    samples_per_s = point.global_batch / median
    measured = outcome.measured_bubble
    warnings = []
    if cv > STABILITY_CV_PCT:
        warnings.append(f"step time varies {cv:.0f}% (over {STABILITY_CV_PCT:.0f}%): results unstable; "
                        "run more --steps or on a quieter machine")
    typical = median_step(steps)
    pipeline = outcome.pipeline_reports
    bubbles = step_bubbles(pipeline)
    allreduce = outcome.allreduce_times_s
    return PointResult(
        point=point, status=OK, step_times_s=steps, step_time_median_s=median, step_time_cv_pct=cv,
        samples_per_s=samples_per_s, repeat_step_time_medians_s=(median,),
        samples_per_s_min=point.global_batch / max(steps), samples_per_s_max=point.global_batch / min(steps),
        bubble_measured_min=min(bubbles) if bubbles else None, bubble_measured_max=max(bubbles) if bubbles else None,
        tokens_per_s=samples_per_s * tokens_per_sample if tokens_per_sample else None,
        mfu_pct=100.0 * flops_per_sample * samples_per_s / peak_flops_total
        if flops_per_sample and peak_flops_total else None,
        bubble_measured=measured, bubble_theoretical=theory,
        excess_idle_pct=100.0 * (measured - theory) if measured is not None else None,
        idle=outcome.idle_shares,
        peak_memory_bytes=outcome.peak_memory_bytes, loss=outcome.loss,
        allreduce_s=statistics.median(allreduce) if allreduce else None,
        stage_blocks=_stage_blocks(pipeline), stage_imbalance=_stage_imbalance(pipeline),
        warnings=tuple(warnings), timeline=step_timeline(pipeline, typical), timeline_step=typical,
        wall_s=outcome.wall_s, cuda_step_times_s=tuple(outcome.cuda_step_times_s),
        rank_nodes=tuple(r.node for r in pipeline) if any(r.node for r in pipeline) else (),
    )


def _stage_blocks(reports: Sequence[StageReport]) -> tuple[tuple[int, ...], ...]:
    """Per model stage, the blocks the ranks said it held."""
    held = {stage: blocks for r in reports for stage, blocks in zip(r.stage_indices, r.block_indices)}
    return tuple(held[stage] for stage in sorted(held))


def _stage_imbalance(reports: Sequence[StageReport]) -> float | None:
    """The slowest stage's compute over the fastest's, summed over the measured steps (balance.py)."""
    from mbtune.pipeline.balance import stage_compute_s, stage_imbalance

    stages = sum(len(r.stage_indices) for r in reports)
    return stage_imbalance(stage_compute_s((a for r in reports for a in r.actions), stages)) if stages else None


def nothing_measured(report: SweepReport) -> str | None:
    """Why a sweep that was not interrupted produced no usable result (no point ran), or None when one did:
    the first failed point's cause, else why the first point was skipped, else that the grid was empty."""
    if report.interrupted or any(r.ok for r in report.results):
        return None
    if report.results:
        first = report.results[0]
        cause = (first.error.strip().splitlines() or [first.status])[-1]
        return f"no sweep point completed: {len(report.results)} failed, the first ({first.point.label}) {first.status}: {cause}"
    if report.skipped:
        skipped = report.skipped[0]
        return (f"no sweep point could run: all {len(report.skipped)} were skipped, the first "
                f"({skipped.point.label}) because {skipped.reason}")
    return "no sweep point could run: the grid is empty"


def step_bubbles(reports: Sequence[StageReport]) -> list[float]:
    """The measured bubble of each measured step on its own (the spread of the point's bubble)."""
    from mbtune.pipeline.timeline import measured_bubble

    if not reports or not all(r.actions for r in reports):
        return []
    bubbles = []
    for step, walls in enumerate(zip(*(r.pipeline_times_s for r in reports))):
        if max(walls) > 0:
            bubbles.append(measured_bubble([r.busy_s(step) for r in reports], max(walls)))
    return bubbles


def merge_repeats(repeats: Sequence[PointResult]) -> PointResult:
    """One point run len(repeats) times, each in fresh processes: the median over every measured step,
    the ranges over the repeats' own medians, the typical repeat's timeline. A repeat that failed
    fails the point (what ran before it is not a result on its own)."""
    from mbtune.sweeping.stopping import interval

    first, n = repeats[0], len(repeats)
    failed = next((r for r in repeats if not r.ok), None)
    if failed is not None or n == 1:
        steps = first.step_times_s if failed is None else ()
        within = interval([first.point.global_batch / t for t in steps if t > 0], f"{len(steps)} steps of one run")
        return replace(failed or first, num_repeats=n, wall_s=sum(r.wall_s for r in repeats),
                       ci_half_pct=100.0 * within.half if within else None, ci_basis=within.basis if within else "")
    medians = [r.step_time_median_s for r in repeats if r.step_time_median_s is not None]
    assert len(medians) == n, "every repeat that completed has a median step time"
    typical_index = median_step(medians)
    typical = repeats[typical_index]
    steps = tuple(t for r in repeats for t in r.step_times_s)
    median = statistics.median(steps)
    rates = [first.point.global_batch / m for m in medians]
    bubbles = [r.bubble_measured for r in repeats if r.bubble_measured is not None]
    bubble = statistics.median(bubbles) if bubbles else None
    scale = medians[typical_index] / median
    spread_pct = 100.0 * (max(rates) - min(rates)) / statistics.median(rates)
    between = interval(rates, f"{n} repeats")
    load = merge_loads([r.load for r in repeats])
    reduces = [r.allreduce_s for r in repeats if r.allreduce_s is not None]
    per_run = {busy_warning(first.point.label, r.load) for r in repeats} | {None}
    warnings = [w for w in dict.fromkeys(w for r in repeats for w in r.warnings)
                if not w.startswith("step time") and w not in per_run]
    if (busy := busy_warning(first.point.label, load)) is not None:
        warnings.append(busy)
    if spread_pct > STABILITY_CV_PCT:
        warnings.insert(0, f"throughput varies {spread_pct:.0f}% across {n} repeats (over {STABILITY_CV_PCT:.0f}%): "
                           "results unstable; run more --repeats or on a quieter machine")
    return replace(
        typical, step_times_s=steps, step_time_median_s=median,
        step_time_cv_pct=100.0 * statistics.pstdev(steps) / statistics.mean(steps),
        samples_per_s=first.point.global_batch / median,
        tokens_per_s=typical.tokens_per_s * scale if typical.tokens_per_s else None,
        mfu_pct=typical.mfu_pct * scale if typical.mfu_pct else None,
        bubble_measured=bubble, bubble_measured_min=min(bubbles, default=None),
        bubble_measured_max=max(bubbles, default=None),
        excess_idle_pct=100.0 * (bubble - typical.bubble_theoretical)
        if bubble is not None and typical.bubble_theoretical is not None else None,
        cuda_step_times_s=tuple(t for r in repeats for t in r.cuda_step_times_s),
        peak_memory_bytes=tuple(max((b for b in per_rank if b is not None), default=None)
                                for per_rank in zip(*(r.peak_memory_bytes for r in repeats))),
        allreduce_s=statistics.median(reduces) if reduces else None,
        num_repeats=n, repeat_step_time_medians_s=tuple(medians), samples_per_s_min=min(rates),
        samples_per_s_max=max(rates), load=load, warnings=tuple(warnings),
        timeline_step=sum(len(r.step_times_s) for r in repeats[:typical_index]) + typical.timeline_step,
        wall_s=sum(r.wall_s for r in repeats),
        ci_half_pct=100.0 * between.half if between else None, ci_basis=between.basis if between else "",
    )


def merge_loads(loads: Sequence[MachineLoad | None]) -> MachineLoad | None:
    """The busiest view of the machine over several runs of one point."""
    known = [load for load in loads if load is not None]
    if not known:
        return None
    busiest = max(known, key=lambda load: (load.busy, load.other_cpu_share or 0.0))
    return replace(busiest, load_avg_1m=max((k.load_avg_1m for k in known if k.load_avg_1m is not None), default=None),
                   other_gpu_processes=tuple(dict.fromkeys(p for k in known for p in k.other_gpu_processes)))


def tied_with_best(results: Sequence[PointResult], ranking: Sequence[int], objective: str, *,
                   same_global_batch: bool = False) -> tuple[int, ...]:
    """Ranked points that, on this evidence, could be as good as the best one: a 95% test of their difference
    does not tell them apart. Throughput measured round-robin compares round by round (the rounds both ran,
    at least MIN_PAIRED_ROUNDS: the machine's drift over the run cancels in each round's ratio); otherwise the two
    95% intervals combined in quadrature (the interval of a difference of independent means); where a point
    has no interval, the ranges overlap. Bubble compares its ranges; memory is ranked exactly. With global
    batches held fixed, only rows of the best one's global batch can tie with it (another global batch is
    another recipe)."""
    if not ranking or objective == "memory":
        return ()
    best = results[ranking[0]]
    if _span(best, objective) is None:
        return ()
    size = best.point.global_batch
    return tuple(i for i in ranking[1:] if (not same_global_batch or results[i].point.global_batch == size)
                 and _tied(best, results[i], objective))


def _span(result: PointResult, objective: str) -> tuple[float, float] | None:
    if objective == "throughput" and (ci := result.samples_per_s_ci) is not None:
        return ci
    if objective == "throughput":
        low, high, mid = result.samples_per_s_min, result.samples_per_s_max, result.samples_per_s
    else:
        low, high, mid = result.bubble_measured_min, result.bubble_measured_max, result.bubble_measured
    return None if mid is None else (mid if low is None else low, mid if high is None else high)


def _tied(best: PointResult, other: PointResult, objective: str) -> bool:
    if objective == "throughput":
        paired = paired_difference(best, other)
        if paired is not None:
            mean, half = paired
            return abs(mean) <= half
        if best.ci_half_pct is not None and other.ci_half_pct is not None and best.samples_per_s \
                and other.samples_per_s:
            bound = math.hypot(best.samples_per_s * best.ci_half_pct, other.samples_per_s * other.ci_half_pct) / 100
            return abs(best.samples_per_s - other.samples_per_s) <= bound
    mine, theirs = _span(best, objective), _span(other, objective)
    return mine is not None and theirs is not None and theirs[0] <= mine[1] and mine[0] <= theirs[1]


# Rounds two points must share to be compared round by round. At three, the demo's best was judged faster
# than a row (9%, consistent over its three rounds) that was best in the next three fresh runs: a point's
# repeats within one run share more than one round's drift, and three rounds cannot show it.
MIN_PAIRED_ROUNDS = 5


def paired_difference(a: PointResult, b: PointResult) -> tuple[float, float] | None:
    """The mean log ratio of a's throughput over b's, round by round over the rounds both measured, and its 95%
    half-interval (Student's t); None under MIN_PAIRED_ROUNDS shared rounds."""
    from mbtune.intervals import t975

    mine = dict(zip(a.repeat_rounds, a.repeat_step_time_medians_s, strict=False))
    theirs = dict(zip(b.repeat_rounds, b.repeat_step_time_medians_s, strict=False))
    shared = sorted(set(mine) & set(theirs))
    if len(shared) < MIN_PAIRED_ROUNDS:
        return None
    # Throughput is the global batch over the step time.
    ratios = [math.log(a.point.global_batch / mine[k]) - math.log(b.point.global_batch / theirs[k]) for k in shared]
    return statistics.fmean(ratios), t975(len(ratios) - 1) * statistics.stdev(ratios) / math.sqrt(len(ratios))


def median_step(step_times_s: Sequence[float]) -> int:
    """The index of the median measured step (the lower one of an even count): the step a timeline shows,
    so that the picture and the calibration see a typical step, not a first one a neighbour slowed."""
    order = sorted(range(len(step_times_s)), key=lambda i: step_times_s[i])
    return order[(len(order) - 1) // 2] if order else 0


def step_timeline(reports: Sequence[StageReport], step: int = 0) -> tuple[TimelineAction, ...]:
    """The compute actions of one measured step, every rank, in start order; with data parallelism each
    rank's gradient all-reduce too (kind allreduce, on the rank's first stage, micro-batch -1)."""
    actions = [
        TimelineAction(rank=report.rank, stage=a.stage, kind=a.kind, microbatch=a.microbatch, accum=a.accum,
                       start_s=a.start_s, end_s=a.end_s)
        for report in reports for a in report.actions if a.step == step
    ]
    actions += [TimelineAction(rank=report.rank, stage=min(report.stage_indices), kind=ALLREDUCE, microbatch=-1,
                               accum=-1, start_s=report.allreduce_spans_s[step][0],
                               end_s=report.allreduce_spans_s[step][1])
                for report in reports if step < len(report.allreduce_spans_s)]
    return tuple(sorted(actions, key=lambda a: (a.start_s, a.rank)))


def rank_results(results: Sequence[PointResult], objective: str,
                 global_batches: Sequence[int] = ()) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ranking best first, Pareto front of throughput against peak memory), as indices of ok results.
    With global batches held fixed, rows are ranked within each, in the order given: the first one's best
    leads (comparing samples/s across global batches compares different training recipes)."""
    rate = {i: r.samples_per_s for i, r in enumerate(results) if r.ok and r.samples_per_s is not None}
    ok = list(rate)
    group = {g: n for n, g in enumerate(global_batches)}

    def memory(i: int) -> float:
        peak = results[i].max_peak_memory_bytes
        return float("inf") if peak is None else peak

    keys = {
        "throughput": lambda i: (-rate[i], memory(i)),
        "memory": lambda i: (memory(i), -rate[i]),
        "bubble": lambda i: (results[i].bubble_measured if results[i].bubble_measured is not None else 1.0,
                             -rate[i]),
    }
    ranking = tuple(sorted(ok, key=lambda i: (group.get(results[i].point.global_batch, len(group)),
                                              keys[objective](i))))
    pareto = tuple(i for i in ok if not any(
        rate[j] >= rate[i] and memory(j) <= memory(i) and (rate[j] > rate[i] or memory(j) < memory(i))
        for j in ok))
    return ranking, pareto


def recompute_pairs(results: Sequence[PointResult]) -> tuple[tuple[int, int], ...]:
    """(without, with full recompute): the indices of ok results whose points differ only in recompute."""
    plain = {replace(r.point, recompute="none"): i for i, r in enumerate(results) if r.ok and r.point.recompute == "none"}
    return tuple((plain[key], i) for i, r in enumerate(results)
                 if r.ok and r.point.recompute == "full" and (key := replace(r.point, recompute="none")) in plain)


def tradeoff(results: Sequence[PointResult], ranking: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, int] | None]:
    """The rows that show the best row's trade-off, and a cross-batch padding pair.

    Rows: the best, and the best-ranked rows of the same schedule, global batch, replicas and recompute
    (the trade-off is the micro-batch's alone) at the next smaller and
    the next larger micro-batch size (bigger micro-batches compute a sample faster, more of them leave a
    smaller bubble). Pair: (best, a row of the same schedule, global batch and micro-batch size with fewer
    micro-batches and more accumulation steps) where the best has more micro-batches: one pipeline step of
    more micro-batches fills the drain that the next accumulation step's would have left idle."""
    if not ranking:
        return (), None
    best = results[ranking[0]].point
    kin = [i for i in ranking if (results[i].point.schedule, results[i].point.global_batch,
                                  results[i].point.data_parallel_size, results[i].point.recompute)
           == (best.schedule, best.global_batch, best.data_parallel_size, best.recompute)]
    smaller = [i for i in kin if results[i].point.micro_batch_size < best.micro_batch_size]
    larger = [i for i in kin if results[i].point.micro_batch_size > best.micro_batch_size]
    nearest_smaller = max(smaller, key=lambda i: results[i].point.micro_batch_size, default=None)
    nearest_larger = min(larger, key=lambda i: results[i].point.micro_batch_size, default=None)
    rows = tuple(sorted({ranking[0], *(i for i in (nearest_smaller, nearest_larger) if i is not None)},
                        key=lambda i: results[i].point.micro_batch_size))
    padded = [i for i in kin if results[i].point.micro_batch_size == best.micro_batch_size
              and results[i].point.num_microbatches < best.num_microbatches
              and results[i].point.grad_accum_steps > best.grad_accum_steps]
    return rows, ((ranking[0], padded[0]) if padded else None)
