"""Change points in a series of qualification runs: when did a figure step, by how much, how sure. Pure.

Found the way Apache Otava (formerly Hunter) finds them: a change-point search proposes, a significance
test disposes. The search is ruptures' PELT on the log of the figures (a step in throughput is a ratio)
with the least-squares cost and a BIC-like penalty of 2 sigma^2 log n, sigma the noise of one run taken
robustly from the median absolute difference of neighbouring runs (a step moves one difference, not the
median). Every proposed change must then hold up in Student's t-test between the runs before it and the runs
after it (up to the neighbouring changes) at p < 0.001; the weakest that does not is merged away and the
rest tested again, until all hold. A change needs MIN_RUNS runs on each side.

ruptures (numpy and scipy only) rather than Otava or MongoDB's signal-processing-algorithms: both pin an
older numpy and scipy than torch's environment carries (numpy 2.2 and scipy < 1.17; numpy 1.x), and Otava
pulls in cloud and database clients a CI gate does not need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_RUNS = 3  # runs on each side of a change
P_VALUE = 0.001  # Otava's default after its merge pass


@dataclass(frozen=True)
class Shift:
    """A step in a series: at `index` (the first value after it, from 0), the mean of the runs after it over
    the mean of those before it, less one, and the 95% half-interval of that ratio; the t-test's p."""

    index: int
    before: float
    after: float
    change: float  # after / before - 1
    half: float  # 95% half-interval of the change, as a share
    p_value: float


def change_points(values: Sequence[float], *, min_runs: int = MIN_RUNS, p_value: float = P_VALUE) -> list[Shift]:
    """The steps of `values` (oldest first) that hold at `p_value`, in order; none under 2 x min_runs
    values. Positive series are searched on their logarithm (a step is a ratio), others as they are."""
    import numpy as np
    import ruptures

    series = np.asarray(values, dtype=float)
    if len(series) < 2 * min_runs or not np.all(np.isfinite(series)):
        return []
    logs = bool(np.all(series > 0))
    x = np.log(series) if logs else series
    sigma = _noise(x)
    if sigma == 0:
        sigma = max(1e-9, 1e-6 * float(np.max(np.abs(x))))  # a constant series: any step is a change
    found = ruptures.Pelt(model="l2", min_size=min_runs, jump=1).fit(x.reshape(-1, 1))
    cuts = [int(c) for c in found.predict(pen=2 * sigma ** 2 * math.log(len(x)))][:-1]
    while cuts:
        edges = [0, *cuts, len(x)]
        tests = [_test(x, edges[i], cut, edges[i + 2]) for i, cut in enumerate(cuts)]
        weakest = max(range(len(cuts)), key=lambda i: tests[i][0])
        if tests[weakest][0] < p_value:
            return [_shift(x, cut, (edges[i], edges[i + 2]), logs) for i, cut in enumerate(cuts)]
        del cuts[weakest]
    return []


def _noise(x: object) -> float:
    """The spread of one value, from the median absolute deviation of neighbouring differences."""
    import numpy as np

    diffs = np.diff(np.asarray(x))
    mad = float(np.median(np.abs(diffs - np.median(diffs))))
    return 1.4826 * mad / math.sqrt(2)


def _test(x: object, start: int, cut: int, end: int) -> tuple[float, float, float]:
    """(p, difference of means after - before, its 95% half-interval) of Student's t-test between x[start:cut]
    and x[cut:end]. Two constant sides that differ are told apart at once (p 0)."""
    import numpy as np
    from scipy import stats

    a, b = np.asarray(x)[start:cut], np.asarray(x)[cut:end]
    diff = float(np.mean(b) - np.mean(a))
    if np.var(a) == 0 and np.var(b) == 0:
        return (0.0 if diff != 0 else 1.0), diff, 0.0
    result = stats.ttest_ind(b, a)
    low, high = result.confidence_interval(0.95)
    return float(result.pvalue), diff, float(high - low) / 2


def _shift(x: object, cut: int, bounds: tuple[int, int], logs: bool) -> Shift:
    import numpy as np

    start, end = bounds
    p, diff, half = _test(x, start, cut, end)
    before, after = float(np.mean(np.asarray(x)[start:cut])), float(np.mean(np.asarray(x)[cut:end]))
    if logs:
        return Shift(index=cut, before=math.exp(before), after=math.exp(after), change=math.expm1(diff),
                     half=math.exp(diff) * math.expm1(half), p_value=p)
    return Shift(index=cut, before=before, after=after, change=diff / before if before else math.inf,
                 half=half / abs(before) if before else math.inf, p_value=p)
