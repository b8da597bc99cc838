"""Predict, then measure the contenders: which points of a raced grid are measured first, how far the
simulator's predictions miss (each measured point predicted from the others), and which points the prediction
leaves out of the race. Pure: predictions come from an injected predictor (planning/api.grid_predictor).

A point is left out when even its prediction raised by the stated error falls short of the best measured
throughput of its global batch less the equivalence size (it could be neither better than the best nor equal
to it), and it is not on the Pareto front of throughput against peak memory (measured figures where measured,
predicted elsewhere): a point cheaper in memory is measured, not judged on a prediction alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.theory import SCHEDULES
from mbtune.sweeping.records import PointResult, PredictedPoint

# (results measured so far, points) -> per point (predicted samples/s, predicted peak memory bytes of the busiest
# rank), None where it cannot tell; raises ValueError where nothing measured can calibrate it yet.
Predictor = Callable[[Sequence[PointResult], Sequence[SweepPoint]], Sequence[tuple[float, float | None] | None]]

MIN_SCREENED_GRID = 12  # a grid smaller than this is measured whole: its first points would be most of it
MIN_HELD_OUT = 4  # measured points the stated error needs (each predicted from the others)
MIN_ERROR = 0.10  # the stated error is never below this: a single repeat moves 5-10% (sd) on a shared two-core VM
SPLIT_BACKWARD = tuple(name for name, info in SCHEDULES.items() if info.splits_backward)


def first_points(points: Sequence[SweepPoint]) -> list[SweepPoint]:
    """The points a screened grid measures before it predicts: picked one at a time, each covering the most
    settings not yet measured (schedule, micro-batch size, micro-batches, accumulation steps, replicas,
    recompute), until every setting the grid uses is measured once (the rest is then predicted between
    measured sizes, not beyond them), and at least two more than the grid's schedules (the calibration
    over-determined) and MIN_HELD_OUT; at most half the grid."""
    def settings(point: SweepPoint) -> set[tuple[str, object]]:
        return {("schedule", point.schedule), ("mbs", point.micro_batch_size), ("m", point.num_micro_batches),
                ("accum", point.grad_accum_steps), ("dp", point.data_parallel_size), ("rc", point.recompute)}

    grid = list(dict.fromkeys(points))
    wanted = set().union(*map(settings, grid)) if grid else set()
    least = max(MIN_HELD_OUT, len({p.schedule for p in grid}) + 2)
    chosen: list[SweepPoint] = []
    covered: set[tuple[str, object]] = set()
    while len(chosen) < len(grid) // 2 and (covered != wanted or len(chosen) < least):
        pick = max((p for p in grid if p not in chosen), key=lambda p: len(settings(p) - covered))
        chosen.append(pick)
        covered |= settings(pick)
    return chosen


def held_out_error(predict: Predictor, results: Sequence[PointResult]) -> float | None:
    """The prediction's stated error: its largest relative miss when each ok point is predicted from all the
    others; None under MIN_HELD_OUT ok points, where one cannot be predicted, or where one was measured while
    other processes loaded the machine (a load slows points unevenly: a calibration on such figures states
    nothing about the quiet machine). Where it is None, nothing is left out."""
    ok = [r for r in results if r.ok and r.samples_per_s]
    if len(ok) < MIN_HELD_OUT or any(r.load is not None and r.load.busy for r in ok):
        return None
    errors = []
    for held in ok:
        try:
            found = predict([r for r in results if r is not held], [held.point])[0]
        except ValueError:
            return None
        if found is None or held.samples_per_s is None:
            return None
        errors.append(abs(found[0] - held.samples_per_s) / held.samples_per_s)
    return max(errors)


def left_out(points: Sequence[SweepPoint], results: Sequence[PointResult], predict: Predictor, *, size: float,
             fixed_global_batch: bool) -> tuple[float | None, tuple[PredictedPoint, ...]]:
    """(the prediction's stated error, the points of `points` not measured yet that the prediction leaves out
    of the race, with their predicted figures and why); (None, ()) where the prediction states no error."""
    error = held_out_error(predict, results)
    measured = {r.point for r in results}
    waiting = [p for p in points if p not in measured]
    if error is None or not waiting:
        return error, ()
    error = max(error, MIN_ERROR)
    try:
        predicted = dict(zip(waiting, predict(results, waiting)))
    except ValueError:
        return None, ()
    figures: dict[SweepPoint, tuple[float | None, float | None]] = {
        r.point: (r.samples_per_s, r.max_peak_memory_bytes) for r in results if r.ok and r.samples_per_s}
    figures |= {p: found for p, found in predicted.items() if found is not None}
    front = _pareto(figures)

    def group(point: SweepPoint) -> int | None:
        return point.global_batch if fixed_global_batch else None

    best: dict[int | None, float] = {}
    for r in results:
        if r.ok and r.samples_per_s:
            best[group(r.point)] = max(best.get(group(r.point), 0.0), r.samples_per_s)
    out = []
    for point, found in predicted.items():
        bar = best.get(group(point))
        if found is None or bar is None or point in front or found[0] * (1 + error) >= bar * (1 - size):
            continue
        rate, memory = found
        out.append(PredictedPoint(
            point=point, samples_per_s=rate, peak_memory_bytes=None if memory is None else int(memory), error=error,
            reason=f"{1 - rate / bar:.0%} below the best measured; with its error ({error:.0%}) it could "
                   f"be neither better nor within {size:.0%}, and it is not on the throughput-memory front"))
    return error, tuple(out)


def _pareto(figures: dict[SweepPoint, tuple[float | None, float | None]]) -> set[SweepPoint]:
    """The points no other beats on throughput without using more memory (unknown memory: never on it)."""
    known = {p: (rate, memory) for p, (rate, memory) in figures.items() if rate is not None and memory is not None}
    return {p for p, (rate, memory) in known.items() if not any(
        r >= rate and m <= memory and (r > rate or m < memory) for q, (r, m) in known.items() if q != p)}


def calibration_points(points: Sequence[SweepPoint], count: int) -> list[SweepPoint]:
    """`count` points spread over the grid: the j-th takes the j-th of `count` evenly spaced values of the
    micro-batch size, a shifted spacing of micro-batches, accumulation and replicas, and the schedules in
    turn, so the first fit sees several sizes, depths, replica counts and schedules; with fewer points than schedules, a split-backward
    schedule (zero-bubble, zb-h1, zbv, dualpipev) is among them where the grid has one, so its input and weight parts get
    measured."""
    if count <= 0 or not points:
        return []
    schedules = list(dict.fromkeys(p.schedule for p in points))
    split = [s for s in schedules if s in SPLIT_BACKWARD]
    if split and not any(s in SPLIT_BACKWARD for s in schedules[:count]):
        schedules = schedules[:count - 1] + split[:1]
    dims = ("micro_batch_size", "num_micro_batches", "grad_accum_steps", "data_parallel_size")
    values = {d: sorted({getattr(p, d) for p in points}) for d in dims}
    chosen: list[SweepPoint] = []
    for j in range(count):
        target = {d: _spread(values[d], (j + shift) % count, count) for shift, d in enumerate(dims)}
        wanted = schedules[j % len(schedules)]
        remaining = [p for p in points if p not in chosen]
        if not remaining:
            break
        chosen.append(min(remaining, key=lambda p: (p.schedule != wanted, sum(
            abs(values[d].index(getattr(p, d)) - values[d].index(target[d])) for d in dims))))
    return chosen


def _spread(values: list[int], j: int, count: int) -> int:
    """The j-th of `count` evenly spaced picks from sorted values, largest first."""
    if count == 1:
        return values[-1]
    return values[::-1][round(j * (len(values) - 1) / (count - 1))]


