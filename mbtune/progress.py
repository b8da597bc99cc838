"""What a long job reports while it runs (report/progress.py draws it)."""

from __future__ import annotations

from typing import Protocol


class TrialProgress(Protocol):
    """What a long job reports while it runs (report/ implements it; None means silent)."""

    def set_total(self, total: int | None) -> None: ...

    def start_trial(self, description: str) -> None: ...

    def end_trial(self, status: str, detail: str = "") -> None: ...

    def working(self, description: str) -> None:
        """What runs now, between trials (a sweep measuring its points round-robin); not a trial of its own."""
