"""Qualification histories for people (a rich table per history), machines (JSON, CSV) and pictures (a
chart per history, each gating check's series with its steps marked)."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from mbtune.qualifying.history import Shown
from mbtune.report import document_stream, print_json

_STYLE = {"PASS": "green", "FAIL": "bold red", "ERROR": "bold magenta", "INCONCLUSIVE": "bold yellow"}


def history_table(shown: Shown) -> Table:
    """One row per run: when, the verdict, each gating check's figure (a step marked where one begins)."""
    names = shown.series()
    table = Table(title=f"{shown.history.machine} against {shown.history.baseline}", title_justify="left",
                  box=box.SIMPLE_HEAD)
    for column in ("run", "started (UTC)", "verdict", *names):
        table.add_column(column, justify="right" if column in names or column == "run" else "left")
    starts = {(c.check, c.run): c for changes in shown.changes.values() for c in changes}
    for run in shown.history.runs:
        figures = {c.name: c for c in run.checks if c.gating}
        cells = []
        for name in names:
            check = figures.get(name)
            text = "n/a" if check is None or check.measured is None else _figure(check.measured)
            if check is not None and check.spread_pct is not None:
                text += f" ±{check.spread_pct:.1f}%"
            cells.append(f"[bold]> {text}[/]" if (name, run.run) in starts else text)
        table.add_row(str(run.run), run.started_at.replace("T", " "), f"[{_STYLE.get(run.status, '')}]{run.status}[/]",
                      *cells)
    found = [c.words for changes in shown.changes.values() for c in changes]
    table.caption = (f"{shown.path}\n" + ("\n".join(f"> {w}" for w in found) if found else
                                          f"no step found in {len(shown.history.runs)} run(s)"))
    return table


def print_histories(console: Console, shown: Sequence[Shown], fmt: str) -> None:
    """Every history as a table, or all of them as one JSON document or CSV (a row per run and check)."""
    if fmt == "json":
        print_json({"histories": [{"path": str(s.path), **s.history.to_dict(),
                                   "changes": [c.to_dict() for changes in s.changes.values() for c in changes]}
                                  for s in shown]})
    elif fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(["history", "machine", "baseline", "run", "started_at", "verdict", "check", "gating",
                         "status", "measured", "spread_pct", "step"])
        for s in shown:
            starts = {(c.check, c.run): c for changes in s.changes.values() for c in changes}
            for run in s.history.runs:
                for check in run.checks:
                    step = starts.get((check.name, run.run))
                    writer.writerow([str(s.path), s.history.machine, s.history.baseline, run.run, run.started_at,
                                     run.status, check.name, check.gating, check.status,
                                     "" if check.measured is None else check.measured,
                                     "" if check.spread_pct is None else round(check.spread_pct, 3),
                                     step.words if step else ""])
        document_stream().write(buffer.getvalue())
    else:
        for s in shown:
            console.print(history_table(s))


def write_history_plots(shown: Sequence[Shown], directory: Path) -> list[Path]:
    """One PNG per history: each gating check's figures over the runs, a vertical line where a step begins."""
    from mbtune.report.plots import new_figure, save_figure

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in shown:
        names = s.series()
        figure = new_figure(9.0, 2.6 * max(1, len(names)))
        for row, name in enumerate(names, start=1):
            ax = figure.add_subplot(len(names), 1, row)
            points = [(run.run, c.measured, c.spread_pct) for run in s.history.runs for c in run.checks
                      if c.name == name and c.gating and c.measured is not None]
            runs = [p[0] for p in points]
            values = [p[1] for p in points]
            errors = [abs(v) * (p[2] or 0.0) / 100 for v, p in zip(values, points, strict=True)]
            ax.errorbar(runs, values, yerr=errors, fmt="o-", markersize=3, linewidth=1, capsize=2)
            for change in s.changes.get(name, []):
                ax.axvline(change.run - 0.5, color="tab:red", linestyle="--", linewidth=1)
                ax.annotate(f"{change.change_pct:+.1f}%", (change.run - 0.5, max(values)), color="tab:red",
                            fontsize=8, ha="left", va="top")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("run")
        paths.append(save_figure(figure, directory / f"history-{s.path.parent.name}-{s.path.stem}.png"))
    return paths


def _figure(value: float) -> str:
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
