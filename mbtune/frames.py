"""Each record's pandas DataFrame, shaped for analysis: `record.to_frame()` is the one way to get it (the
CSV formats print the same frame).

One row per item of the record (a probe's trials, a sweep's points ranked as its table ranks them, a
serve run's loads, a plan's predictions, ranked); plain columns with the unit in the name (`_s`, `_bytes`,
`_per_s`, `_pct`); every share as a percentage, 0-100, named `_pct`; a per-stage list as one column per
stage (`peak_memory_bytes_stage0`, ...); a figure that was not measured is NaN in a float column, never
None in an object column. pandas is imported here only.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas

    from mbtune.planning.records import PlanReport
    from mbtune.probing.records import ProbeResult
    from mbtune.serving.records import ServeReport
    from mbtune.sweeping.records import SweepReport


def pct(share: float | None) -> float | None:
    """A share (0-1) as a percentage (0-100)."""
    return None if share is None else 100.0 * share


def frame(rows: Iterable[dict[str, Any]]) -> pandas.DataFrame:
    """The rows as a DataFrame whose columns of numbers and Nones are float (None: NaN)."""
    import pandas as pd

    out = pd.DataFrame(list(rows))
    for column in out.columns:
        if out[column].dtype != object:
            continue
        values = [v for v in out[column] if v is not None]
        if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
            out[column] = out[column].astype(float)
    return out


def probe_frame(result: ProbeResult) -> pandas.DataFrame:
    """One row per trial, in the order they ran."""
    return frame({
        "batch_size": t.batch_size, "status": t.status, "peak_memory_bytes": t.peak_memory_bytes,
        "peak_reserved_bytes": t.peak_reserved_bytes, "budget_used_bytes": t.budget_used_bytes,
        "step_time_s": t.step_time_s, "samples_per_s": t.samples_per_s, "wall_s": t.wall_s, "error": t.error,
    } for t in result.trials)


def sweep_frame(report: SweepReport) -> pandas.DataFrame:
    """One row per point, ranked as the table ranks them (the points that did not complete last)."""
    stages = max((len(r.peak_memory_bytes) for r in report.results), default=0)
    order = list(report.ranking) + [i for i in range(len(report.results)) if i not in report.ranking]
    rows = []
    for index in order:
        r, p = report.results[index], report.results[index].point
        advice = report.advice_for(p.global_batch)
        load = r.load
        peaks = list(r.peak_memory_bytes) + [None] * (stages - len(r.peak_memory_bytes))
        rows.append({
            "rank": report.ranking.index(index) + 1 if index in report.ranking else None,
            "schedule": p.schedule, "num_ranks": p.num_ranks, "stages_per_rank": p.stages_per_rank,
            "num_microbatches": p.num_microbatches, "grad_accum_steps": p.grad_accum_steps,
            "data_parallel_size": p.data_parallel_size, "recompute": p.recompute,
            "micro_batch_size": p.micro_batch_size, "global_batch": p.global_batch,
            "lr_scale": advice.scale if advice else None, "lr": advice.lr if advice else None,
            "status": r.status, "num_repeats": r.num_repeats, "stopped": r.stopped, "busy_reruns": r.busy_reruns,
            "samples_per_s": r.samples_per_s, "samples_per_s_ci_half_pct": r.ci_half_pct, "ci_basis": r.ci_basis,
            "samples_per_s_min": r.samples_per_s_min, "samples_per_s_max": r.samples_per_s_max,
            "tied_with_best": index in report.ties, "pareto": index in report.pareto,
            "tokens_per_s": r.tokens_per_s, "step_time_median_s": r.step_time_median_s,
            "step_time_cv_pct": r.step_time_cv_pct, "allreduce_s": r.allreduce_s,
            "stage_imbalance": r.stage_imbalance,
            "bubble_measured_pct": pct(r.bubble_measured), "bubble_measured_min_pct": pct(r.bubble_measured_min),
            "bubble_measured_max_pct": pct(r.bubble_measured_max), "bubble_theoretical_pct": pct(r.bubble_theoretical),
            **{f"idle_{cause}_pct": pct(getattr(r.idle, cause)) if r.idle else None
               for cause in ("schedule", "transfer", "overhead")},
            "peak_memory_bytes_max": r.max_peak_memory_bytes,
            **{f"peak_memory_bytes_stage{stage}": peak for stage, peak in enumerate(peaks)},
            "mfu_pct": r.mfu_pct, "load_avg_1m": load.load_avg_1m if load else None,
            "other_cpu_pct": pct(load.other_cpu_share) if load else None,
            "machine_busy": load.busy if load else None, "wall_s": r.wall_s, "error": r.error,
        })
    return frame(rows)


def serve_frame(report: ServeReport) -> pandas.DataFrame:
    """One row per load offered, configuration by configuration."""
    budget = report.p99_budget_s
    return frame({
        "max_batch_size": load.config.max_batch_size, "max_queue_delay_s": load.config.max_queue_delay_s,
        "preferred": ",".join(map(str, load.config.preferred)), "kind": load.kind, "rate_per_s": load.rate_per_s,
        "concurrency": load.concurrency, "throughput_per_s": load.throughput_per_s, "p50_s": load.p50_s,
        "p90_s": load.p90_s, "p99_s": load.p99_s, "predicted_p99_s": load.predicted_p99_s,
        "mean_batch_size": load.mean_batch_size, "queue_pct": pct(load.queue_share), "sent": load.sent,
        "completed": load.completed, "rejected": load.rejected, "timed_out": load.timed_out,
        "stable": load.stable, "windows": load.windows, "meets_budget": load.meets(budget),
    } for load in report.loads)


def plan_frame(report: PlanReport) -> pandas.DataFrame:
    """One row per prediction, ranked."""
    return frame({
        "rank": i + 1, "schedule": p.point.schedule, "num_blocks": p.num_blocks, "num_ranks": p.point.num_ranks,
        "stages_per_rank": p.point.stages_per_rank, "num_microbatches": p.point.num_microbatches,
        "micro_batch_size": p.point.micro_batch_size, "data_parallel_size": p.point.data_parallel_size,
        "global_batch": p.point.global_batch, "samples_per_s": p.samples_per_s, "step_time_s": p.step_time_s,
        "bubble_pct": pct(p.bubble), "bubble_theoretical_pct": pct(p.bubble_theoretical),
        "memory_bytes_max": p.max_memory_bytes, "fits": p.fits, "recommended": i == report.recommended,
        "scatter": report.scatter, "grad_accum_steps": p.point.grad_accum_steps,
        "recompute": p.point.recompute, "allreduce_s": p.allreduce_s, "binding_rank": p.binding_rank,
        "lost_because": p.lost_because,
    } for i, p in enumerate(report.predictions))
