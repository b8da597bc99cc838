"""Sweep results for people (a ranked rich table and a best-configuration panel) and machines."""

from __future__ import annotations

import shlex
import statistics
from pathlib import Path

from rich import box
from rich.console import Console, JustifyMethod
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from mbtune.report import (
    document_stream,
    fmt_bytes,
    fmt_pct,
    fmt_rate,
    fmt_seconds,
    key_value_grid,
    print_json,
    print_warnings,
)
from mbtune.report.probe import cause_line
from mbtune.report.sweep_lines import decision_line, point_warnings
from mbtune.report.sweep_tradeoffs import recompute_table, tradeoff_table
from mbtune.sweeping.records import PointResult, PredictedPoint, SweepReport


def results_table(report: SweepReport, *, console: Console | None = None) -> Table:
    """Every point that ran, best first by the objective, failed points last. Columns that hold nothing
    on this machine (MFU without a known peak, NVML without a GPU, tokens for non-token workloads) are
    left out and explained in the caption, and the least important ones give way to fit the console."""
    order = _row_order(report)
    rows = [_row(position, report.results[i], _marks(report, i), _lr_cell(report, report.results[i]))
            for position, i in enumerate(order, 1)]
    rows += [_predicted_row(predicted) for predicted in sorted(report.predicted, key=lambda p: -p.samples_per_s)]
    columns = [c for c in _COLUMNS if any(row[c[0]] not in ("", "n/a", "unknown", "ok") for row in rows)
               and (c[0] != "dp" or any(row["dp"] not in ("", "1") for row in rows))
               and (c[0] != "rc" or any(row["rc"] not in ("", "none") for row in rows))]
    notes = [note for header, note in _MISSING_NOTES.items() if all(c[0] != header for c in columns)]
    hidden: list[str] = []
    while True:
        table = _build_table(report, rows, order, columns)
        give_way = [h for h in _GIVE_WAY if any(c[0] == h for c in columns)]
        if console is None or _natural_width(console, table) <= console.width or not give_way:
            break
        columns = [c for c in columns if c[0] != give_way[0]]
        hidden.append(give_way[0])
    if hidden:
        notes.append(f"hidden to fit the terminal: {', '.join(hidden)} (widen it or use --format csv)")
    if any(c[0] == "imbal" for c in columns):
        notes.append("imbal: slowest / fastest stage's compute; " + balance_note(report))
    if any(c[0] == "rc" for c in columns):
        notes.append("rc: activation recompute (full: every block's forward runs again in its backward)")
    if report.repeats is None:
        spread = (f"samples/s: ± the 95% interval over repeats, measured until {report.target_ci or 0:.0%} "
                  "wide (runs: known) or the time cap (cap; --max-time-per-point); raced: every point once, then "
                  "repeats only for the points tied with the best (dropped: a 95% test separates it from the best; "
                  "equal: a 95% equivalence test puts it within the declared size of the best; decided: every "
                  "other is told apart or equal; budget: --time-budget spent)")
    elif report.repeats > 1:
        spread = f"samples/s: ± the 95% interval over {report.repeats} repeats; bubble: min-max"
    else:
        spread = "ranges: the 95% interval and min-max over one run's measured steps (narrower than between runs)"
    predicted = ["~ predicted, not measured: the simulator calibrated on the measured rows (status says why it "
                 "was left out; --measure-all measures every point)"] if report.predicted else []
    unmeasured = next((r.bubble_unmeasured for r in report.results if r.bubble_unmeasured), "")
    bubble = f"bubble: measured / theoretical{f' (measured: {unmeasured})' if unmeasured else ''}"
    table.caption = "  ".join([bubble, spread, "* Pareto front (throughput vs peak memory)",
                               "= equivalent to the best (within the declared size, 95% equivalence test)",
                               "? not yet told apart from the best nor shown equivalent",
                               "! see warnings", *predicted, *_global_batch_note(report),
                               *_lr_caption(report), *notes])
    return table


_COLUMNS: list[tuple[str, JustifyMethod]] = [
            ("#", "right"), ("schedule", "left"), ("p", "right"), ("m", "right"), ("acc", "right"),
            ("dp", "right"), ("rc", "left"), ("mbs", "right"), ("global", "right"), ("lr", "right"),
            ("samples/s", "right"), ("runs", "right"), ("tokens/s", "right"), ("step (cv)", "right"), ("all-reduce", "right"),
            ("bubble", "right"), ("imbal", "right"), ("peak mem", "right"), ("MFU", "right"),
            ("kernel active", "right"), ("status", "left")]
_MISSING_NOTES = {"MFU": "MFU: peak FLOPs unknown for this device",
                  "kernel active": "kernel active (NVML): n/a here"}
