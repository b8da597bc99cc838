"""The load generator's pure half: Poisson arrivals, percentiles with rejected requests counted, and
perf_analyzer's rule for when a measurement counts (consecutive windows that agree).

No torch and no clock here: server.py drives real requests with these, simulate.py simulated ones.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from mbtune.intervals import Z95, t975

POISSON, CLOSED = "poisson", "closed"
LOAD_KINDS = (POISSON, CLOSED)
# perf_analyzer's defaults: a measurement is stable when this many consecutive windows agree within this
# share on throughput and on mean latency.
STABLE_WINDOWS = 3
STABILITY = 0.10
# Past stability, a load measures windows until its p99's 95% interval (taken over its windows,
# sectioned_half) lies within this share of it on each side, or the windows run out: a p99 from a few
# hundred requests is its few slowest, and a stall of a second moves it more than the binomial says.
P99_TARGET = 0.10


def poisson_arrivals(rate_per_s: float, duration_s: float, *, seed: int) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process: exponential gaps of mean 1 / rate."""
    draw = random.Random(seed)
    times: list[float] = []
    now = draw.expovariate(rate_per_s)
    while now < duration_s:
        times.append(now)
        now += draw.expovariate(rate_per_s)
    return times


def percentile(values: Sequence[float], share: float, *, rejected: int = 0) -> float:
    """The `share` (0-1) percentile by the nearest-rank rule; `rejected` requests count as slower than
    every served one (a request the server dropped broke any latency budget). inf when the percentile
    falls among the rejected, nan with nothing at all."""
    total = len(values) + rejected
    if total == 0:
        return math.nan
    rank = max(1, math.ceil(share * total))
    if rank > len(values):
        return math.inf
    return sorted(values)[rank - 1]


def quantile_interval(values: Sequence[float], share: float, *, rejected: int = 0, z: float = Z95,
                      rank_spread: float | None = None) -> tuple[float, float]:
    """A distribution-free 95% interval of the `share` percentile: the order statistics it lies between with
    95% probability (how many values fall below it is binomial, n x share on average, for independent
    values; `rank_spread`, in ranks, where it is known otherwise). `rejected` requests count as slower than
    every served one (inf); nan with nothing at all."""
    total = len(values) + rejected
    if total == 0:
        return math.nan, math.nan
    centre = share * total
    spread = _binomial_spread(total, share, z) if rank_spread is None else rank_spread
    ordered = sorted(values)

    def at(rank: int) -> float:
        return ordered[rank - 1] if rank <= len(ordered) else math.inf

    return at(max(1, math.floor(centre - spread))), at(min(total, math.ceil(centre + spread)))


def _binomial_spread(total: int, share: float, z: float = Z95) -> float:
    """The 95% spread, in ranks, of the count below the `share` percentile of `total` independent values."""
    return z * math.sqrt(total * share * (1 - share))


def relative_half(low: float, high: float, centre: float) -> float:
    """Half an interval's width as a share of its centre (inf where either end is not finite)."""
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(centre)) or centre <= 0:
        return math.inf
    return (high - low) / 2 / centre


def percentile_half(values: Sequence[float], share: float, *, rejected: int = 0) -> float:
    """Half the 95% interval of the `share` percentile, as a share of the percentile (inf where unbounded),
    the values taken as independent."""
    return relative_half(*quantile_interval(values, share, rejected=rejected),
                         percentile(values, share, rejected=rejected))


def sectioned_half(sections: Sequence[tuple[Sequence[float], int]], share: float) -> float:
    """Half the 95% interval of the `share` percentile of the sections' values pooled, as a share of it (inf
    where unbounded). Each section is (its values, its rejected requests), in order of time: a load's
    windows. Latencies come in bursts (a stall, a queue that builds and drains), so the values are not
    independent and the binomial interval is too narrow: the rank's spread is taken from how the count
    beyond the percentile varies between sections (batch means: t(0.975, k-1) x the standard deviation of
    that count over k sections), and never below the binomial spread."""
    sections = [(values, rejected) for values, rejected in sections if values or rejected]
    pooled = [value for values, _ in sections for value in values]
    rejected = sum(r for _, r in sections)
    total = len(pooled) + rejected
    found = percentile(pooled, share, rejected=rejected)
    if total == 0 or not math.isfinite(found):
        return math.inf
    spread = _binomial_spread(total, share)
    if len(sections) >= 2:
        count = len(sections)
        beyond = [sum(1 for v in values if v > found) + r for values, r in sections]
        sizes = [len(values) + r for values, r in sections]
        rate = sum(beyond) / total
        variance = count / (count - 1) * sum((b - rate * n) ** 2 for b, n in zip(beyond, sizes))
        spread = max(spread, t975(count - 1) * math.sqrt(variance))
    return relative_half(*quantile_interval(pooled, share, rejected=rejected, rank_spread=spread), found)


@dataclass(frozen=True)
class Window:
    """What one measurement window saw: requests completed in it, their latencies, and the rejected."""

    completed: int
    mean_latency_s: float
    throughput_per_s: float
    offered: int = 0  # open loop: requests that arrived in the window (0: closed loop)

    @property
    def pace(self) -> float:
        """What stability compares: the throughput in a closed loop; in an open loop the share of the
        window's arrivals it completed, which holds still while the server keeps up, whatever the Poisson
        count of arrivals, and falls as a backlog grows."""
        if self.offered:
            return self.completed / self.offered
        return self.throughput_per_s


def window_of(latencies_s: Sequence[float], length_s: float, *, offered: int = 0) -> Window:
    mean = sum(latencies_s) / len(latencies_s) if latencies_s else math.inf
    return Window(completed=len(latencies_s), mean_latency_s=mean, throughput_per_s=len(latencies_s) / length_s,
                  offered=offered)


def stable(windows: Sequence[Window], *, count: int = STABLE_WINDOWS, within: float = STABILITY) -> bool:
    """perf_analyzer's rule: the last `count` windows each within `within` of their mean, on throughput
    (its pace, see Window.pace) and on mean latency, and none empty."""
    if len(windows) < count:
        return False
    last = windows[-count:]
    for values in ([w.pace for w in last], [w.mean_latency_s for w in last]):
        mean = sum(values) / count
        if not all(math.isfinite(v) for v in values) or mean <= 0:
            return False
        if any(abs(v - mean) > within * mean for v in values):
            return False
    return True


def spread_of(windows: Sequence[Window]) -> float:
    """How far the windows' pace or mean latency strays from its mean (the largest share); inf when a
    window saw nothing."""
    worst = 0.0
    for values in ([w.pace for w in windows], [w.mean_latency_s for w in windows]):
        mean = sum(values) / len(values) if values else 0.0
        if not values or not math.isfinite(mean) or mean <= 0:
            return math.inf
        worst = max(worst, *(abs(v - mean) / mean for v in values))
    return worst
