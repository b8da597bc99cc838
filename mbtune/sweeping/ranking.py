"""The sweep's results ranked: by the objective, which rows a 95% test cannot tell from the best (round by
round where both were measured round-robin), the recompute pairs, the throughput-memory trade-off, and why
nothing was measured. Pure."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from mbtune.intervals import t975
from mbtune.sweeping.records import PointResult, SweepReport


def nothing_measured(report: SweepReport) -> str | None:
    """Why a sweep that was not interrupted produced no usable result (no point ran), or None when one did:
    the first failed point's cause, else why the first point was skipped, else that the grid was empty."""
    if report.interrupted or any(r.ok for r in report.results):
        return None
    if report.results:
        first = report.results[0]
        cause = (first.error.strip().splitlines() or [first.status])[-1]
        return f"no sweep point completed: {len(report.results)} failed, the first ({first.point.label}) {first.status}: {cause}"
    if report.skipped:
        skipped = report.skipped[0]
        return (f"no sweep point could run: all {len(report.skipped)} were skipped, the first "
                f"({skipped.point.label}) because {skipped.reason}")
    return "no sweep point could run: the grid is empty"


def tied_with_best(results: Sequence[PointResult], ranking: Sequence[int], objective: str, *,
                   same_global_batch: bool = False) -> tuple[int, ...]:
    """Ranked points that, on this evidence, could be as good as the best one: a 95% test of their difference
    does not tell them apart (throughput_difference). Bubble compares its ranges; memory is ranked exactly.
    With global batches held fixed, only rows of the best one's global batch can tie with it (another
    global batch is another recipe)."""
    if not ranking or objective == "memory":
        return ()
    best = results[ranking[0]]
    if _span(best, objective) is None:
        return ()
    size = best.point.global_batch
    pooled = pooled_repeat_spread(results) if objective == "throughput" else None
    return tuple(i for i in ranking[1:] if (not same_global_batch or results[i].point.global_batch == size)
                 and _tied(best, results[i], objective, pooled))


def _span(result: PointResult, objective: str) -> tuple[float, float] | None:
    if objective == "throughput" and (ci := result.samples_per_s_ci) is not None:
        return ci
    if objective == "throughput":
        low, high, mid = result.samples_per_s_min, result.samples_per_s_max, result.samples_per_s
    else:
        low, high, mid = result.bubble_measured_min, result.bubble_measured_max, result.bubble_measured
    return None if mid is None else (mid if low is None else low, mid if high is None else high)


def _tied(best: PointResult, other: PointResult, objective: str, pooled: tuple[float, int] | None) -> bool:
    if objective == "throughput":
        found = throughput_difference(best, other, pooled)
        if found is not None:
            return not found.separated
        if best.ci_half_pct is not None and other.ci_half_pct is not None and best.samples_per_s \
                and other.samples_per_s:
            bound = math.hypot(best.samples_per_s * best.ci_half_pct, other.samples_per_s * other.ci_half_pct) / 100
            return abs(best.samples_per_s - other.samples_per_s) <= bound
    mine, theirs = _span(best, objective), _span(other, objective)
    return mine is not None and theirs is not None and theirs[0] <= mine[1] and mine[0] <= theirs[1]


@dataclass(frozen=True)
class Difference:
    """The log ratio of one point's throughput over another's: its mean, its standard error and the degrees of
    freedom of that error (Student's t)."""

    mean: float
    se: float
    dof: int

    @property
    def half(self) -> float:
        """Half the 95% two-sided interval of the mean."""
        return t975(self.dof) * self.se

    @property
    def separated(self) -> bool:
        """Whether a 95% test tells the two apart (the interval excludes no difference)."""
        return abs(self.mean) > self.half


def throughput_difference(a: PointResult, b: PointResult,
                          pooled: tuple[float, int] | None) -> Difference | None:
    """The log ratio of a's throughput over b's: round by round where both were measured round-robin in
    MIN_PAIRED_ROUNDS shared rounds or more (the machine's drift over the run cancels in each round's ratio);
    else the difference of their repeats' mean log throughputs, against the spread of one repeat pooled over
    every point (`pooled`: pooled_repeat_spread's), so that a point measured once or twice is compared as
    soundly as the machine's noise allows; None where neither can be had."""
    paired = paired_difference(a, b)
    if paired is not None or pooled is None:
        return paired
    mine, theirs = _log_rates(a), _log_rates(b)
    if not mine or not theirs:
        return None
    spread, dof = pooled
    return Difference(statistics.fmean(mine) - statistics.fmean(theirs),
                      spread * math.sqrt(1 / len(mine) + 1 / len(theirs)), dof)


# Degrees of freedom a pooled spread needs before it compares points (t(0.975, 5) = 2.57).
MIN_POOLED_DOF = 5


def pooled_repeat_spread(results: Sequence[PointResult]) -> tuple[float, int] | None:
    """The standard deviation of one repeat's log throughput, pooled over every ok point with two or more
    repeats (the points run on one machine, whose noise they share), and its degrees of freedom (the repeats
    less one per point); None under MIN_POOLED_DOF."""
    squares, dof = 0.0, 0
    for result in results:
        logs = _log_rates(result) if result.ok else []
        if len(logs) >= 2:
            mean = statistics.fmean(logs)
            squares += sum((x - mean) ** 2 for x in logs)
            dof += len(logs) - 1
    return (math.sqrt(squares / dof), dof) if dof >= MIN_POOLED_DOF else None


