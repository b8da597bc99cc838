"""Probe results for people (rich) and machines (JSON, CSV)."""

from __future__ import annotations

import shlex

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from mbtune.probing.command import command_at
from mbtune.probing.confirm import FITS
from mbtune.probing.records import MemoryModel, ProbeResult, TrialOutcome
from mbtune.records import HARNESS_FAULT
from mbtune.report import document_stream, fmt_bytes, fmt_rate, fmt_seconds, key_value_grid, print_json, print_warnings
from mbtune.report.confirm import fmt_clock, memory_lines
from mbtune.units import size_flag

_STATUS_STYLE = {"ok": "green", "oom": "yellow", "error": "red", "timeout": "red", "killed": "red",
                 "nonfinite": "red"}
CAUSE_CHARS = 160  # a failure's cause in a table: one line, at most this long


def cause_line(error: str, error_kind: str = "", *, limit: int = CAUSE_CHARS) -> str:
    """A failure's cause on one short line: the error's first line (a traceback's last), marked when the
    harness, not the workload, failed."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    text = (lines[-1] if lines[0].startswith("Traceback") else lines[0]) if lines else "no error text"
    if error_kind == HARNESS_FAULT:
        text = f"harness: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def trials_table(trials: tuple[TrialOutcome, ...] | list[TrialOutcome], *, title: str = "Trials") -> Table:
    """Every trial in the order it ran; with a cause column (one short line) when any failed."""
    table = Table(title=title, title_justify="left")
    failed = any(not trial.ok for trial in trials)
    # A command's trial costs its start-up and its steps: both shown.
    timed = any(trial.startup_s is not None for trial in trials)
    names = ("#", "batch", "status", "peak memory", "budget used", "step time", "samples/s")
    for name in names + (("start-up", "steps") if timed else ()):
        # With a cause column, that one alone gives way (cut short) when the table is too wide.
        table.add_column(name, justify="left" if name == "status" else "right", no_wrap=failed)
    if failed:
        table.add_column("cause", max_width=CAUSE_CHARS)
    for number, trial in enumerate(trials, 1):
        style = _STATUS_STYLE.get(trial.status, "")
        cells: list[str | Text] = [
            str(number), str(trial.batch_size), f"[{style}]{trial.status}[/]",
            fmt_bytes(trial.peak_memory_bytes), fmt_bytes(trial.budget_used_bytes),
            fmt_seconds(trial.step_time_s) if trial.ok else "", fmt_rate(trial.samples_per_s) if trial.ok else "",
        ]
        if timed:
            startup = trial.startup_s
            cells += [fmt_seconds(startup) if startup is not None else "",
                      fmt_seconds(trial.wall_s - startup) if startup is not None else ""]
        if failed:
            cause = "" if trial.ok else cause_line(trial.error, trial.error_kind)
            cells.append(Text(cause, no_wrap=True, overflow="ellipsis"))
        table.add_row(*cells)
    return table


def summary_panel(result: ProbeResult) -> Panel:
    """Ceiling, first failing size, margin, safe batch, memory model and device."""
    grid = key_value_grid()
    device = result.device
    grid.add_row("device", f"{device.label} {device.name} ({fmt_bytes(device.total_memory_bytes)})")
    grid.add_row("workload", _workload_label(result))
    if result.num_parameters:
        flops = f", {result.flops_per_sample / 1e9:.3g} GFLOP per sample (training)" if result.flops_per_sample else ""
        grid.add_row("model", f"{result.num_parameters / 1e6:.3g}M parameters{flops}")
    grid.add_row("memory budget", fmt_bytes(result.memory_budget_bytes) if result.memory_budget_bytes else "whole device")
    grid.add_row("ceiling", f"[bold]{result.ceiling}[/]" + (" (stopped at --max-batch)" if result.stopped_at_max_batch else ""))
    grid.add_row("first failing", "none (max batch reached)" if result.first_failing is None else str(result.first_failing))
    if result.first_failing is not None:
        grid.add_row("bracket", f"[{result.ceiling}, {result.first_failing}): the ceiling lies in this band "
                                f"(resolution {result.resolution or result.granularity})")
    grid.add_row("margin", f"{result.margin:.0%}")
    grid.add_row("safe batch", f"[bold green]{result.safe_batch}[/] ({_verified(result)})")
    if result.predicted is not None:
        grid.add_row("predicted", predicted_text(result))
    if result.memory_budget_bytes and result.mode == "train":
        yours = (shlex.join(command_at(result.command, result.safe_batch)) if result.command
                 else f"<your training command at batch {result.safe_batch}>")
        grid.add_row("your script", f"mbtune confirm --memory-budget {size_flag(result.memory_budget_bytes)} -- {yours}")
    grid.add_row("memory model", memory_model_text(result.memory_model))
    grid.add_row("trials", str(len(result.trials)))
    if covers := coverage_text(result):
        grid.add_row("covers", covers)
    if result.confirmed is not None:
        grid.add_row("confirmed", confirmed_text(result))
    if result.recompute != "none" or result.recompute_ceilings:
        grid.add_row("recompute", f"{result.recompute} (the figures above)")
    for other in result.recompute_ceilings:
        ratio = f", x{other.ceiling / result.ceiling:.2f} the ceiling above" if result.ceiling else ""
        verified = "" if other.safe_batch_verified else " ([red]FAILED its verification run[/])"
        grid.add_row(f"recompute {other.recompute}", f"ceiling [bold]{other.ceiling}[/]{ratio}, safe batch "
                     f"[bold green]{other.safe_batch}[/]{verified}, peak {fmt_bytes(other.peak_memory_bytes)} at "
                     f"the ceiling ({other.trials} trials)")
    return Panel(grid, title="Probe result", title_align="left", expand=False)


def coverage_text(result: ProbeResult) -> str:
    """What a command's ceiling covers: whether its trials' steps reached an evaluation pass or a checkpoint
    ("" where they were not watched)."""
    watched = [t for t in result.trials if t.ok and t.num_evaluations is not None]
    trials = [t for t in watched if t.batch_size == result.ceiling] or watched
    if not trials:
        return ""
    evaluations = max(t.num_evaluations or 0 for t in trials)
    checkpoints = max(t.num_checkpoints or 0 for t in trials)
    steps = f"the trials' {result.steps} {'printed steps' if result.steps_from_output else 'steps'}"
    if evaluations == 0 and checkpoints == 0:
        confirm = "" if result.confirmed is not None else "; confirm it over a run with --confirm-duration"
        return (f"{steps} reached no evaluation pass and no checkpoint: the ceiling covers training steps "
                f"only{confirm}")
    reached = [f"{n} evaluation pass{'es' if n > 1 else ''}" for n in (evaluations,) if n]
    reached += [f"{n} checkpoint{'s' if n > 1 else ''}" for n in (checkpoints,) if n]
    missing = "no checkpoint" if not checkpoints else "no evaluation pass" if not evaluations else ""
    return f"{steps} reached {' and '.join(reached)}" + (f", {missing}" if missing else "")


def confirmed_text(result: ProbeResult) -> str:
    """The --confirm-duration run at the safe batch: how it ended and its memory over time."""
    assert result.confirmed is not None
    run = result.confirmed.runs[0]
    style = "green" if run.outcome == FITS else "bold red"
    ended = "then asked to stop" if run.stopped else "ended by itself"
    head = (f"[{style}]{run.outcome}[/] at batch {result.safe_batch} over {fmt_clock(run.wall_s)}, {ended}"
            + (f" ({escape(run.cause)})" if run.cause else ""))
    lines = memory_lines(run.high_water) if run.high_water is not None else []
    return "\n".join([head, *(escape(line) for line in lines)])


def predicted_text(result: ProbeResult) -> str:
    """Where the fake steps put the ceiling before any trial, and how far that was from what the trials found."""
    predicted = result.predicted
    assert predicted is not None
    off = predicted.ceiling - result.ceiling
    verdict = ("exact" if off == 0 else
               f"{off:+d} ({off / result.ceiling:+.1%}), within the resolution" if abs(off) < (result.resolution or 1)
               else f"off by {off:+d} ({off / result.ceiling:+.1%})")
    return (f"ceiling {predicted.ceiling} before any trial (peak {fmt_bytes(predicted.peak_bytes)} on fake tensors): "
            f"{verdict}")


def _verified(result: ProbeResult) -> str:
    if not result.safe_batch_verified:
        return "[red]FAILED its verification run[/]"
    runs = f"passed {result.confirm} fresh run{'s' if result.confirm > 1 else ''}"
    first = result.safe_batch_first
    return f"{runs}; stepped down from {first}" if first and first != result.safe_batch else runs


def memory_model_text(model: MemoryModel | None) -> str:
    """The fitted memory model in words, or why there is none."""
    if model is None:
        return "n/a (fewer than two sizes ran)"
    if model.per_sample_bytes is None:
        return (f"not resolved (memory barely grows with the batch over these {model.num_points} trials): "
                "no per-sample memory")
    return (f"{fmt_bytes(model.fixed_bytes)} + {fmt_bytes(model.per_sample_bytes)} x batch "
            f"(fit error {model.fit_error_pct:.1f}% over {model.num_points} trials)")


def _workload_label(result: ProbeResult) -> str:
    if result.command:  # the script chose its own precision and optimizer
        return f"{result.workload}: {shlex.join(result.command)}"
    options = ", ".join(f"{k}={v}" for k, v in result.workload_options.items())
    settings = f"{result.precision}, {result.optimizer}"
    return f"{result.workload} ({options}; {settings})" if options else f"{result.workload} ({settings})"


def print_probe(console: Console, result: ProbeResult, fmt: str, *, saved_to: str | None = None) -> None:
    """Print a probe result in the chosen format."""
    if fmt == "json":
        print_json(result.to_dict())
        return
    if fmt == "csv":
        result.to_frame().to_csv(document_stream(), index=False)
        return
    console.print(trials_table(result.trials))
    console.print(summary_panel(result))
    print_warnings(console, result.warnings)
    if saved_to:
        console.print(f"profile saved to {saved_to}")


