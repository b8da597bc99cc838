"""Equal within a declared size: each row's standing against the best (told apart by a 95% test, shown equal
within the size by a 95% equivalence test, or still open), how many more repeats would settle an open row,
and the sweep's decision from them: `decided`, `equivalent` or `not decided`. Pure.

The equivalence test is the two one-sided tests (TOST, Schuirmann 1987): the log ratio of the two throughputs
is shown to lie within +-log(1 + size) when each one-sided 5% test rejects the difference lying beyond its
bound, i.e. when the 90% interval of the log ratio lies inside the bounds. A difference of 1% is never told
apart however long it is measured; it is shown equal to a declared 3% once the interval is narrow enough.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mbtune.intervals import t95, t975
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.theory import SCHEDULE_NAMES
from mbtune.sweeping.ranking import Difference, pooled_repeat_spread, throughput_difference
from mbtune.sweeping.records import Decision, PointResult

DEFAULT_EQUIVALENCE = 0.03  # the smallest difference in throughput worth a user's attention
DECIDED, EQUIVALENT, NOT_DECIDED = "decided", "equivalent", "not decided"
APART, EQUAL, OPEN = "apart", "equal", "open"  # a row's standing against the best


def shown_equivalent(found: Difference, size: float) -> bool:
    """Whether a 95% equivalence test (two one-sided tests at 5% each) shows the log ratio within
    +-log(1 + size): its 90% interval lies inside those bounds."""
    bound = math.log1p(size)
    half = t95(found.dof) * found.se
    return -bound < found.mean - half and found.mean + half < bound


def standing(found: Difference | None, size: float) -> str:
    """EQUAL where the equivalence test shows the two within the size (a difference too small to be worth
    attention, told apart or not), else APART where a 95% test tells them apart, OPEN otherwise (or where
    nothing compares them yet)."""
    if found is None:
        return OPEN
    if shown_equivalent(found, size):
        return EQUAL
    return APART if found.separated else OPEN


def settling_factor(found: Difference, size: float) -> float | None:
    """How many times the repeats behind `found` would settle it one way or the other, were its mean to hold
    and its spread stay: the smaller of what tells it apart and what shows it equal (the quantiles taken at
    today's degrees of freedom); None where neither can (a mean exactly at the bound, with no spread)."""
    factors = []
    if found.mean != 0 and found.se > 0:
        factors.append((t975(found.dof) * found.se / abs(found.mean)) ** 2)
    room = math.log1p(size) - abs(found.mean)
    if room > 0 and found.se > 0:
        factors.append((t95(found.dof) * found.se / room) ** 2)
    return min(factors) if factors else None


def simplicity(point: SweepPoint) -> tuple[int, ...]:
    """A sort key, simplest first: the schedule in its listed order, fewer stages per rank, micro-batches,
    accumulation steps and replicas, no recompute."""
    order = SCHEDULE_NAMES.index(point.schedule) if point.schedule in SCHEDULE_NAMES else len(SCHEDULE_NAMES)
    return (order, point.stages_per_rank, point.num_micro_batches, point.grad_accum_steps, point.data_parallel_size,
            int(point.recompute != "none"))


def decide(results: Sequence[PointResult], ranking: Sequence[int], size: float, *,
           same_global_batch: bool = False, why: str = "") -> Decision | None:
    """The sweep's decision on throughput: `decided` where every other row of the best one's global batch
    (every row, where it varies) is told apart from it by more than `size`, `equivalent` where the rest are
    shown equal to it within `size` (the group ordered by peak memory, then simplicity), `not decided` where some are still
    open, with the repeats and time that would settle them at their pace so far; `why`: what stopped the
    measuring first, for a decision left open. None without a ranked row."""
    if not ranking:
        return None
    best = results[ranking[0]]
    pooled = pooled_repeat_spread(results)
    rivals = [i for i in ranking[1:]
              if not same_global_batch or results[i].point.global_batch == best.point.global_batch]
    found = {i: throughput_difference(best, results[i], pooled) for i in rivals}
    where = {i: standing(found[i], size) for i in rivals}
    group = tuple(sorted((i for i in rivals if where[i] == EQUAL),
                         key=lambda i: (results[i].max_peak_memory_bytes or 0, simplicity(results[i].point))))
    still = tuple(i for i in rivals if where[i] == OPEN)
    if not still:
        return Decision(state=EQUIVALENT if group else DECIDED, size=size, group=group)
    more, time_s = _to_settle(best, [(results[i], found[i]) for i in still], size)
    return Decision(state=NOT_DECIDED, size=size, group=group, open=still, more_repeats=more, more_time_s=time_s,
                    why=why)


def _to_settle(best: PointResult, still: Sequence[tuple[PointResult, Difference | None]],
               size: float) -> tuple[int | None, float | None]:
    """About how many more repeats each open row (and the best) needs, and the seconds those take at each
    point's pace so far; (None, None) where a row has nothing to extrapolate from."""
    extra = 0
    time_s = 0.0
    for result, found in still:
        factor = settling_factor(found, size) if found is not None else None
        if factor is None:
            return None, None
        have = min(best.num_repeats, result.num_repeats)
        need = max(1, math.ceil(have * factor) - have)
        extra = max(extra, need)
        time_s += need * result.wall_s / max(1, result.num_repeats)
    return extra, time_s + extra * best.wall_s / max(1, best.num_repeats)