def _log_rates(result: PointResult) -> list[float]:
    """Each repeat's log throughput (global batch over its median step)."""
    return [math.log(result.point.global_batch / m) for m in result.repeat_step_time_medians_s if m > 0]


# Rounds two points must share to be compared round by round. At three, the demo's best was judged faster
# than a row (9%, consistent over its three rounds) that was best in the next three fresh runs: a point's
# repeats within one run share more than one round's drift, and three rounds cannot show it.
MIN_PAIRED_ROUNDS = 5


def paired_difference(a: PointResult, b: PointResult) -> Difference | None:
    """The mean log ratio of a's throughput over b's, round by round over the rounds both measured, and its
    standard error; None under MIN_PAIRED_ROUNDS shared rounds."""
    mine = dict(zip(a.repeat_rounds, a.repeat_step_time_medians_s, strict=False))
    theirs = dict(zip(b.repeat_rounds, b.repeat_step_time_medians_s, strict=False))
    shared = sorted(set(mine) & set(theirs))
    if len(shared) < MIN_PAIRED_ROUNDS:
        return None
    # Throughput is the global batch over the step time.
    ratios = [math.log(a.point.global_batch / mine[k]) - math.log(b.point.global_batch / theirs[k]) for k in shared]
    return Difference(statistics.fmean(ratios), statistics.stdev(ratios) / math.sqrt(len(ratios)), len(ratios) - 1)


def rank_results(results: Sequence[PointResult], objective: str,
                 global_batches: Sequence[int] = ()) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ranking best first, Pareto front of throughput against peak memory), as indices of ok results.
    With global batches held fixed, rows are ranked within each, in the order given: the first one's best
    leads (comparing samples/s across global batches compares different training recipes)."""
    rate = {i: r.samples_per_s for i, r in enumerate(results) if r.ok and r.samples_per_s is not None}
    ok = list(rate)
    group = {g: n for n, g in enumerate(global_batches)}

    def memory(i: int) -> float:
        peak = results[i].max_peak_memory_bytes
        return float("inf") if peak is None else peak

    keys = {
        "throughput": lambda i: (-rate[i], memory(i)),
        "memory": lambda i: (memory(i), -rate[i]),
        "bubble": lambda i: (results[i].bubble_measured if results[i].bubble_measured is not None else 1.0,
                             -rate[i]),
    }
    ranking = tuple(sorted(ok, key=lambda i: (group.get(results[i].point.global_batch, len(group)),
                                              keys[objective](i))))
    pareto = tuple(i for i in ok if not any(
        rate[j] >= rate[i] and memory(j) <= memory(i) and (rate[j] > rate[i] or memory(j) < memory(i))
        for j in ok))
    return ranking, pareto


def recompute_pairs(results: Sequence[PointResult]) -> tuple[tuple[int, int], ...]:
    """(without, with full recompute): the indices of ok results whose points differ only in recompute."""
    plain = {replace(r.point, recompute="none"): i for i, r in enumerate(results) if r.ok and r.point.recompute == "none"}
    return tuple((plain[key], i) for i, r in enumerate(results)
                 if r.ok and r.point.recompute == "full" and (key := replace(r.point, recompute="none")) in plain)


def tradeoff(results: Sequence[PointResult], ranking: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, int] | None]:
    """The rows that show the best row's trade-off, and a cross-batch padding pair.

    Rows: the best, and the best-ranked rows of the same schedule, global batch, replicas and recompute
    (the trade-off is the micro-batch's alone) at the next smaller and
    the next larger micro-batch size (bigger micro-batches compute a sample faster, more of them leave a
    smaller bubble). Pair: (best, a row of the same schedule, global batch and micro-batch size with fewer
    micro-batches and more accumulation steps) where the best has more micro-batches: one pipeline step of
    more micro-batches fills the drain that the next accumulation step's would have left idle."""
    if not ranking:
        return (), None
    best = results[ranking[0]].point
    kin = [i for i in ranking if (results[i].point.schedule, results[i].point.global_batch,
                                  results[i].point.data_parallel_size, results[i].point.recompute)
           == (best.schedule, best.global_batch, best.data_parallel_size, best.recompute)]
    smaller = [i for i in kin if results[i].point.micro_batch_size < best.micro_batch_size]
    larger = [i for i in kin if results[i].point.micro_batch_size > best.micro_batch_size]
    nearest_smaller = max(smaller, key=lambda i: results[i].point.micro_batch_size, default=None)
    nearest_larger = min(larger, key=lambda i: results[i].point.micro_batch_size, default=None)
    rows = tuple(sorted({ranking[0], *(i for i in (nearest_smaller, nearest_larger) if i is not None)},
                        key=lambda i: results[i].point.micro_batch_size))
    padded = [i for i in kin if results[i].point.micro_batch_size == best.micro_batch_size
              and results[i].point.num_micro_batches < best.num_micro_batches
              and results[i].point.grad_accum_steps > best.grad_accum_steps]
    return rows, ((ranking[0], padded[0]) if padded else None)
