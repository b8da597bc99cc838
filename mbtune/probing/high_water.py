"""A run's memory over time, read from what its processes' memory watches wrote (probing/memory_watch.py), and
the rises of its high-water mark named: when, from what to what, and during what (an evaluation pass, a
checkpoint, training steps). Pure: figures in, a record out.

The mark a probe trial measures is the one after its first steps; what a run reaches later (an evaluation
pass at its own batch, the longest sequence arriving late, fragmentation) is a rise above it. A rise is
named where the high-water mark grew by at least RISE_FRACTION of that baseline in one stretch of the same
kind; the stretch is an evaluation pass or a checkpoint where that pass's own marks (when it began and when
it ended) show it raised the mark, or where a sample taken inside it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mbtune.probing.memory_watch import CHECKPOINT, EVALUATION, halve
from mbtune.recordio import Record

TRAINING, START_UP = "training", "start-up"
DURING = (EVALUATION, CHECKPOINT, TRAINING, START_UP)
RISE_FRACTION = 0.01  # a smaller growth of the high-water mark is not named
MAX_KEPT_SAMPLES = 128  # the samples a record keeps (merged in pairs past this, keeping the highs)
MAX_RISES = 8  # the largest ones, in time order


@dataclass(frozen=True, kw_only=True)
class MemorySample(Record):
    """One process's memory at one moment of a run (a merged sample: the highest figures of its stretch)."""

    t_s: float  # from the run's start
    live_bytes: int  # CPU: live tensor bytes; CUDA: allocated
    peak_bytes: int  # the high-water mark so far
    steps: int  # optimizer steps done
    reserved_bytes: int | None = None  # CUDA: what the caching allocator holds from the device
    unallocated_reserved_bytes: int | None = None  # CUDA: reserved but not allocated (the cache, fragments)


@dataclass(frozen=True, kw_only=True)
class PassSeen(Record):
    """An evaluation pass or a checkpoint the run went through, with the high-water mark before and after."""

    KINDS: ClassVar[tuple[str, ...]] = (EVALUATION, CHECKPOINT)

    kind: str  # evaluation | checkpoint
    start_s: float  # from the run's start
    end_s: float
    step: int  # optimizer steps done before it
    peak_before_bytes: int
    peak_after_bytes: int

    @classmethod
    def field_choices(cls, name: str) -> tuple[str, ...] | None:
        return cls.KINDS if name == "kind" else None

    @property
    def raised(self) -> bool:
        return self.peak_after_bytes > self.peak_before_bytes


@dataclass(frozen=True, kw_only=True)
class Rise(Record):
    """The high-water mark grew: from, to, when and during what."""

    at_s: float  # from the run's start: where the growth was first seen
    from_bytes: int
    to_bytes: int
    step: int  # optimizer steps done by then
    during: str  # evaluation | checkpoint | training | start-up

    @classmethod
    def field_choices(cls, name: str) -> tuple[str, ...] | None:
        return DURING if name == "during" else None


@dataclass(frozen=True, kw_only=True)
class HighWater(Record):
    """A run's memory over time: its process with the highest high-water mark (rank and pid say which), its
    samples, the passes it went through, the mark after its first steps and the rises above it."""

    pid: int
    rank: int | None
    peak_bytes: int  # the high-water mark at the end
    num_steps: int
    num_evaluations: int  # every pass seen (`passes` keeps the first ones and those that raised the mark)
    num_checkpoints: int
    settled_steps: int  # the mark after this many optimizer steps is the baseline (what a probe trial holds)
    settled_at_s: float | None = None  # None: the run made fewer steps; no rise is named
    settled_peak_bytes: int | None = None
    rises: tuple[Rise, ...] = ()
    passes: tuple[PassSeen, ...] = ()
    samples: tuple[MemorySample, ...] = ()
    sample_interval_s: float | None = None  # the interval the samples were finally taken at
    # CUDA: the allocator's retries (a cudaMalloc failed, the cache was freed, then tried again) and fragmentation
    num_alloc_retries: int | None = None
    max_reserved_bytes: int | None = None
    max_unallocated_reserved_bytes: int | None = None  # the most reserved but not allocated
    max_inactive_split_bytes: int | None = None  # the most held in free pieces of split blocks

    @property
    def rose(self) -> bool:
        """The high-water mark ended at least RISE_FRACTION above its baseline."""
        base = self.settled_peak_bytes
        return base is not None and self.peak_bytes > base * (1 + RISE_FRACTION)

    @property
    def largest_rise(self) -> Rise | None:
        return max(self.rises, key=lambda r: r.to_bytes - r.from_bytes, default=None)


