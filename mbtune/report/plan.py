"""Plans and simulator validation for people (rich tables, a recommendation panel) and machines (JSON, CSV)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, JustifyMethod
from rich.panel import Panel
from rich.table import Table

from mbtune.planning.memory_plan import NO_LIMIT, MemoryPlan
from mbtune.planning.records import (
    WITHIN_RUN,
    NoiseFloor,
    PlanReport,
    Prediction,
    Validation,
)
from mbtune.report import (
    document_stream,
    fmt_bytes,
    fmt_rate,
    fmt_seconds,
    key_value_grid,
    print_json,
    print_warnings,
)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _signed_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.1f}%"


def predictions_table(report: PlanReport, *, limit: int | None = 20) -> Table:
    """The ranked predictions, recommended first and highlighted; memory per rank against the ceiling. A
    blocks column appears where points were planned at different depths."""
    depths = sorted({p.num_blocks for p in report.predictions} or {report.num_blocks})
    blocks = f"{depths[0]} blocks" if len(depths) == 1 else f"{depths[0]}-{depths[-1]} blocks"
    table = Table(title=f"Plan: {report.workload}, {blocks}, predicted by the calibrated simulator "
                        f"(scatter: {report.scatter})",
                  title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    columns: list[tuple[str, JustifyMethod]] = [("#", "right"), ("schedule", "left"), ("p", "right"), ("v", "right"), ("m", "right"),
               ("mbs", "right"), ("dp", "right"), ("global", "right"), ("samples/s", "right"), ("step", "right"),
               ("bubble", "right"), ("mem/rank", "right"), ("fits", "left")]
    if len(depths) > 1:
        columns.insert(2, ("blocks", "right"))
    cluster = report.num_gpus is not None
    if report.estimated_for:
        table.title = f"{table.title} (times estimated for {report.estimated_for})"
    if cluster:
        table.title = (f"Plan: {report.workload} on {report.num_gpus} GPUs, {blocks}: the best of "
                       f"{report.num_candidates} splits, predicted by the calibrated simulator (scatter: {report.scatter})"
                       + (f" (times estimated for {report.estimated_for})" if report.estimated_for else ""))
        columns[6:6] = [("acc", "right")]
        columns += [("all-reduce", "right"), ("binds", "right"), ("lost to #1 by", "left")]
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=header != "lost to #1 by")
    shown = report.predictions if limit is None else report.predictions[:limit]
    for index, p in enumerate(shown):
        row = _prediction_row(index + 1, p)
        if len(depths) > 1:
            row.insert(2, str(p.num_blocks))
        if cluster:
            row[6:6] = [str(p.point.grad_accum_steps)]
            share = p.allreduce_s / p.step_time_s if p.step_time_s > 0 else 0.0
            row += [_pct(share), f"rank {p.binding_rank}" if p.binding_rank is not None else "", p.lost_because]
        table.add_row(*row, style="bold green" if index == report.recommended else "")
    hidden = len(report.predictions) - len(shown)
    memory = "the busiest rank" + ("" if report.per_sample_memory else ", no per-sample memory")
    table.caption = (f"bubble: simulated / theoretical  mem/rank: {memory}"
                     + (f"  ({hidden} more not shown)" if hidden > 0 else ""))
    return table


def _prediction_row(position: int, p: Prediction) -> list[str]:
    point = p.point
    fits = {True: "yes", False: "[red]no[/]", None: "unchecked"}[p.fits]
    return [str(position), point.schedule, str(point.num_ranks), str(point.stages_per_rank),
            str(point.num_micro_batches), str(point.micro_batch_size), str(point.data_parallel_size),
            str(point.global_batch), fmt_rate(p.samples_per_s), fmt_seconds(p.step_time_s),
            f"{_pct(p.bubble)} / {_pct(p.bubble_theoretical)}", fmt_bytes(p.max_memory_bytes), fits]


def validation_table(validation: Validation) -> Table:
    """Predicted against measured for every point that ran, with the median and worst errors below."""
    table = Table(title=f"Simulator against the measured sweep ({validation.method}, scatter: "
                        f"{validation.scatter})", title_justify="left",
                  box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for header in ("point", "measured", "predicted", "error", "bubble measured", "bubble predicted", "diff"):
        table.add_column(header, justify="left" if header == "point" else "right", no_wrap=True)
    for row in validation.rows:
        table.add_row(row.point.label, fmt_seconds(row.measured_step_s), fmt_seconds(row.predicted_step_s),
                      _signed_pct(row.step_error), _pct(row.measured_bubble), _pct(row.predicted_bubble),
                      "n/a" if row.bubble_error is None else f"{100 * row.bubble_error:+.1f} pts")
    table.caption = (f"step time error: median {_pct(validation.median_step_error)}, worst "
                     f"{_pct(validation.worst_step_error)}; bubble: median {_points(validation.median_bubble_error)}, "
                     f"worst {_points(validation.worst_bubble_error)}\n"
                     f"noise floor: {noise_floor_text(validation.noise_floor)}\n{noise_verdict(validation)}")
    table.caption_justify = "left"
    return table


def noise_floor_text(noise: NoiseFloor | None) -> str:
    """The noise floor as median and worst, and what it compares."""
    if noise is None:
        return "unknown (no point has repeats or more than one measured step)"
    text = f"median {_pct(noise.median)}, worst {_pct(noise.worst)} over {noise.num_points} point(s)"
    if noise.kind == WITHIN_RUN:
        return f"{text}, within one run; sweep with --repeats 2 for the between-run floor"
    return f"{text}, between repeats of the same point"


def noise_verdict(validation: Validation) -> str:
    """One line: whether the median step-time error is within the measurements' noise floor or above it."""
    within = validation.within_noise_floor
    if within is None:
        return "no noise floor to compare the error against"
    noise = validation.noise_floor
    assert noise is not None and validation.median_step_error is not None
    kind = "within one run" if noise.kind == WITHIN_RUN else "between runs"
    relation = "is within" if within else "is above"
    return (f"median error {_pct(validation.median_step_error)} {relation} the noise floor "
            f"{_pct(noise.median)} ({kind})")


