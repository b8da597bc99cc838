"""The spreads qualification checks are judged against: each as half a 95% interval, a share of the figure.

A check's `spread_pct` is one of these:

- a sweep point: half the 95% interval of its samples/s (sweeping/stopping.py: over its fresh-process
  repeats, measured until that interval is a quarter of the tolerance wide or the time cap passes; over
  its measured steps when it ran once), or, for a record without one, (max - min) / median over its
  repeats; now's and the baseline's combined in quadrature, the uncertainty of their ratio;
- the ceiling and the safe batch: the probe's bracket, (first_failing - granularity - ceiling) / ceiling,
  the sizes that were neither seen to fit nor seen to fail (0 when exact or stopped at max_batch);
  the larger of now's and the baseline's;
- best throughput: the larger spread of the two points compared;
- the aggregate over k points: the points' log-ratios pooled as a meta-analysis pools studies (a
  random-effects mean, DerSimonian-Laird): each point weighted by 1 / (its own variance + the variance
  between points that their scatter shows beyond their own intervals), and the pooled value's 95%
  half-interval. Points that agree within their intervals narrow it as independent measurements do
  (k points of spread s: s / sqrt(k)); points that disagree widen it. With a point's interval unknown, the
  plain geometric mean and Student's t over the points' scatter (k >= 3).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from mbtune.intervals import Z95, t975
from mbtune.probing.records import ProbeResult
from mbtune.sweeping.records import PointResult

_AGGREGATE_MIN_POINTS = 3  # an aggregate's interval from its points' scatter alone needs this many


@dataclass(frozen=True)
class Spread:
    """A measurement's own spread as a share of its median, and what it was measured over."""

    share: float
    basis: str  # e.g. "now, over 3 repeats"


def point_spread(result: PointResult, side: str) -> Spread | None:
    """A point's uncertainty as a share of its samples/s: half its 95% interval (sweeping/stopping.py: over
    its repeats, or over its steps when it ran once); without one, its min-max range. None: unknown."""
    median = result.samples_per_s
    if not result.ok or not median:
        return None
    if result.ci_half_pct is not None:
        basis = result.ci_basis or f"{result.num_repeats} repeats"
        return Spread(share=result.ci_half_pct / 100.0, basis=f"{side}, 95% interval over {basis}")
    low, high = result.samples_per_s_min, result.samples_per_s_max
    if result.num_repeats > 1:
        basis = f"over {result.num_repeats} repeats"
    else:
        basis = f"over {len(result.step_times_s)} steps" if result.step_times_s else "over its steps"
        if (low is None or high is None) and len(result.step_times_s) >= 2:
            rates = [result.point.global_batch / s for s in result.step_times_s if s > 0]
            low, high = min(rates), max(rates)
    if low is None or high is None:
        return None
    return Spread(share=max(0.0, high - low) / median, basis=f"{side}, {basis}")


def ratio_spread(baseline: Spread | None, now: Spread | None) -> Spread | None:
    """The uncertainty of now / baseline from each side's own: in quadrature, as independent errors add;
    one side unknown counts as 0."""
    known = [s for s in (baseline, now) if s is not None]
    if not known:
        return None
    return Spread(share=math.sqrt(sum(s.share**2 for s in known)), basis="; ".join(s.basis for s in known))


def probe_spread(probe: ProbeResult, side: str) -> Spread:
    """The sizes between the largest seen to fit and the smallest seen to fail, as a share of the ceiling."""
    if probe.first_failing is None or probe.ceiling <= 0:
        return Spread(share=0.0, basis=f"{side}, stopped at the largest size asked for")
    unseen = max(0, probe.first_failing - probe.granularity - probe.ceiling)
    return Spread(share=unseen / probe.ceiling,
                  basis=f"{side}, fits at {probe.ceiling}, fails at {probe.first_failing}")


def wider(*spreads: Spread | None) -> Spread | None:
    """The widest of the known spreads."""
    known = [s for s in spreads if s is not None]
    return max(known, key=lambda s: s.share) if known else None


def pool_ratios(logs: list[float], spreads: list[Spread | None]) -> tuple[float, Spread | None]:
    """The log-ratios of k points pooled into one, and its 95% half-interval as a share.

    With every point's own interval known: a random-effects mean (DerSimonian-Laird), each point weighted
    by 1 / (its variance + the variance between points); the variance between points is what their scatter
    shows beyond their own intervals (0 when they agree within them), so points that disagree widen the
    interval and points that agree narrow it as independent measurements do. With an interval unknown:
    the plain mean, its interval from the points' scatter (Student's t, k >= 3) or unknown."""
    k = len(logs)
    if all(s is not None for s in spreads):
        variances = [max(s.share / Z95, 1e-6) ** 2 for s in spreads if s is not None]  # shares as logs
        weights = [1 / v for v in variances]
        fixed = sum(w * x for w, x in zip(weights, logs, strict=True)) / sum(weights)
        q = sum(w * (x - fixed) ** 2 for w, x in zip(weights, logs, strict=True))
        scale = sum(weights) - sum(w * w for w in weights) / sum(weights)
        between = max(0.0, (q - (k - 1)) / scale) if k > 1 and scale > 0 else 0.0
        weights = [1 / (v + between) for v in variances]
        mean = sum(w * x for w, x in zip(weights, logs, strict=True)) / sum(weights)
        half = Z95 / math.sqrt(sum(weights))
        basis = "its own interval" if k == 1 else f"{k} points' own intervals"
        basis += f", and their scatter of {math.sqrt(between):.0%} beyond them" if between > 0 else \
            ", which they agree within"
        return mean, Spread(share=half, basis=basis)
    mean = statistics.fmean(logs)
    if k < _AGGREGATE_MIN_POINTS:
        return mean, None
    half = t975(k - 1) * statistics.stdev(logs) / math.sqrt(k)
    return mean, Spread(share=half, basis=f"the scatter of {k} points (a point's own interval unknown)")


def bubble_spread(result: PointResult | None) -> Spread | None:
    if result is None or not result.bubble_measured:
        return None
    low, high = result.bubble_measured_min, result.bubble_measured_max
    if low is None or high is None:
        return None
    return Spread(share=max(0.0, high - low) / result.bubble_measured, basis=f"now, over {result.num_repeats} repeats")
