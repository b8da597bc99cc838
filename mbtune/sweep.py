"""The sweep: plan the grid (dropping points that cannot run, with the reason), run each point as a real
pipeline through pipeline/, turn what it measured into a TrialResult, and rank the results.

Planning and ranking are pure functions; `run_point` is the one place that starts processes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from mbtune.config import SweepConfig
from mbtune.pipeline.theory import check_point, stages_per_rank, theoretical_bubble
from mbtune.records import OK, SkippedPoint, SweepPoint, TimelineAction, TrialResult

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


def plan_grid(config: SweepConfig, *, num_blocks: int, num_stages: int | None = None) -> Grid:
    """Every (schedule, micro-batches, accumulation) point, or the config's explicit points, split into
    runnable and skipped (with the reason)."""
    points, skipped = [], []
    for point, reason in _candidates(config, num_stages or config.num_stages):
        reason = reason or check_point(point.schedule, point.virtual_stages * point.num_stages, point.num_stages,
                                       point.num_microbatches, num_blocks=num_blocks)
        if reason is None and config.safe_batch is not None and point.micro_batch_size > config.safe_batch:
            reason = f"micro-batch size {point.micro_batch_size} is above the probed safe batch {config.safe_batch}"
        if reason:
            skipped.append(SkippedPoint(point=point, reason=reason))
        else:
            points.append(point)
    return Grid(points=tuple(points), skipped=tuple(skipped))


def _candidates(config: SweepConfig, p: int) -> list[tuple[SweepPoint, str | None]]:
    if config.points is not None:
        return [(replace(point, num_stages=min(point.num_stages, p)), None) for point in config.points]
    candidates = []
    for schedule in config.schedules:
        v = stages_per_rank(schedule, config.virtual_stages)
        for m in config.micro_batch_counts:
            for accum in config.accum_steps:
                mbs, reason = _micro_batch_size(config, m, accum)
                candidates.append((SweepPoint(schedule=schedule, num_stages=p, num_microbatches=m,
                                              grad_accum_steps=accum, micro_batch_size=mbs, virtual_stages=v), reason))
    return candidates


def _micro_batch_size(config: SweepConfig, m: int, accum: int) -> tuple[int, str | None]:
    if config.global_batch is None:
        return config.micro_batch_size or default_micro_batch_size(config), None
    per_step = m * accum
    if config.global_batch % per_step:
        return max(1, config.global_batch // per_step), (
            f"global batch {config.global_batch} does not divide into {m} micro-batches x {accum} accumulation steps")
    return config.global_batch // per_step, None


def summarize_point(point: SweepPoint, outcome: object, *, tokens_per_sample: int | None,
                    flops_per_sample: float | None, peak_flops_total: float | None) -> TrialResult:
    """Turn a pipeline outcome (pipeline.PipelineOutcome) into the sweep's TrialResult."""
    theory = theoretical_bubble(point.schedule, num_ranks=point.num_stages, num_microbatches=point.num_microbatches,
                                virtual_stages=point.virtual_stages)
    if outcome.status != OK:
        return TrialResult(point=point, status=outcome.status, error=outcome.error, bubble_theoretical=theory,
                           wall_s=outcome.wall_s)
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
    return TrialResult(
        point=point, status=OK, step_times_s=steps, step_time_median_s=median, step_time_cv_pct=cv,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * tokens_per_sample if tokens_per_sample else None,
        mfu_pct=100.0 * flops_per_sample * samples_per_s / peak_flops_total
        if flops_per_sample and peak_flops_total else None,
        bubble_measured=measured, bubble_theoretical=theory,
        excess_idle_pct=100.0 * (measured - theory) if measured is not None else None,
        idle=outcome.idle_shares,
        peak_memory_bytes=tuple(r.peak_memory_bytes for r in outcome.reports), loss=outcome.loss,
        warnings=tuple(warnings), timeline=step_timeline(outcome.reports, typical), timeline_step=typical,
        wall_s=outcome.wall_s,
    )


def median_step(step_times_s: Sequence[float]) -> int:
    """The index of the median measured step (the lower one of an even count): the step a timeline shows,
    so that the picture and the calibration see a typical step, not a first one a neighbour slowed."""
    order = sorted(range(len(step_times_s)), key=lambda i: step_times_s[i])
    return order[(len(order) - 1) // 2] if order else 0


def step_timeline(reports: Sequence[object], step: int = 0) -> tuple[TimelineAction, ...]:
    """The compute actions of one measured step, every rank, in start order."""
    actions = [
        TimelineAction(rank=report.rank, stage=a.stage, kind=a.kind, microbatch=a.microbatch, accum=a.accum,
                       start_s=a.start_s, end_s=a.end_s)
        for report in reports for a in report.actions if a.step == step
    ]
    return tuple(sorted(actions, key=lambda a: (a.start_s, a.rank)))


def rank_results(results: Sequence[TrialResult], objective: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ranking best first, Pareto front of throughput against peak memory), as indices of ok results."""
    ok = [i for i, r in enumerate(results) if r.ok and r.samples_per_s is not None]

    def memory(i: int) -> float:
        peak = results[i].max_peak_memory_bytes
        return float("inf") if peak is None else peak

    keys = {
        "throughput": lambda i: (-results[i].samples_per_s, memory(i)),
        "memory": lambda i: (memory(i), -results[i].samples_per_s),
        "bubble": lambda i: (results[i].bubble_measured if results[i].bubble_measured is not None else 1.0,
                             -results[i].samples_per_s),
    }
    ranking = tuple(sorted(ok, key=keys[objective]))
    pareto = tuple(i for i in ok if not any(
        results[j].samples_per_s >= results[i].samples_per_s and memory(j) <= memory(i)
        and (results[j].samples_per_s > results[i].samples_per_s or memory(j) < memory(i))
        for j in ok))
    return ranking, pareto
