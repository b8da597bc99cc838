"""Sweep results for people (a ranked rich table and a best-configuration panel) and machines."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from mbtune.records import SweepReport, TrialResult
from mbtune.report import fmt_bytes, fmt_rate, fmt_seconds, print_json, print_warnings


def _pct(value: float | None, scale: float = 100.0) -> str:
    return "n/a" if value is None else f"{value * scale:.1f}%"


def results_table(report: SweepReport) -> Table:
    """Every point that ran, best first by the objective; failed points last."""
    table = Table(title=f"Sweep: {report.workload}, ranked by {report.objective}", title_justify="left")
    for name in ("#", "schedule", "p", "m", "accum", "mbs", "global", "samples/s", "tokens/s", "step (cv)",
                 "bubble meas", "bubble theory", "peak mem/stage", "MFU", "kernel active", "status"):
        table.add_column(name, justify="left" if name in ("schedule", "status") else "right")
    order = list(report.ranking) + [i for i in range(len(report.results)) if i not in report.ranking]
    for position, index in enumerate(order, 1):
        result = report.results[index]
        marks = ("*" if index in report.pareto else "") + ("!" if result.warnings else "")
        style = "bold green" if report.ranking and index == report.ranking[0] else ""
        table.add_row(*_row(position, result, marks), style=style)
    table.caption = "* Pareto front (throughput vs peak memory)   ! see warnings   kernel active = NVML share of time a kernel ran"
    return table


def _row(position: int, result: TrialResult, marks: str) -> list[str]:
    point = result.point
    if not result.ok:
        status = f"[red]{result.status}[/]: {result.error[:60]}"
        return [str(position), point.schedule, str(point.num_stages), str(point.num_microbatches),
                str(point.grad_accum_steps), str(point.micro_batch_size), str(point.global_batch),
                "", "", "", "", _pct(result.bubble_theoretical), "", "", "", status]
    cv = f" ({result.step_time_cv_pct:.0f}%)" if result.step_time_cv_pct is not None else ""
    return [
        f"{position}{marks}", point.schedule, str(point.num_stages), str(point.num_microbatches),
        str(point.grad_accum_steps), str(point.micro_batch_size), str(point.global_batch),
        fmt_rate(result.samples_per_s), fmt_rate(result.tokens_per_s) if result.tokens_per_s else "n/a",
        fmt_seconds(result.step_time_median_s) + cv, _pct(result.bubble_measured), _pct(result.bubble_theoretical),
        fmt_bytes(result.max_peak_memory_bytes), "unknown" if result.mfu_pct is None else f"{result.mfu_pct:.1f}%",
        _kernel_active(result), "ok",
    ]


def _kernel_active(result: TrialResult) -> str:
    if result.nvml is None or not result.nvml.available or not result.nvml.gpus:
        return "n/a"
    values = [g.kernel_active_pct_median for g in result.nvml.gpus if g.kernel_active_pct_median is not None]
    return f"{sum(values) / len(values):.0f}%" if values else "n/a"


def skipped_table(report: SweepReport) -> Table:
    table = Table(title=f"Skipped points ({len(report.skipped)})", title_justify="left")
    table.add_column("point")
    table.add_column("reason")
    for skipped in report.skipped:
        table.add_row(skipped.point.label, skipped.reason)
    return table


def best_panel(report: SweepReport) -> Panel:
    """The best configuration spelled out, with memory headroom against the probed ceiling."""
    best = report.best
    if best is None:
        return Panel("no point completed", title="Best configuration", title_align="left", expand=False)
    point = best.point
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("schedule", point.schedule)
    grid.add_row("stages", f"{point.num_stages * point.virtual_stages} ({point.num_stages} rank(s) x "
                 f"{point.virtual_stages} stage(s) per rank; ran as {best.ran_as})")
    grid.add_row("micro-batch size", str(point.micro_batch_size))
    grid.add_row("micro-batches", str(point.num_microbatches))
    grid.add_row("accumulation steps", str(point.grad_accum_steps))
    grid.add_row("global batch", f"{point.global_batch} (= {point.micro_batch_size} x {point.num_microbatches} x "
                 f"{point.grad_accum_steps} x {point.data_parallel_size} data-parallel)")
    grid.add_row("throughput", f"{fmt_rate(best.samples_per_s)} samples/s"
                 + (f", {fmt_rate(best.tokens_per_s)} tokens/s" if best.tokens_per_s else ""))
    grid.add_row("bubble", f"measured {_pct(best.bubble_measured)}, theory {_pct(best.bubble_theoretical)}")
    grid.add_row("peak memory", f"{fmt_bytes(best.max_peak_memory_bytes)} on the busiest stage")
    grid.add_row("headroom", _headroom(report, best))
    return Panel(grid, title=f"Best configuration ({report.objective})", title_align="left", expand=False)


def _headroom(report: SweepReport, best: TrialResult) -> str:
    limit, peak = report.ceiling_peak_memory_bytes, best.max_peak_memory_bytes
    if limit is None or peak is None:
        return "n/a (no probe in this run; use mbtune tune)"
    return (f"{1 - peak / limit:.0%} below the probed ceiling's peak ({fmt_bytes(limit)} at batch {report.ceiling}; "
            f"safe batch {report.safe_batch})")


def print_sweep(console: Console, report: SweepReport, fmt: str, *, saved_to: str | None = None) -> None:
    """Print a sweep report in the chosen format."""
    if fmt == "json":
        print_json(report.to_dict())
        return
    if fmt == "csv":
        results_frame(report).to_csv(sys.stdout, index=False)
        return
    console.print(results_table(report))
    if report.skipped:
        console.print(skipped_table(report))
    console.print(best_panel(report))
    print_warnings(console, list(report.warnings) + [f"{r.point.label}: {w}" for r in report.results for w in r.warnings])
    if report.interrupted:
        console.print("[yellow]interrupted:[/] the points above finished; the rest did not run")
    if saved_to:
        console.print(f"profile saved to {saved_to}")


def results_frame(report: SweepReport):
    """The results as a pandas DataFrame, one row per point that ran (SI units), ranked."""
    import pandas as pd

    rows = []
    for index, r in enumerate(report.results):
        p = r.point
        rows.append({
            "rank": report.ranking.index(index) + 1 if index in report.ranking else None,
            "schedule": p.schedule, "num_stages": p.num_stages, "num_microbatches": p.num_microbatches,
            "grad_accum_steps": p.grad_accum_steps, "micro_batch_size": p.micro_batch_size,
            "global_batch": p.global_batch, "status": r.status, "samples_per_s": r.samples_per_s,
            "tokens_per_s": r.tokens_per_s, "step_time_median_s": r.step_time_median_s,
            "step_time_cv_pct": r.step_time_cv_pct, "bubble_measured": r.bubble_measured,
            "bubble_theoretical": r.bubble_theoretical, "peak_memory_bytes_max": r.max_peak_memory_bytes,
            "mfu_pct": r.mfu_pct, "pareto": index in report.pareto, "error": r.error,
        })
    return pd.DataFrame(rows).sort_values("rank", na_position="last") if rows else pd.DataFrame(rows)