# Least important first: these columns are dropped, in order, until the table fits.
_GIVE_WAY = ("tokens/s", "kernel active", "MFU", "imbal", "lr", "global", "step (cv)")


def balance_note(report: SweepReport) -> str:
    """How the sweep split the blocks over its stages."""
    balance = report.balance
    if balance.by == "time":
        times = ", ".join(fmt_seconds(t) for t in balance.block_times_s)
        return (f"stages balanced by block time (forward + backward, timed once at micro-batch size "
                f"{balance.micro_batch_size}: {times})")
    return "stages balanced by compute-bearing parameters (--balance time weighs blocks by measured time)"


def ranked_by(report: SweepReport) -> str:
    """What the ranking compares: rows within a fixed global batch, or rows whose global batch varies."""
    if not report.global_batches:
        return f"ranked by {report.objective} across global batches"
    return f"ranked by {report.objective} within global batch {', '.join(map(str, report.global_batches))}"


def _global_batch_note(report: SweepReport) -> list[str]:
    if not report.global_batches:
        return ["global batch: varies from row to row (a fixed micro-batch size); --global-batch holds it fixed"]
    if report.global_batch_default:
        return [f"global batch {report.global_batches[0]}: the default, the largest power of two the fewest "
                "micro-batches and accumulation steps hold at the probed safe batch (--global-batch sets it)"]
    return []


def _row_order(report: SweepReport) -> list[int]:
    """Indices into report.results in table order: ranked points first, then the rest as they ran."""
    return list(report.ranking) + [i for i in range(len(report.results)) if i not in report.ranking]


def failure_lines(report: SweepReport) -> list[Text]:
    """One short line per failed point, under the table: its row number, status, point and cause."""
    lines = []
    for position, index in enumerate(_row_order(report), 1):
        result = report.results[index]
        if not result.ok:
            lines.append(Text.assemble((f"#{position} {result.status}:", "red"),
                                       f" {result.point.label}: {cause_line(result.error, result.error_kind)}"))
    return lines


def _natural_width(console: Console, table: Table) -> int:
    """The width the table wants when nothing limits it."""
    return console.measure(table, options=console.options.update(max_width=10_000)).maximum


def _build_table(report: SweepReport, rows: list[dict[str, str]], order: list[int],
                 columns: list[tuple[str, JustifyMethod]]) -> Table:
    table = Table(title=f"Sweep: {report.workload}, {ranked_by(report)}", title_justify="left",
                  box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=True)
    best = report.ranking[0] if report.ranking else None
    for row, index in zip(rows, [*order, *([None] * (len(rows) - len(order)))]):
        table.add_row(*(row[header] for header, _ in columns),
                      style="bold green" if index == best else "dim" if index is None else "")
    return table


def _marks(report: SweepReport, index: int) -> str:
    decision = report.decision
    equal = decision is not None and index in decision.group
    still = index in decision.open if decision is not None else index in report.ties
    return (("*" if index in report.pareto else "") + ("=" if equal else "") + ("?" if still else "")
            + ("!" if report.results[index].warnings else ""))


def _predicted_row(predicted: PredictedPoint) -> dict[str, str]:
    """A point left out of the race: its predicted figures, marked, and why it was not measured."""
    point = predicted.point
    return {**{h: "" for h, _ in _COLUMNS}, "#": "~", "schedule": point.schedule, "p": str(point.num_ranks),
            "m": str(point.num_micro_batches), "acc": str(point.grad_accum_steps), "dp": str(point.data_parallel_size),
            "rc": point.recompute, "mbs": str(point.micro_batch_size), "global": str(point.global_batch),
            "samples/s": f"~{fmt_rate(predicted.samples_per_s)} ±{predicted.error:.0%}", "runs": "0",
            "peak mem": f"~{fmt_bytes(predicted.peak_memory_bytes)}" if predicted.peak_memory_bytes else "",
            "status": "predicted: " + predicted.reason.split(";")[0]}


def _range(low: float | None, high: float | None, fmt) -> str:  # noqa: ANN001 - a formatter
    return "" if low is None or high is None else f" ({fmt(low)}-{fmt(high)})"


def _bare_pct(value: float) -> str:
    return f"{value * 100:.0f}"


def _lr_cell(report: SweepReport, result: PointResult) -> str:
    advice = report.advice_for(result.point.global_batch)
    if advice is None or (len(report.lr_advice) == 1 and advice.lr is None):
        return ""  # one global batch and no recipe: nothing to scale
    return f"{advice.lr:.3g}" if advice.lr is not None else f"x{advice.scale:.2f}"


