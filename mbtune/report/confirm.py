"""`mbtune confirm` for people (a row per run and a verdict) and machines (JSON)."""

from __future__ import annotations

import shlex

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mbtune.probing.confirm import CRASHED, FITS, ConfirmResult, ConfirmRun
from mbtune.report import fmt_bytes, print_json


def print_confirm_run(console: Console, index: int, run: ConfirmRun) -> None:
    """One run as it ends (progress, on stderr)."""
    peak = f", peak {fmt_bytes(run.peak_bytes)}" if run.peak_bytes is not None else ""
    console.print(f"  run {index + 1}: {run.outcome}{peak} in {run.wall_s:.1f} s"
                  + (f" ({escape(run.cause)})" if run.cause else ""))


def print_confirm(console: Console, result: ConfirmResult, fmt: str) -> None:
    if fmt == "json":
        print_json({**result.to_dict(), "exit_code": result.exit_code})
        return
    budget = result.memory_budget_bytes
    table = Table(title=f"Confirm under {fmt_bytes(budget)} on {result.device}: {escape(shlex.join(result.command))}",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("run", "outcome", "peak", "of budget", "exit code", "seconds", "cause"):
        table.add_column(name, justify="left" if name in ("outcome", "cause") else "right")
    for index, run in enumerate(result.runs, 1):
        style = "green" if run.outcome == FITS else "bold red"
        table.add_row(str(index), f"[{style}]{run.outcome}[/]", fmt_bytes(run.peak_bytes),
                      f"{run.peak_bytes / budget:.0%}" if run.peak_bytes is not None else "",
                      "" if run.exit_code is None else str(run.exit_code), f"{run.wall_s:.1f}", escape(run.cause))
    table.caption = ("peak: the most live tensor bytes any of the run's processes held (CPU), or its allocated "
                     "peak (CUDA)")
    console.print(table)
    crashed = next((run for run in result.runs if run.outcome == CRASHED), None)
    if crashed is not None and crashed.output_tail:
        console.print(f"[dim]the last lines of a run that crashed:[/]\n{escape(crashed.output_tail)}")
    fits = sum(run.outcome == FITS for run in result.runs)
    style = "bold green" if result.exit_code == 0 else "bold red"
    console.print(f"[{style}]{fits} of {len(result.runs)} runs fit under {fmt_bytes(budget)}[/]")
