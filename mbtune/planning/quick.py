"""The quick sweep strategy: run a few calibration points, let the simulator rank the rest, run the most
promising and their neighbours, stop when no predicted gain is left. Pure: points run through an injected
callable and predictions come from an injected predictor, so tests pin it on synthetic landscapes and the
sweep runs it on real pipelines.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence

from mbtune.pipeline.point import SweepPoint
from mbtune.planning.records import BlockFacts, QuickResult, QuickRound
from mbtune.sweeping.records import PointResult
from mbtune.sweeping.screen import calibration_points

# (results measured so far, candidate points) -> predicted samples/s per candidate (None: cannot tell)
Predictor = Callable[[Sequence[PointResult], Sequence[SweepPoint]], Sequence[float | None]]


def quick_search(points: Sequence[SweepPoint], run_point: Callable[[SweepPoint], PointResult], *,
                 predict_rates: Predictor, num_calibration: int = 3, min_gain: float = 0.02,
                 max_fraction: float = 1 / 3, per_round: int = 3, min_uncertainty: float = 0.05) -> QuickResult:
    """Search the grid for the highest throughput while running few of its points.

    First max(`num_calibration`, number of schedules) points spread over the grid run, one of every schedule
    at least (the simulator extrapolates most for a schedule it has not seen: another split, split backward
    costs), within half the budget. Each round then predicts every unrun point and runs at most `per_round`
    points: the best predicted, and the best-predicted unrun neighbours (same schedule, one step away in
    micro-batches, micro-batch size or accumulation) of it and of the best point measured so far.

    How wrong the predictions can be is measured, not assumed: on points predicted before they ran, and on
    each point already run when predicted from the others (at least `min_uncertainty`). The search stops when
    no unrun point, allowing that error, could beat the best measured by more than `min_gain`, or when
    `max_fraction` of the grid has run.
    """
    grid = list(dict.fromkeys(points))
    budget = max(1, min(len(grid), int(max_fraction * len(grid) + 1e-9)))
    state = _Search(run_point, budget)
    schedules = len({p.schedule for p in grid})
    state.run(calibration_points(grid, min(max(num_calibration, schedules), max(1, budget // 2))), predicted={})
    stopped = "every point ran"
    while len(state.results) < len(grid):
        if len(state.results) >= budget:
            stopped = f"ran the budget of {budget} points ({max_fraction:.0%} of the grid)"
            break
        unrun = [p for p in grid if p not in state.results]
        rates = _predict(predict_rates, list(state.results.values()), unrun)
        best = _best_rate(state.results.values())
        margin = max(min_uncertainty, state.uncertainty(), _held_out_error(predict_rates, state.results))
        hopeful = {p: r for p, r in rates.items() if best is None or r * (1 + margin) > best * (1 + min_gain)}
        if rates and not hopeful:
            top = max(rates.values())
            stopped = (f"no unrun point can beat the best measured by more than {min_gain:.0%}, allowing the "
                       f"predictions' error of {margin:.0%} (best predicted {top:,.1f} samples/s, "
                       f"measured {best:,.1f})")
            break
        batch = _pick(hopeful, state, per_round) if hopeful else calibration_points(unrun, 1)
        state.run(batch, predicted=rates)
    ran = list(state.results.values())
    unrun = [p for p in grid if p not in state.results]
    rates = _predict(predict_rates, ran, unrun) if unrun else {}
    return QuickResult(results=tuple(ran), num_grid_points=len(grid), fraction_run=len(ran) / max(1, len(grid)),
                       best=_best_index(ran), rounds=tuple(state.rounds), stopped_because=stopped,
                       unrun=tuple(unrun), unrun_predicted_samples_per_s=tuple(rates.get(p) for p in unrun))


class _Search:
    """What the quick search has run, and how far its predictions were from what then ran."""

    def __init__(self, run_point: Callable[[SweepPoint], PointResult], budget: int) -> None:
        self.run_point = run_point
        self.budget = budget
        self.results: dict[SweepPoint, PointResult] = {}
        self.rounds: list[QuickRound] = []
        self.errors: list[float] = []

    def run(self, batch: Sequence[SweepPoint], *, predicted: dict[SweepPoint, float]) -> None:
        ran = []
        for point in batch:
            if point in self.results or len(self.results) >= self.budget:
                continue
            result = self.run_point(point)
            self.results[point] = result
            ran.append(point)
            if point in predicted and result.ok and result.samples_per_s:
                self.errors.append(abs(predicted[point] - result.samples_per_s) / result.samples_per_s)
        self.rounds.append(QuickRound(ran=tuple(ran), best_samples_per_s=_best_rate(self.results.values()),
                                      best_predicted_unrun_samples_per_s=max(predicted.values(), default=None)))

    def uncertainty(self) -> float:
        """The larger of the median and the latest error of predictions made before their point ran."""
        if not self.errors:
            return 0.0
        return max(statistics.median_high(self.errors), self.errors[-1])

    def incumbent(self) -> SweepPoint | None:
        ok = [(r.samples_per_s, p) for p, r in self.results.items() if r.ok and r.samples_per_s]
        return max(ok, key=lambda item: item[0])[1] if ok else None


def _predict(predict_rates: Predictor, results: list[PointResult], unrun: list[SweepPoint]) -> dict[SweepPoint, float]:
    try:
        predicted = list(predict_rates(results, unrun))
    except ValueError:
        return {}
    return {p: r for p, r in zip(unrun, predicted) if r is not None}


def _held_out_error(predict_rates: Predictor, results: dict[SweepPoint, PointResult]) -> float:
    """How far the predictor misses a point it has not seen: each ok point predicted from all the others;
    the upper quartile of the relative errors (0 with fewer than three ok points)."""
    ok = [(r, r.samples_per_s) for r in results.values() if r.ok and r.samples_per_s]
    if len(ok) < 3:
        return 0.0
    errors = []
    for held, rate in ok:
        others = [r for r in results.values() if r is not held]
        predicted = _predict(predict_rates, others, [held.point]).get(held.point)
        if predicted is not None:
            errors.append(abs(predicted - rate) / rate)
    errors.sort()
    return errors[(3 * len(errors)) // 4] if errors else 0.0


def _pick(hopeful: dict[SweepPoint, float], state: _Search, per_round: int) -> list[SweepPoint]:
    """The best predicted, then the best-predicted neighbours of it and of the best measured point."""
    ranked = sorted(hopeful, key=lambda p: -hopeful[p])
    chosen = [ranked[0]]
    incumbent = state.incumbent()
    around = [ranked[0]] + ([incumbent] if incumbent is not None else [])
    near = {p for centre in around for p in neighbours(centre, list(hopeful))}
    chosen += sorted(near - set(chosen), key=lambda p: -hopeful[p])
    chosen += [p for p in ranked if p not in chosen]
    return chosen[:per_round]


def neighbours(point: SweepPoint, candidates: Sequence[SweepPoint]) -> list[SweepPoint]:
    """Candidates of the same schedule, replicas and recompute one step away in exactly one of micro-batches,
    micro-batch size or accumulation steps (steps taken over the values the candidates and the point use)."""
    dims = ("num_micro_batches", "micro_batch_size", "grad_accum_steps")
    pool = [p for p in candidates if p != point and (p.schedule, p.data_parallel_size, p.recompute)
            == (point.schedule, point.data_parallel_size, point.recompute)]
    found = []
    for dim in dims:
        values = sorted({getattr(p, dim) for p in pool} | {getattr(point, dim)})
        at = values.index(getattr(point, dim))
        adjacent = {values[i] for i in (at - 1, at + 1) if 0 <= i < len(values)}
        found += [p for p in pool if getattr(p, dim) in adjacent
                  and all(getattr(p, d) == getattr(point, d) for d in dims if d != dim)]
    return found


def _best_rate(results: Iterable[PointResult]) -> float | None:
    rates = [r.samples_per_s for r in results if r.ok and r.samples_per_s]
    return max(rates, default=None)


def _best_index(results: Sequence[PointResult]) -> int | None:
    ok = [(r.samples_per_s, i) for i, r in enumerate(results) if r.ok and r.samples_per_s]
    return max(ok)[1] if ok else None


def simulator_predictor(facts: BlockFacts, *, workload: str, optimizer: str = "adamw") -> Predictor:
    """A Predictor that calibrates the cost model on the results so far and simulates each candidate."""
    from mbtune.planning.calibrate import calibrate, usable
    from mbtune.planning.planner import predict

    def predict_rates(results: Sequence[PointResult], candidates: Sequence[SweepPoint]) -> list[float | None]:
        if not usable(results):
            raise ValueError("no point ran ok yet")
        model = calibrate(results, facts, workload=workload, optimizer=optimizer)
        rates: list[float | None] = []
        for point in candidates:
            try:
                rates.append(predict(model, point).samples_per_s)
            except ValueError:
                rates.append(None)
        return rates

    return predict_rates
