"""When a point's throughput is known: the stopping rule of a measurement that runs until it knows.

A point is run in fresh processes, one repeat after another; each repeat's throughput is the point's
global batch over the median of its measured steps. Between processes the figure moves more than between
the steps of one process (placement, allocator, caches, the machine's other work), so the interval is
taken over repeats: the 95% confidence interval of their mean, mean +- t(0.975, n-1) x sd / sqrt(n)
(Student's t), as a share of the mean. The point is known once that interval's whole width is at most the
target; measuring stops there, or when the next repeat would pass the time cap, or at MAX_REPEATS. With a
fixed number of repeats the rule is not asked; a single repeat's interval is taken over its steps instead
(narrower than the truth between processes, and labelled so).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from mbtune.intervals import t975

MIN_REPEATS = 3  # fewer leave t(0.975, 1) = 12.7: no interval worth the name
MAX_REPEATS = 20  # as many worker processes as pyperf runs before it calls a difference significant
MAX_BUSY_RERUNS = 3  # repeats run again, per point, because other processes loaded the machine

REPEATS_ENV = "MBTUNE_REPEATS"  # a machine's default --repeats (e.g. 1 for a CI smoke run); unset: until known
KNOWN, TIME_CAP, MOST_REPEATS, FIXED, FAILED = "known", "time cap", "most repeats", "fixed", "failed"
INTERRUPTED = "interrupted"  # the sweep was stopped (Ctrl-C) while this point was still measuring
# The race (sweeping/race.py): a point a 95% test separates from the best leaves it; the best stops once no
# point is tied with it; every point still measuring stops when the sweep's time budget is spent.
# A point a 95% equivalence test shows within the declared size of the best leaves it too (equal is an answer).
DROPPED, DECIDED, EQUIVALENT, TIME_BUDGET = "dropped", "decided", "equivalent", "time budget"

# What `qualify --baseline` measures to (qualifying/run.py), and what a sweep made to be a baseline measures
# to (--as-baseline): the 95% interval a quarter of the tolerance wide, a point measured for up to this long.
DEFAULT_TOLERANCE = 0.10
QUALIFY_MAX_TIME_PER_POINT_S = 30.0


def qualify_target_ci(tolerance: float) -> float:
    """The width of the 95% interval a qualification measures each point to, for a tolerance."""
    return max(tolerance / 4, 0.001)


@dataclass(frozen=True)
class Interval:
    """A 95% confidence interval of a mean, as shares of it: the figure lies in mean x (1 -+ half)."""

    half: float  # half the width, as a share of the mean
    basis: str  # what it was taken over ("5 repeats", "3 steps of 1 repeat")

    @property
    def width(self) -> float:
        return 2 * self.half


def interval(values: Sequence[float], basis: str) -> Interval | None:
    """The 95% interval of the mean of `values` (positive figures, e.g. samples/s); None under two."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    if mean <= 0:
        return None
    return Interval(half=t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)) / mean,
                    basis=basis)


def should_stop(rates: Sequence[float], *, target_width: float, elapsed_s: float, repeat_s: float,
                max_time_s: float, min_repeats: int = MIN_REPEATS, max_repeats: int = MAX_REPEATS) -> str | None:
    """Why measuring stops after these repeats' rates, or None to run one more: KNOWN when the interval's
    width is at most `target_width` (after `min_repeats`), TIME_CAP when one more repeat (as long as the
    mean one so far, `repeat_s`) would end past `max_time_s` (before `min_repeats`: past twice it),
    MOST_REPEATS at `max_repeats`."""
    n = len(rates)
    found = interval(rates, f"{n} repeats")
    if n >= min_repeats and found is not None and found.width <= target_width:
        return KNOWN
    if n >= max_repeats:
        return MOST_REPEATS
    # The cap stops a point once it has MIN_REPEATS (fewer give no interval worth the name, nor a comparison
    # round by round), or where even those would run past twice the cap.
    cap = max_time_s if n >= min_repeats else 2 * max_time_s
    if n >= 1 and elapsed_s + repeat_s > cap:
        return TIME_CAP
    return None


def default_repeats() -> int | None:
    """The repeats a sweep makes when none are asked for: MBTUNE_REPEATS where it holds a whole number
    >= 1, else None (until known)."""
    raw = os.environ.get(REPEATS_ENV, "").strip()
    return int(raw) if raw.isdigit() and int(raw) >= 1 else None