def _points(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} pts"


def recommendation_panel(report: PlanReport) -> Panel:
    """The recommended configuration spelled out, with its memory against the ceiling."""
    best = report.best
    if best is None:
        reason = "no configuration fits the probed ceiling" if report.predictions else "no configuration could run"
        return Panel(reason, title="Recommendation", title_align="left", expand=False)
    point = best.point
    grid = key_value_grid()
    grid.add_row("schedule", point.schedule)
    grid.add_row("stages", f"{point.num_ranks * point.stages_per_rank} ({point.num_ranks} rank(s) x "
                 f"{point.stages_per_rank} stage(s) per rank; blocks per stage {_range(best.blocks_per_stage)})")
    grid.add_row("micro-batches", f"{point.num_micro_batches} of {point.micro_batch_size} samples, "
                 f"{point.grad_accum_steps} accumulation step(s), {point.data_parallel_size} data-parallel")
    grid.add_row("global batch", str(point.global_batch))
    grid.add_row("throughput", f"{fmt_rate(best.samples_per_s)} samples/s"
                 + (f", {fmt_rate(best.tokens_per_s)} tokens/s" if best.tokens_per_s else "") + " (predicted)")
    grid.add_row("step", f"{fmt_seconds(best.step_time_s)} = pipeline {fmt_seconds(best.pipeline_s)} + all-reduce "
                 f"{fmt_seconds(best.allreduce_s)} + update {fmt_seconds(best.update_s)}")
    grid.add_row("bubble", f"simulated {_pct(best.bubble)}, theory {_pct(best.bubble_theoretical)}")
    limit = "unchecked (no probed ceiling)" if report.memory_limit_bytes is None else (
        f"ceiling {fmt_bytes(report.memory_limit_bytes)}: {report.memory_limit_source}")
    grid.add_row("memory", f"{fmt_bytes(best.max_memory_bytes)} on the busiest rank; {limit}")
    return Panel(grid, title="Recommendation", title_align="left", expand=False)


def _range(values: tuple[int, ...]) -> str:
    return str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def plan_dict(report: PlanReport) -> dict[str, Any]:
    """The plan as JSON-ready data: the full record plus a summary of the recommendation and validation."""
    data = report.to_dict()
    data.pop("recommended_timeline")  # a picture's and a trace's data, not the plan's (--plot, --trace)
    best = report.best
    validation = report.validation
    noise = validation.noise_floor if validation else None
    data["summary"] = {
        "recommended": best.point.label if best else None,
        "recommended_samples_per_s": best.samples_per_s if best else None,
        "scatter": report.scatter,
        "per_sample_memory": report.per_sample_memory,
        "validation_method": validation.method if validation else None,
        "median_step_error": validation.median_step_error if validation else None,
        "worst_step_error": validation.worst_step_error if validation else None,
        "noise_floor_kind": noise.kind if noise else None,
        "noise_floor_median": noise.median if noise else None,
        "noise_floor_worst": noise.worst if noise else None,
        "median_step_error_within_noise_floor": validation.within_noise_floor if validation else None,
    }
    return data