def high_water(reported: list[dict[str, Any]], run_started: float, settled_steps: int) -> HighWater | None:
    """The run's memory over time from its processes' reports: the process with the highest mark; None where
    no process wrote what its watch saw."""
    watched = [r for r in reported if isinstance(r.get("memory"), dict)]
    if not watched:
        return None
    report = max(watched, key=lambda r: _final_peak(r["memory"]))
    memory = report["memory"]
    offset = max(0.0, float(memory.get("started", run_started)) - run_started) if run_started else 0.0
    fields = memory["fields"]
    rows = [dict(zip(fields, row, strict=False)) for row in memory["samples"]]
    for row in rows:
        row["t_s"] = round(row["t_s"] + offset, 3)
    passes = tuple(PassSeen(kind=e["kind"], start_s=round(e["start_s"] + offset, 3),
                            end_s=round(e["end_s"] + offset, 3), step=e["step"],
                            peak_before_bytes=e["peak_before_bytes"], peak_after_bytes=e["peak_after_bytes"])
                   for e in memory["events"])
    first = memory.get("first_steps", [])
    settled = first[settled_steps - 1] if 0 < settled_steps <= len(first) else None
    settled_at = round(settled[0] + offset, 3) if settled else None
    cuda = "reserved_bytes" in fields
    return HighWater(
        pid=int(report.get("pid", 0)), rank=report.get("rank"), peak_bytes=_final_peak(memory),
        num_steps=memory["num_steps"], num_evaluations=memory["num_evaluations"],
        num_checkpoints=memory["num_checkpoints"], settled_steps=settled_steps, settled_at_s=settled_at,
        settled_peak_bytes=settled[1] if settled else None,
        rises=name_rises(rows, passes, round(settled[0] + offset, 3), settled[1]) if settled else (),
        passes=passes, samples=tuple(_sample(row) for row in thin(rows, MAX_KEPT_SAMPLES, fields)),
        sample_interval_s=memory.get("sample_interval_s"),
        num_alloc_retries=max((r["num_alloc_retries"] for r in rows), default=0) if cuda else None,
        max_reserved_bytes=max((r["reserved_bytes"] for r in rows), default=0) if cuda else None,
        max_unallocated_reserved_bytes=max((r["unallocated_reserved_bytes"] for r in rows), default=0) if cuda else None,
        max_inactive_split_bytes=max((r["inactive_split_bytes"] for r in rows), default=0) if cuda else None,
    )


def thin(rows: list[dict[str, Any]], limit: int, fields: list[str]) -> list[dict[str, Any]]:
    """At most `limit` samples, neighbours merged in pairs (memory_watch.halve) until they fit."""
    table = [[row[f] for f in fields] for row in rows]
    while len(table) > limit:
        table = halve(table)
    return [dict(zip(fields, row, strict=True)) for row in table]


def name_rises(rows: list[dict[str, Any]], passes: tuple[PassSeen, ...], settled_at_s: float,
               settled_peak_bytes: int) -> tuple[Rise, ...]:
    """The growths of the high-water mark after it settled (see the module's text), the MAX_RISES largest in
    time order. `rows`: samples (t_s, peak_bytes, steps) in time order, times from the run's start."""
    marks = [(row["t_s"], row["peak_bytes"], row["steps"], "") for row in rows if row["t_s"] > settled_at_s]
    marks += [(p.end_s, p.peak_after_bytes, p.step, p.kind) for p in passes if p.end_s > settled_at_s and p.raised]
    marks += [(p.start_s, p.peak_before_bytes, p.step, "") for p in passes if p.start_s > settled_at_s]
    marks.sort(key=lambda m: (m[0], m[1]))
    rises: list[Rise] = []
    level, previous_s, growing = settled_peak_bytes, settled_at_s, False
    for at_s, peak, step, kind in marks:
        if peak > level:
            during = kind or _during(passes, previous_s, at_s, step)
            last = rises[-1] if rises else None
            if growing and last is not None and last.during == during:  # one growth, seen at several marks
                rises[-1] = Rise(at_s=last.at_s, from_bytes=last.from_bytes, to_bytes=peak, step=last.step, during=during)
            else:
                rises.append(Rise(at_s=at_s, from_bytes=level, to_bytes=peak, step=step, during=during))
            level, growing = peak, True
        else:
            growing = False
        previous_s = at_s
    named = [r for r in rises if r.to_bytes - r.from_bytes >= RISE_FRACTION * settled_peak_bytes]
    largest = sorted(named, key=lambda r: r.to_bytes - r.from_bytes, reverse=True)[:MAX_RISES]
    return tuple(sorted(largest, key=lambda r: r.at_s))


def _during(passes: tuple[PassSeen, ...], after_s: float, at_s: float, step: int) -> str:
    """What ran when the mark grew between two samples: a pass that raised it and overlaps the stretch,
    else training (start-up before the first step)."""
    for p in passes:
        if p.raised and p.start_s <= at_s and p.end_s >= after_s:
            return p.kind
    return TRAINING if step else START_UP


def _final_peak(memory: dict[str, Any]) -> int:
    fields, samples = memory["fields"], memory["samples"]
    index = fields.index("peak_bytes")
    peaks = [row[index] for row in samples] + [e["peak_after_bytes"] for e in memory["events"]]
    return max(peaks, default=0)


def _sample(row: dict[str, Any]) -> MemorySample:
    return MemorySample(t_s=row["t_s"], live_bytes=row["live_bytes"], peak_bytes=row["peak_bytes"], steps=row["steps"],
                        reserved_bytes=row.get("reserved_bytes"),
                        unallocated_reserved_bytes=row.get("unallocated_reserved_bytes"))
