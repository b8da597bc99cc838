"""Small pure helpers of the calibration: robust statistics and cost lines fitted over micro-batch sizes."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

from mbtune.planning.records import LinearCost

TRIM_FRACTION = 0.1  # share of samples dropped at each end before averaging
SPREAD_QUANTILES = 41  # how finely a Spread keeps a distribution


def trimmed_mean(values: Sequence[float], trim: float = TRIM_FRACTION) -> float:
    """The mean after dropping `trim` of the samples at each end: it follows sums (a step is a sum of
    actions) like a mean, but one action slowed by a neighbour on a shared machine does not move it much."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    cut = int(len(ordered) * trim)
    kept = ordered[cut:len(ordered) - cut] or ordered
    return statistics.fmean(kept)


def fit_line(by_size: Mapping[int, float], *, proportional_when_single: bool = True) -> LinearCost:
    """seconds = fixed + per_sample x size, least squares over the measured sizes (the line, for sizes beyond
    them), with the measured seconds kept for the sizes between them (LinearCost.at).

    With one size the two terms cannot be told apart: the cost is taken as proportional to the size
    (compute), or as a fixed latency when `proportional_when_single` is False (hand-overs of small tensors).
    A negative term from noise is dropped and the other refitted.
    """
    if not by_size:
        return LinearCost()
    sizes = sorted(by_size)
    if len(sizes) == 1:
        size, value = sizes[0], by_size[sizes[0]]
        return LinearCost(per_sample_s=value / size) if proportional_when_single else LinearCost(fixed_s=value)
    xs = [float(s) for s in sizes]
    ys = [by_size[s] for s in sizes]
    measured = tuple((size, by_size[size]) for size in sizes)
    slope, fixed = statistics.linear_regression(xs, ys)
    if slope < 0:
        return LinearCost(fixed_s=max(0.0, statistics.fmean(ys)), measured=measured)
    if fixed < 0:
        return LinearCost(per_sample_s=statistics.linear_regression(xs, ys, proportional=True).slope, measured=measured)
    return LinearCost(fixed_s=fixed, per_sample_s=slope, measured=measured)


def fit_samples(samples: Mapping[int, list[float]], *, proportional_when_single: bool = True) -> LinearCost:
    """fit_line over the trimmed mean of each size's samples."""
    return fit_line({size: trimmed_mean(values) for size, values in samples.items() if values},
                    proportional_when_single=proportional_when_single)


def median_or(values: Iterable[float], default: float = 0.0) -> float:
    """The median, or `default` without values."""
    values = list(values)
    return statistics.median(values) if values else default


def quantiles(values: Sequence[float], count: int = SPREAD_QUANTILES) -> tuple[float, ...]:
    """`count` evenly spaced quantiles, at (i + 0.5) / count: drawing one of them uniformly samples the
    distribution, with its extreme tails (below and above half a step) left out. Empty without values."""
    if not values:
        return ()
    ordered = sorted(values)
    last = len(ordered) - 1
    return tuple(ordered[min(last, int((i + 0.5) / count * len(ordered)))] for i in range(count))
