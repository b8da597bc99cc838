"""Typed, frozen records of a qualification: its checks, its verdict, and profile comparisons. No torch."""

from __future__ import annotations

from dataclasses import dataclass

from mbtune.probing.records import ProbeResult
from mbtune.records import DeviceInfo, Record
from mbtune.sweeping.records import SweepReport

PASS, FAIL = "PASS", "FAIL"  # a check's status; ERROR (upper case) when it could not be measured
CHECK_ERROR = "ERROR"
INCONCLUSIVE = "INCONCLUSIVE"  # the check's own measured spread is wider than its tolerance


@dataclass(frozen=True, kw_only=True)
class Check(Record):
    """One qualification check: PASS, FAIL (a bound missed by more than the measurement's spread),
    INCONCLUSIVE (the spread reaches across the bound) or ERROR (it could not be measured)."""

    name: str
    status: str
    measured: float | None = None
    expected: float | None = None  # the bound the measurement had to meet
    rule: str = ""  # e.g. ">= 90% of baseline 389" or ">= minimum 100"
    detail: str = ""
    spread_pct: float | None = None  # the measurement's own spread (max-min over median), where known
    gating: bool = True  # False: shown and kept, but it cannot fail the verdict (per-point rows)


@dataclass(frozen=True, kw_only=True)
class Verdict(Record):
    """The outcome of `mbtune qualify`: every check, and what was measured."""

    checks: tuple[Check, ...]
    device: DeviceInfo | None = None
    baseline: str | None = None  # path of the baseline profile
    baseline_device: str | None = None
    tolerance: float = 0.10
    repeats: int | None = None  # runs of each sweep point made here
    probe: ProbeResult | None = None
    sweep: SweepReport | None = None
    started_at: str = ""  # when the qualification began, ISO 8601 in UTC
    wall_s: float = 0.0  # how long it took, everything included

    @property
    def status(self) -> str:
        """ERROR if a gating check is an ERROR, else FAIL if one failed, else INCONCLUSIVE if one is, else
        PASS. Checks with gating=False are shown but never change it."""
        statuses = {c.status for c in self.checks if c.gating}
        return next((s for s in (CHECK_ERROR, FAIL, INCONCLUSIVE) if s in statuses), PASS)


@dataclass(frozen=True, kw_only=True)
class ComparisonRow(Record):
    """One quantity of two profiles side by side; ratio = b / a."""

    quantity: str
    a: float | None
    b: float | None

    @property
    def ratio(self) -> float | None:
        return self.b / self.a if self.a and self.b is not None else None
