"""The race: which points of a sweep still deserve a repeat. Pure.

Every point is measured once; after that, before each further repeat, the points are ranked on what they
measured so far, and a point leaves the race once a 95% test separates it from the best one
(sweeping/ranking.py's tie test: round by round where the rounds allow, else against the spread of a repeat
pooled over every point; nothing is judged before the points have repeats enough to pool, since one repeat's
steps vary less than repeats do) and it is not on the Pareto front of throughput against peak memory (a point
cheaper in memory is measured until known, not dropped for being slower alone). The best one stops once
no point is tied with it and it has the repeats an interval of its own needs (MIN_REPEATS). What is left
stops as any point does (known, the time cap, the most repeats), or when the sweep's time budget is spent.
With global batches held fixed, each global batch races on its own (another global batch is another recipe).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mbtune.sweeping.ranking import pooled_repeat_spread, rank_results, throughput_difference, tied_with_best
from mbtune.sweeping.records import PointResult
from mbtune.sweeping.stopping import DECIDED, DROPPED, MIN_REPEATS


@dataclass(frozen=True)
class Verdict:
    """Why a point leaves the race now (stopped: DROPPED or DECIDED, detail: the figures), or stays (empty)."""

    stopped: str = ""
    detail: str = ""


STAYS = Verdict()


def race_verdict(index: int, results: Sequence[PointResult], *, fixed_global_batch: bool) -> Verdict:
    """Whether results[index] leaves the race, judged against the best of its global batch (every global
    batch alike, where it varies) on everything measured so far."""
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
    ties = tied_with_best(rivals, ranking, "throughput")
    if here == ranking[0]:  # decided once none is tied with it, with an interval of its own worth the name
        decided = not ties and mine.num_repeats >= MIN_REPEATS
        return Verdict(DECIDED, "no other point is tied with it") if decided else STAYS
    if here in ties or here in pareto:
        return STAYS
    best = rivals[ranking[0]]
    found = throughput_difference(best, mine, pooled_repeat_spread(rivals))
    if found is None or found[0] - found[1] <= 0:  # separated, but not as the slower one: it stays
        return STAYS
    assert best.samples_per_s, "a ranked point has a throughput"
    below = 1 - mine.samples_per_s / best.samples_per_s
    # Worded for the moment it was taken: the sweep's last word on ties (SweepReport.ties) may differ, with the
    # best measured further since.
    repeats = f"{mine.num_repeats} repeat" + ("s" if mine.num_repeats != 1 else "")
    return Verdict(DROPPED, f"after {repeats}, {below:.0%} below the best then, p < 0.05")
