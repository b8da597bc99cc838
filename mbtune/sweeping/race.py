"""The race: which points of a sweep still deserve a repeat. Pure.

Every point in the race is measured once (the contenders, where the simulator's prediction left the rest out:
sweeping/screen.py); after that, before each further repeat, the points are ranked on what they measured so
far, and a point leaves the race once a 95% test separates it from the best one (sweeping/ranking.py's test:
round by round where the rounds allow, else against the spread of a repeat pooled over every point; nothing
is judged before the points have repeats enough to pool, since one repeat's steps vary less than repeats do)
and it is not on the Pareto front of throughput against peak memory (a point cheaper in memory is measured
until known, not dropped for being slower alone), or once a 95% equivalence test shows it within the declared
size of the best (sweeping/equivalence.py: equal is an answer). The best stops once every other point is
told apart from it or shown equal to it, and it has the repeats an interval of its own needs (MIN_REPEATS).
What is left stops as any point does (known, the most repeats), or when the sweep's time budget is spent.
With global batches held fixed, each global batch races on its own (another global batch is another recipe).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mbtune.sweeping.equivalence import APART, EQUAL, NOT_DECIDED, decide, standing
from mbtune.sweeping.ranking import pooled_repeat_spread, rank_results, throughput_difference
from mbtune.sweeping.records import PointResult
from mbtune.sweeping.stopping import DECIDED, DROPPED, EQUIVALENT, MIN_REPEATS


@dataclass(frozen=True)
class Verdict:
    """Why a point leaves the race now (stopped: DROPPED or DECIDED, detail: the figures), or stays (empty)."""

    stopped: str = ""
    detail: str = ""


STAYS = Verdict()


def race_verdict(index: int, results: Sequence[PointResult], *, fixed_global_batch: bool, size: float) -> Verdict:
    """Whether results[index] leaves the race, judged against the best of its global batch (every global
    batch alike, where it varies) on everything measured so far; `size`: the declared equivalence size."""
    mine = results[index]
    if not mine.ok or mine.samples_per_s is None:
        return STAYS
    group = [i for i, r in enumerate(results)
             if not fixed_global_batch or r.point.global_batch == mine.point.global_batch]
    rivals = [results[i] for i in group]
    # Judged on the spread of repeats alone (one repeat's steps vary less than repeats do): not before the points
    # have repeats enough to pool.
    if pooled_repeat_spread(rivals) is None:
        return STAYS
    ranking, pareto = rank_results(rivals, "throughput")
    if not ranking:
        return STAYS
    here = group.index(index)
    repeats = f"{mine.num_repeats} repeat" + ("s" if mine.num_repeats != 1 else "")
    within = f"{size * 100:g}%"
    if here == ranking[0]:  # decided once every other is told apart or shown equal, with an interval of its own
        decision = decide(rivals, ranking, size)
        if decision is None or decision.state == NOT_DECIDED or mine.num_repeats < MIN_REPEATS:
            return STAYS
        equal = f"; {len(decision.group)} shown within {within} of it" if decision.group else ""
        return Verdict(DECIDED, f"every other point told apart from it{equal}")
    best = rivals[ranking[0]]
    found = throughput_difference(best, mine, pooled_repeat_spread(rivals))
    where = standing(found, size)
    assert best.samples_per_s, "a ranked point has a throughput"
    below = 1 - mine.samples_per_s / best.samples_per_s
    # Worded for the moment it was taken: the sweep's decision (SweepReport.decision) is taken again on
    # everything measured.
    if where == EQUAL:
        return Verdict(EQUIVALENT, f"after {repeats}, {below:+.1%} against the best then, within {within} (p < 0.05)")
    if where != APART or here in pareto or found is None or found.mean - found.half <= 0:
        return STAYS  # open, cheaper in memory, or separated but not as the slower one
    return Verdict(DROPPED, f"after {repeats}, {below:.0%} below the best then, p < 0.05")
