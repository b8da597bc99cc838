"""`mbtune confirm` for people (a row per run, each run's memory over time and a verdict) and machines (JSON)."""

from __future__ import annotations

import shlex

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mbtune.probing.confirm import CRASHED, FITS, ConfirmConfig, ConfirmResult, ConfirmRun
from mbtune.probing.high_water import CHECKPOINT, EVALUATION, START_UP, HighWater, Rise
from mbtune.report import fmt_bytes, print_json

_DURING = {EVALUATION: "during an evaluation pass", CHECKPOINT: "during a checkpoint", START_UP: "during start-up"}


def fmt_clock(seconds: float) -> str:
    """A moment of a run as people say it: 12.3 s, 4 min 10 s, 2 h 5 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


def _counted(count: int, word: str) -> str:
    return f"{'no' if count == 0 else count} {word}{'' if count == 1 else 'es' if word.endswith('s') else 's'}"


def rise_text(rise: Rise) -> str:
    """'from 1.2 GiB to 1.5 GiB at 4 min 10 s, during an evaluation pass'."""
    during = _DURING.get(rise.during, f"during training (step {rise.step})")
    return f"from {fmt_bytes(rise.from_bytes)} to {fmt_bytes(rise.to_bytes)} at {fmt_clock(rise.at_s)}, {during}"


def high_water_text(memory: HighWater) -> str:
    """The run's high-water mark over time in a sentence: held, or rose (each rise named with when and during
    what)."""
    if memory.settled_peak_bytes is None or memory.settled_at_s is None:
        return (f"peak {fmt_bytes(memory.peak_bytes)}; the run made {memory.num_steps} optimizer step(s), fewer than "
                f"the {memory.settled_steps} after which its high-water mark is compared: no rise named")
    after = f"after {memory.settled_steps} steps, at {fmt_clock(memory.settled_at_s)}"
    if not memory.rose:
        return f"peak held at {fmt_bytes(memory.peak_bytes)} from {after} to the end"
    if len(memory.rises) == 1:
        rise = memory.rises[0]
        settled = "" if rise.from_bytes == memory.settled_peak_bytes else f": {fmt_bytes(memory.settled_peak_bytes)}"
        end = "" if rise.to_bytes == memory.peak_bytes else f"; {fmt_bytes(memory.peak_bytes)} at the end"
        return f"peak rose {rise_text(rise)} (the mark {after}{settled}){end}"
    overall = f"peak rose from {fmt_bytes(memory.settled_peak_bytes)} ({after}) to {fmt_bytes(memory.peak_bytes)}"
    if not memory.rises:
        return f"{overall}, in small steps (none of them 1% of it)"
    return f"{overall}: " + "; ".join(rise_text(rise) for rise in memory.rises)


def passes_text(memory: HighWater) -> str:
    """'3 evaluation passes and 1 checkpoint seen in 412 optimizer steps'."""
    return (f"{_counted(memory.num_evaluations, 'evaluation pass')} and {_counted(memory.num_checkpoints, 'checkpoint')} "
            f"seen in {memory.num_steps} optimizer step{'' if memory.num_steps == 1 else 's'}")


def cuda_text(memory: HighWater) -> str:
    """On CUDA, the allocator's retries and fragmentation ("" elsewhere)."""
    if memory.num_alloc_retries is None:
        return ""
    return (f"CUDA allocator: {memory.num_alloc_retries} retr{'y' if memory.num_alloc_retries == 1 else 'ies'} "
            f"(a cudaMalloc that failed, the cache freed, then tried again); reserved at most "
            f"{fmt_bytes(memory.max_reserved_bytes)}, of it not allocated at most {fmt_bytes(memory.max_unallocated_reserved_bytes)} "
            f"(free pieces of split blocks, fragmentation: at most {fmt_bytes(memory.max_inactive_split_bytes)})")


def memory_lines(memory: HighWater) -> list[str]:
    """Everything a run's memory over time says, a sentence a line."""
    where = f"rank {memory.rank}, " if memory.rank is not None else ""
    lines = [f"{high_water_text(memory)} ({where}the process with the highest)" if where else high_water_text(memory),
             passes_text(memory)]
    return lines + ([cuda] if (cuda := cuda_text(memory)) else [])


def print_confirm_start(console: Console, config: ConfirmConfig) -> None:
    """What the runs will do (progress, on stderr), where they go for a set time."""
    if config.duration_s is not None:
        runs = config.num_runs
        console.print(f"{runs} run{'s' if runs > 1 else ''}, each for {fmt_clock(config.duration_s)}, then asked to stop")


def print_confirm_run(console: Console, index: int, run: ConfirmRun) -> None:
    """One run as it ends (progress, on stderr)."""
    peak = f", peak {fmt_bytes(run.peak_bytes)}" if run.peak_bytes is not None else ""
    console.print(f"  run {index + 1}: {run.outcome}{peak} in {run.wall_s:.1f} s"
                  + (f" ({escape(run.cause)})" if run.cause else ""))
    if run.high_water is not None and run.high_water.rose:
        console.print(f"    {escape(high_water_text(run.high_water))}")


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
        outcome = f"{run.outcome}, stopped" if run.stopped else run.outcome
        table.add_row(str(index), f"[{style}]{outcome}[/]", fmt_bytes(run.peak_bytes),
                      f"{run.peak_bytes / budget:.0%}" if run.peak_bytes is not None else "",
                      "" if run.exit_code is None else str(run.exit_code), f"{run.wall_s:.1f}", escape(run.cause))
    table.caption = ("peak: the most live tensor bytes any of the run's processes held (CPU), or its allocated "
                     "peak (CUDA)" + ("; stopped: ran the whole duration, then was asked to stop" if result.duration_s else ""))
    console.print(table)
    for index, run in enumerate(result.runs, 1):
        if run.high_water is not None:
            console.print(f"run {index}: " + "\n  ".join(escape(line) for line in memory_lines(run.high_water)))
    crashed = next((run for run in result.runs if run.outcome == CRASHED), None)
    if crashed is not None and crashed.output_tail:
        console.print(f"[dim]the last lines of a run that crashed:[/]\n{escape(crashed.output_tail)}")
    fits = sum(run.outcome == FITS for run in result.runs)
    style = "bold green" if result.exit_code == 0 else "bold red"
    console.print(f"[{style}]{fits} of {len(result.runs)} runs fit under {fmt_bytes(budget)}[/]")
