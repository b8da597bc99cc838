"""The quick sweep strategy on synthetic landscapes: fake points, fake predictors, exact answers."""

from __future__ import annotations

import math

import pytest

from mbtune.pipeline.point import SweepPoint
from mbtune.planning.quick import calibration_points, neighbours, quick_search
from mbtune.sweeping.records import PointResult

SCHEDULES = {"gpipe": 0.80, "1f1b": 0.85, "interleaved-1f1b": 1.0, "zero-bubble": 0.95}
GRID = [SweepPoint(schedule=s, num_ranks=4, num_micro_batches=m, grad_accum_steps=a, micro_batch_size=b,
                   stages_per_rank=1 if s in ("gpipe", "1f1b") else 2)
        for s in SCHEDULES for m in (4, 8, 16, 32, 64) for b in (4, 8, 16, 32) for a in (1, 2)]
MEMORY_LIMIT = 16 * 32  # samples in flight: above it the point runs out of memory


def true_rate(point: SweepPoint) -> float:
    """Bubble shrinks with m, efficiency grows with size, accumulation costs a little."""
    pipe = point.num_micro_batches / (point.num_micro_batches + 3 / point.stages_per_rank)
    size = point.micro_batch_size / (point.micro_batch_size + 6)
    return 1000 * SCHEDULES[point.schedule] * pipe * size * (1 - 0.03 * (point.grad_accum_steps - 1))


def run_point(point: SweepPoint) -> PointResult:
    if point.num_micro_batches * point.micro_batch_size > MEMORY_LIMIT:
        return PointResult(point=point, status="oom")
    rate = true_rate(point)
    return PointResult(point=point, status="ok", samples_per_s=rate, step_time_median_s=point.global_batch / rate)


def best_possible() -> float:
    return max(r.samples_per_s for r in map(run_point, GRID) if r.ok)


def wobble(point: SweepPoint) -> float:
    """A fixed pseudo-random number in [-1, 1] per point."""
    return math.sin(7.3 * point.num_micro_batches + 1.7 * point.micro_batch_size + 3.1 * point.grad_accum_steps
                    + len(point.schedule))


def noisy(bias: dict[str, float] | None = None, scale: float = 0.08):
    """Like the calibrated simulator: off by up to `scale` on every point, and by a bias per schedule until a
    point of that schedule has run (calibration then learns its costs)."""
    def predict(results, candidates):
        seen = {r.point.schedule for r in results}
        return [true_rate(p) * (1 + scale * wobble(p)) * (1.0 if p.schedule in seen else (bias or {}).get(p.schedule, 1.0))
                for p in candidates]
    return predict


class Counter:
    def __init__(self) -> None:
        self.ran: list[SweepPoint] = []

    def __call__(self, point: SweepPoint) -> PointResult:
        assert point not in self.ran, "a point ran twice"
        self.ran.append(point)
        return run_point(point)


@pytest.mark.parametrize("bias", [None, {"interleaved-1f1b": 0.7}, {"gpipe": 1.3, "interleaved-1f1b": 0.8}])
def test_finds_at_least_97_percent_of_the_best_running_at_most_a_third(bias) -> None:
    counter = Counter()
    result = quick_search(GRID, counter, predict_rates=noisy(bias))
    assert result.num_grid_points == len(GRID) == 160
    assert len(result.results) == len(counter.ran) and result.fraction_run <= 1 / 3
    assert result.fraction_run == pytest.approx(len(counter.ran) / 160)
    found = result.results[result.best].samples_per_s
    assert found >= 0.97 * best_possible(), (found, best_possible(), result.stopped_because)
    assert [r.point for r in result.results] == counter.ran
    assert len(result.unrun) == 160 - len(counter.ran) and not set(result.unrun) & set(counter.ran)
    assert len(result.unrun_predicted_samples_per_s) == len(result.unrun)
    assert all(rate is not None and rate < found * 1.1 for rate in result.unrun_predicted_samples_per_s)


def test_an_exact_predictor_stops_as_soon_as_nothing_can_beat_the_best() -> None:
    counter = Counter()

    def exact(results, candidates):
        return [true_rate(p) if run_point(p).ok else 0.0 for p in candidates]

    result = quick_search(GRID, counter, predict_rates=exact, min_uncertainty=0.0)
    assert result.results[result.best].samples_per_s == pytest.approx(best_possible())
    assert len(counter.ran) <= 3 + 3 * 2
    assert "no unrun point can beat the best measured" in result.stopped_because


def test_without_predictions_it_spreads_out_until_the_budget() -> None:
    def clueless(results, candidates):
        raise ValueError("cannot tell")

    counter = Counter()
    result = quick_search(GRID, counter, predict_rates=clueless, max_fraction=0.1)
    assert len(counter.ran) == 16
    assert "budget of 16 points" in result.stopped_because


def test_failed_points_are_kept_and_never_best() -> None:
    grid = [p for p in GRID if p.schedule == "1f1b" and p.grad_accum_steps == 1]
    result = quick_search(grid, Counter(), predict_rates=noisy(), max_fraction=1.0, min_gain=-1.0)
    assert len(result.results) == len(grid) and result.fraction_run == 1.0
    assert any(r.status == "oom" for r in result.results)
    assert result.results[result.best].ok


def test_calibration_points_spread_over_sizes_depths_and_schedules() -> None:
    chosen = calibration_points(GRID, 3)
    assert len(set(chosen)) == 3
    assert len({p.micro_batch_size for p in chosen}) == 3 and len({p.num_micro_batches for p in chosen}) == 3
    assert any(p.schedule == "zero-bubble" for p in chosen)
    assert calibration_points(GRID, 0) == [] and calibration_points([], 3) == []


def test_neighbours_are_one_step_away_in_one_dimension() -> None:
    centre = SweepPoint(schedule="1f1b", num_ranks=4, num_micro_batches=16, grad_accum_steps=1, micro_batch_size=8)
    found = {(p.num_micro_batches, p.micro_batch_size, p.grad_accum_steps) for p in neighbours(centre, GRID)}
    assert found == {(8, 8, 1), (32, 8, 1), (16, 4, 1), (16, 16, 1), (16, 8, 2)}