def print_plan(console: Console, report: PlanReport, fmt: str) -> None:
    """Print a plan in the chosen format (table, json or csv)."""
    if fmt == "json":
        print_json(plan_dict(report))
        return
    if fmt == "csv":
        report.to_frame().to_csv(document_stream(), index=False)
        return
    if report.validation is not None:
        console.print(validation_table(report.validation))
    console.print(predictions_table(report))
    if report.skipped:
        skipped = Table(title=f"Not predicted ({len(report.skipped)})", title_justify="left")
        skipped.add_column("point")
        skipped.add_column("reason")
        for s in report.skipped:
            skipped.add_row(s.point.label, s.reason)
        console.print(skipped)
    console.print(recommendation_panel(report))
    print_warnings(console, list(report.warnings))


def write_plan_artifacts(console: Console, report: PlanReport, *, plot_dir: Path | None,
                         trace_path: Path | None) -> None:
    """--plot and --trace of `mbtune plan`: pictures of the predictions, the recommended configuration's
    simulated timeline (the one the plan kept, see PlanConfig.keep_timeline) as a Chrome trace."""
    from mbtune.report.plots import write_plan_plots
    from mbtune.report.trace import write_trace

    best = report.best
    recommended = replace(best, timeline=report.recommended_timeline) if best and report.recommended_timeline else None
    written = write_plan_plots(report, plot_dir, recommended=recommended) if plot_dir else []
    if trace_path and recommended is not None:
        written.append(write_trace(recommended.timeline, trace_path, label=f"{recommended.point.label} (simulated)"))
    elif trace_path:
        console.print("no trace written: " + ("no configuration is recommended" if best is None
                                              else "the plan kept no simulated timeline"))
    for path in written:
        console.print(f"wrote {path}")


def print_memory_plan(console: Console, plan: MemoryPlan, fmt: str) -> None:
    """Every configuration's largest micro-batch size, the rank that binds and every rank's predicted peak."""
    if fmt == "json":
        print_json(plan.to_dict())
        return
    if fmt == "csv":
        import csv

        writer = csv.writer(document_stream())
        writer.writerow(["schedule", "num_micro_batches", "recompute", "micro_batch_size", "global_batch",
                         "binding_rank", "peak_bytes", "limits", "skipped"])
        for row in plan.rows:
            writer.writerow([row.schedule, row.num_micro_batches, row.recompute, row.micro_batch_size,
                             row.global_batch, row.binding_rank, " ".join(map(str, row.peak_bytes)),
                             " ".join(map(str, row.limits)), row.skipped])
        return
    options = ", ".join(f"{k}={v}" for k, v in plan.workload_options.items())
    table = Table(title=f"Memory plan: {plan.workload}{f' ({options})' if options else ''}, {plan.num_ranks} stages"
                        f"{f' x {plan.data_parallel_size} replicas' if plan.data_parallel_size > 1 else ''} of "
                        f"{fmt_bytes(plan.device_memory_bytes)}, {plan.precision}, {plan.optimizer}",
                  title_justify="left")
    wide = ("peak per stage (rank 0 first)", "largest micro-batch per stage")
    for name in ("schedule", "m", "recompute", "largest micro-batch", "global batch", "binding stage", *wide,
                 "seconds"):
        table.add_column(name, justify="left" if name in ("schedule", "recompute", *wide) else "right")
    for row in plan.rows:
        if row.skipped:
            table.add_row(row.schedule, str(row.num_micro_batches), row.recompute, "", "", "", f"[dim]{row.skipped}[/]",
                          "", "")
            continue
        binding = "" if row.binding_rank is None else f"rank {row.binding_rank}"
        size = str(row.micro_batch_size) if row.micro_batch_size else "[red]none fits[/]"
        table.add_row(row.schedule, str(row.num_micro_batches), row.recompute, size, str(row.global_batch), binding,
                      " ".join(fmt_bytes(p) for p in row.peak_bytes), " ".join(map(_limit, row.limits)),
                      f"{row.seconds:.1f}")
    table.caption = ("each rank's own code run on fake tensors at the size shown, its live tensor bytes counted as a "
                     "device's allocator counts them (what the allocator adds on a GPU is not in it); a stage's "
                     "largest micro-batch from its step at sizes 1 and 2, every moment a line in the size; "
                     f"predicted in {plan.seconds:.1f} s")
    console.print(table)


def _limit(size: int) -> str:
    """A stage's largest micro-batch size (a step that does not grow with it holds any)."""
    return "any" if size >= NO_LIMIT else str(size)
