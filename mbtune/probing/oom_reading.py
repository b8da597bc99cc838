"""Where the failing trials' out-of-memory errors put the ceiling: pure, trials in, a size out.

An error that names the bytes its allocation asked for and those the budget already held says the failing
size needed at least their sum (TrialOutcome.oom_need_bytes): a lower bound of its peak, past the budget.
The line from the peak of the largest size that ran to that need meets the budget at the size the search
tries next, in one step however far below the failing size it is. Where memory grows linearly between the
two sizes, every size above that one fails too (the need is at most the real peak, so the real line is
steeper and meets the budget sooner). The reading is weak where the failure came early in the step (the
allocation that failed was small and the peak came later): readings that keep failing step twice as far
from the third failure on, as stepping down from the failures does.
"""

from __future__ import annotations

from collections.abc import Sequence

from mbtune.probing.records import TrialOutcome


def read_ceiling(trials: Sequence[TrialOutcome], *, lo: int, memory_budget_bytes: int | None) -> float | None:
    """The size where the line from `lo`'s peak to a failing size's need meets the budget, the least over
    the sizes above `lo` that failed with a need past the budget: a size from `lo` up to below the smallest
    of them. None without a budget, a peak at `lo` within it, or such a failure."""
    if not memory_budget_bytes or lo <= 0:
        return None
    peaks = [t.budget_used_bytes for t in trials if t.ok and t.batch_size == lo and t.budget_used_bytes]
    if not peaks or max(peaks) > memory_budget_bytes:
        return None
    at_lo = max(peaks)
    needs: dict[int, int] = {}
    for t in trials:
        need = t.oom_need_bytes
        if need is not None and need > memory_budget_bytes and t.batch_size > lo:
            needs[t.batch_size] = max(need, needs.get(t.batch_size, need))
    if not needs:
        return None
    return min(lo + (memory_budget_bytes - at_lo) * (size - lo) / (need - at_lo) for size, need in needs.items())


def next_reading(trials: Sequence[TrialOutcome], *, lo: int, hi: int, falls: int,
                 memory_budget_bytes: int | None) -> float | None:
    """read_ceiling's size, after `falls` failures in a row: from the third on, twice as far below `hi`
    (the smallest failing size) as the reading puts it, then four times, and so on."""
    read = read_ceiling(trials, lo=lo, memory_budget_bytes=memory_budget_bytes)
    if read is None:
        return None
    return max(float(lo), hi - (hi - read) * 2 ** max(0, falls - 2))
