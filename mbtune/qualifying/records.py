"""Typed, frozen records of a qualification: its checks, its verdict, and profile comparisons. No torch."""

from __future__ import annotations

from dataclasses import dataclass

from mbtune.probing.records import ProbeResult
from mbtune.records import DeviceInfo, MachineState, Record
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
    more_measurements: float | None = None  # INCONCLUSIVE: how many times the measurements would decide it


@dataclass(frozen=True, kw_only=True)
class Change(Record):
    """A step in one check's series of runs: at which run (numbered from 1) and when, the mean after over
    the mean before less one with its 95% half-interval (percent), and the t-test's p."""

    check: str
    run: int
    started_at: str
    change_pct: float
    half_pct: float
    p_value: float
    before: float
    after: float

    @property
    def words(self) -> str:
        """e.g. "best throughput (samples/s) changed at run 14 (2026-12-07): -8.1% +-2.0%"."""
        day = self.started_at[:10] or "date unknown"
        return f"{self.check} changed at run {self.run} ({day}): {self.change_pct:+.1f}% ±{self.half_pct:.1f}%"


@dataclass(frozen=True, kw_only=True)
class RunCheck(Record):
    """One check of a kept run: its status, figure and spread."""

    name: str
    status: str
    measured: float | None = None
    spread_pct: float | None = None
    gating: bool = True


@dataclass(frozen=True, kw_only=True)
class HistoryRun(Record):
    """One qualification run as its history keeps it."""

    run: int  # numbered from 1 in its history
    started_at: str
    status: str
    wall_s: float = 0.0
    tolerance: float = 0.10
    device: str = ""
    checks: tuple[RunCheck, ...] = ()
    state: MachineState | None = None


@dataclass(frozen=True, kw_only=True)
class History(Record):
    """Every qualification run of one machine against one baseline (or spec), oldest first."""

    history_version: int
    machine: str  # the host name
    baseline: str  # the baseline profile (or spec) the runs were judged against, as first given
    runs: tuple[HistoryRun, ...] = ()


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
    state: MachineState | None = None  # the machine's state while it ran
    history: str | None = None  # the history file this run was added to
    run: int | None = None  # this run's number in that history
    changes: tuple[Change, ...] = ()  # the latest step of each gating check's series, where one is found
    rounds: int = 1  # rounds measured, each twice as precise as the one before (--until-decided)
    until_decided_s: float | None = None  # the time --until-decided allowed

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