def _lr_caption(report: SweepReport) -> list[str]:
    """What the lr column holds: the rule, and what it scales from."""
    from mbtune.sweeping.lr import WARMUP_NOTE

    if not report.lr_advice or (len(report.lr_advice) == 1 and report.lr_advice[0].lr is None):
        return []
    first = report.lr_advice[0]
    base = next((a.lr / a.scale for a in report.lr_advice if a.lr is not None and a.scale), None)
    scaled = (f"lr: {base:.3g} at global batch {first.reference_batch}" if base is not None
              else f"lr: the factor from global batch {first.reference_batch} (--lr and --reference-batch give rates)")
    return [f"{scaled}, scaled by the {first.rule} rule ({WARMUP_NOTE})"]


def _row(position: int, result: PointResult, marks: str, lr: str = "") -> dict[str, str]:
    point = result.point
    row = {"#": f"{position}{marks}", "schedule": point.schedule, "p": str(point.num_ranks),
           "m": str(point.num_micro_batches), "acc": str(point.grad_accum_steps),
           "dp": str(point.data_parallel_size), "rc": point.recompute, "mbs": str(point.micro_batch_size),
           "global": str(point.global_batch), "lr": lr, "status": "ok"}
    if not result.ok:
        return {**{h: "" for h, _ in _COLUMNS}, **row, "status": f"[red]{result.status}[/]"}
    cv = f" ({result.step_time_cv_pct:.0f}%)" if result.step_time_cv_pct is not None else ""
    rate_range = (f" ±{result.ci_half_pct:.1f}%" if result.ci_half_pct is not None
                  else _range(result.samples_per_s_min, result.samples_per_s_max, fmt_rate))
    runs = f"{result.num_repeats}" + (f" {_STOPPED.get(result.stopped, result.stopped)}" if result.stopped else "")
    runs += f" (+{result.busy_reruns} busy)" if result.busy_reruns else ""
    if result.stopped in ("dropped", "equivalent"):  # left the race: why, beside what it measured
        row["status"] = f"{_STOPPED[result.stopped]}: {result.stopped_detail}"
    bubble_range = _range(result.bubble_measured_min, result.bubble_measured_max, _bare_pct)
    return {**row, "samples/s": fmt_rate(result.samples_per_s) + rate_range, "runs": runs,
            "tokens/s": fmt_rate(result.tokens_per_s) if result.tokens_per_s else "n/a",
            "step (cv)": fmt_seconds(result.step_time_median_s) + cv,
            "all-reduce": fmt_seconds(result.allreduce_s) if result.allreduce_s is not None else "",
            "imbal": f"{result.stage_imbalance:.2f}x" if result.stage_imbalance is not None else "",
            "bubble": f"{fmt_pct(result.bubble_measured)}{bubble_range} / {fmt_pct(result.bubble_theoretical)}",
            "peak mem": fmt_bytes(result.max_peak_memory_bytes),
            "MFU": "unknown" if result.mfu_pct is None else f"{result.mfu_pct:.1f}%",
            "kernel active": _kernel_active(result)}


_STOPPED = {"known": "known", "time cap": "cap", "most repeats": "most", "fixed": "", "failed": "", "dropped": "dropped",
            "decided": "decided", "equivalent": "equal", "time budget": "budget"}


