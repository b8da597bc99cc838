"""The journal of a saved run as the wings see it: what a probe, sweep or serve run records as each trial,
point or load finishes, and what an interrupted run's journal replays (session.py keeps it in a RunStore)."""

from __future__ import annotations

from typing import Any, Protocol

REPLAYED = "replayed from the journal"  # the progress line of a trial or point taken from the journal


class Journal(Protocol):
    """Records by kind, in the order they finished."""

    def replayed(self, kind: str) -> list[dict[str, Any]]: ...

    def record(self, kind: str, record: dict[str, Any]) -> None: ...
