"""A progress bar for long jobs: trial k (of n where known), the current config, elapsed and ETA."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class TrialProgressBar:
    """Implements runs.TrialProgress on a rich progress bar (on stderr, so stdout stays parseable)."""

    def __init__(self, console: Console, *, label: str, total: int | None = None) -> None:
        self._progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[current]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=console, transient=True,
        )
        self._task = self._progress.add_task(label, total=total, current="starting")
        self._count = 0
        self._description = ""

    def __enter__(self) -> TrialProgressBar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def set_total(self, total: int | None) -> None:
        """Start counting a new phase (tune: the probe's open-ended trials, then the sweep's known points)."""
        self._count = 0
        self._progress.reset(self._task, total=total, current="starting")

    def start_trial(self, description: str) -> None:
        self._count += 1
        self._description = description
        self._progress.update(self._task, current=f"trial {self._count}: {description}")

    def working(self, description: str) -> None:
        self._progress.update(self._task, current=description)

    def end_trial(self, status: str, detail: str = "") -> None:
        self._progress.advance(self._task)
        style = {"ok": "green", "oom": "yellow"}.get(status, "red")
        suffix = f" ({escape(detail)})" if detail else ""  # a cause may hold [brackets]
        self._progress.console.print(f"  trial {self._count}: {self._description} -> [{style}]{status}[/]{suffix}",
                                     highlight=False)
