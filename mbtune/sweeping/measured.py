"""What a point measured: a pipeline's outcome as the sweep's PointResult, and one point's repeats merged into
one result (the median over every measured step, the ranges over the repeats). Pure."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from mbtune.actions import ALLREDUCE
from mbtune.device.machine_load import busy_warning
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.theory import theoretical_bubble
from mbtune.records import OK, MachineLoad, TimelineAction
from mbtune.sweeping.records import PointResult

if TYPE_CHECKING:
    from mbtune.pipeline.timeline import PipelineOutcome, StageReport


STABILITY_CV_PCT = 10.0


def summarize_point(point: SweepPoint, outcome: PipelineOutcome, *, tokens_per_sample: int | None,
                    flops_per_sample: float | None, peak_flops_total: float | None) -> PointResult:
    """Turn a pipeline outcome (pipeline.PipelineOutcome) into the sweep's PointResult."""
    theory = theoretical_bubble(point.schedule, num_ranks=point.num_ranks, num_micro_batches=point.num_micro_batches,
                                stages_per_rank=point.stages_per_rank)
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