def _kernel_active(result: PointResult) -> str:
    if result.nvml is None or not result.nvml.available or not result.nvml.gpus:
        return "n/a"
    values = [g.kernel_active_pct_median for g in result.nvml.gpus if g.kernel_active_pct_median is not None]
    return f"{statistics.fmean(values):.0f}%" if values else "n/a"


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
    grid = key_value_grid()
    if report.command:
        from mbtune.sweeping.command import command_for

        grid.add_row("your command", shlex.join(command_for(report.command, point)))
    grid.add_row("schedule", point.schedule)
    grid.add_row("stages", f"{point.num_ranks * point.stages_per_rank} ({point.num_ranks} rank(s) x "
                 f"{point.stages_per_rank} stage(s) per rank; ran as {best.ran_as})")
    grid.add_row("micro-batch size", str(point.micro_batch_size))
    grid.add_row("micro-batches", str(point.num_micro_batches))
    grid.add_row("accumulation steps", str(point.grad_accum_steps))
    grid.add_row("global batch", f"{point.global_batch} (= {point.micro_batch_size} x {point.num_micro_batches} x "
                 f"{point.grad_accum_steps} x {point.data_parallel_size} data-parallel)")
    interval = (f" ±{best.ci_half_pct:.1f}% (95% interval over {best.ci_basis})" if best.ci_half_pct is not None
                else _range(best.samples_per_s_min, best.samples_per_s_max, fmt_rate))
    grid.add_row("throughput", f"{fmt_rate(best.samples_per_s)} samples/s" + interval
                 + (f", {fmt_rate(best.tokens_per_s)} tokens/s" if best.tokens_per_s else ""))
    measured = (best.bubble_unmeasured if best.bubble_measured is None and best.bubble_unmeasured else
                f"measured {fmt_pct(best.bubble_measured)}"
                + _range(best.bubble_measured_min, best.bubble_measured_max, _bare_pct))
    grid.add_row("bubble", f"{measured}, theory {fmt_pct(best.bubble_theoretical)}")
    if report.decision is not None and report.decision.group:
        equal = ", ".join(report.results[i].point.label for i in report.decision.group)
        grid.add_row("equivalent", f"{equal}: within {report.decision.size:.0%} of this one (95% equivalence "
                                   "test), least memory first: any of them is as good an answer")
    if best.idle is not None:
        grid.add_row("bubble, by cause", f"{fmt_pct(best.idle.schedule)} schedule + {fmt_pct(best.idle.transfer)} transfer"
                     f" + {fmt_pct(best.idle.overhead)} overhead")
    if best.allreduce_s is not None and best.step_time_median_s:
        grid.add_row("all-reduce", f"{fmt_seconds(best.allreduce_s)} per step over {point.data_parallel_size} "
                     f"replicas ({best.allreduce_s / best.step_time_median_s:.0%} of the step)")
    grid.add_row("peak memory", f"{fmt_bytes(best.max_peak_memory_bytes)} on the busiest stage")
    grid.add_row("headroom", _headroom(report, best))
    if report.check is not None or report.check_error:
        grid.add_row("check", _check_line(report))
    return Panel(grid, title=f"Best configuration ({report.objective})", title_align="left", expand=False)


def _check_line(report: SweepReport) -> str:
    """The best row's update against the plain model's (mbtune check), in one line."""
    found = report.check
    if found is None:
        return f"[yellow]not run[/]: {report.check_error}"
    worst = found.worst
    figures = f"worst block {worst.block}: {worst.max_rel_diff:.2g} of its largest gradient" if worst else ""
    if found.status == "PASS":
        return f"[green]PASS[/]: the update is the plain model's ({figures}; tolerance {found.rtol:g} x max)"
    return f"[bold red]FAIL[/]: {found.cause} ({figures}). {found.hint}"


def _headroom(report: SweepReport, best: PointResult) -> str:
    limit, peak = report.ceiling_peak_memory_bytes, best.max_peak_memory_bytes
    if limit is None or peak is None:
        return "n/a (no probe in this run; use mbtune tune)"
    share = 1 - peak / limit
    where = f"{share:.0%} below" if share >= 0 else f"{-share:.0%} above"
    return (f"{where} the probed ceiling's peak ({fmt_bytes(limit)} at batch {report.ceiling}; "
            f"safe batch {report.safe_batch})")


def print_sweep(console: Console, report: SweepReport, fmt: str, *, saved_to: str | None = None,
                every_warning: bool = False) -> None:
    """Print a sweep report in the chosen format."""
    if fmt == "json":
        print_json(report.to_dict())
        return
    if fmt == "csv":
        report.to_frame().to_csv(document_stream(), index=False)
        return
    console.print(results_table(report, console=console))
    if (decided := decision_line(report)) is not None:
        console.print(decided, highlight=False)
    if report.skipped:
        console.print(skipped_table(report))
    console.print(best_panel(report))
    if len(report.tradeoff) > 1 or report.padding:
        console.print(tradeoff_table(report))
    if report.recompute_pairs:
        console.print(recompute_table(report))
    if report.best is not None and report.best.timeline:
        from mbtune.report.timeline import timeline_renderable

        console.print(timeline_renderable(report.best, fit=console.width))
    for line in failure_lines(report):
        console.print(line)
    print_warnings(console, list(report.warnings) + point_warnings(report, every=every_warning))
    for note in report.notes:
        console.print(f"note: {note}")
    if report.interrupted:
        console.print("[yellow]interrupted:[/] the points above finished; the rest did not run")
    if saved_to:
        console.print(f"profile saved to {saved_to}")


def write_artifacts(console: Console, report: SweepReport, *, plot_dir: Path | None, trace_path: Path | None) -> None:
    """--plot and --trace: pictures of the sweep, and the best point's timeline as a Chrome trace."""
    from mbtune.report.plots import write_plots
    from mbtune.report.trace import write_trace

    written = write_plots(report, plot_dir) if plot_dir else []
    if trace_path and report.best is not None:
        written.append(write_trace(report.best, trace_path))
    for path in written:
        console.print(f"wrote {path}")
