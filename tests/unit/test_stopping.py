"""Measuring until known: the t quantiles, the interval, the stopping rule, the pinning split, the steps a
repeat measures, and ties from intervals (sweeping/stopping.py, pipeline/rank_device.py, sweeping/grid.py)."""

from __future__ import annotations

import math
import statistics

import pytest

from mbtune.intervals import Z95, t95, t975
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.rank_device import own_cores
from mbtune.sweeping.measured import merge_repeats
from mbtune.sweeping.ranking import MIN_PAIRED_ROUNDS, paired_difference, tied_with_best
from mbtune.sweeping.records import PointResult
from mbtune.sweeping.repeat import MAX_STEPS, MIN_REPEAT_WINDOW_S, steps_to_fill
from mbtune.sweeping.stopping import (
    KNOWN,
    MIN_REPEATS,
    MOST_REPEATS,
    TIME_CAP,
    default_repeats,
    interval,
    should_stop,
)

POINT = SweepPoint(schedule="gpipe", num_ranks=2, num_micro_batches=2, grad_accum_steps=1, micro_batch_size=4)


def test_t_quantiles_match_the_published_table_and_approach_the_normal():
    assert t975(1) == pytest.approx(12.706, abs=5e-4) and t975(4) == pytest.approx(2.776, abs=5e-4)
    assert t975(30) == pytest.approx(2.042, abs=5e-4) and t95(10) == pytest.approx(1.812, abs=5e-4)
    from scipy import stats

    assert Z95 == pytest.approx(stats.norm.ppf(0.975), rel=1e-12)
    assert all(t975(d) == pytest.approx(stats.t.ppf(0.975, d), rel=1e-9) for d in (1, 2, 5, 30, 200))
    assert t975(60) == pytest.approx(2.000, abs=0.002) and t975(120) == pytest.approx(1.980, abs=0.002)
    assert all(t975(d) > t975(d + 1) > 1.959964 for d in range(1, 200))
    with pytest.raises(ValueError):
        t975(0)


def test_the_interval_is_students_over_the_mean():
    values = [100.0, 104.0, 98.0, 102.0]
    found = interval(values, "4 repeats")
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    assert found is not None and found.basis == "4 repeats"
    assert found.half == pytest.approx(3.182 * sd / math.sqrt(4) / mean, rel=1e-3)
    assert found.width == pytest.approx(2 * found.half)
    assert interval([100.0], "one") is None and interval([], "none") is None
    assert interval([5.0, 5.0, 5.0], "same").half == 0.0


def test_measuring_stops_once_the_interval_is_as_narrow_as_the_target():
    steady = [100.0, 100.5, 99.5]
    assert should_stop(steady, target_width=0.05, elapsed_s=3, repeat_s=1, max_time_s=60) == KNOWN
    # The same interval, asked narrower: not yet known, so one more.
    assert should_stop(steady, target_width=0.001, elapsed_s=3, repeat_s=1, max_time_s=60) is None
    # Never known before MIN_REPEATS, however close two repeats are.
    assert should_stop([100.0, 100.0], target_width=0.05, elapsed_s=2, repeat_s=1, max_time_s=60) is None
    assert MIN_REPEATS == 3


def test_the_time_cap_and_the_most_repeats_end_a_point_that_is_not_known():
    noisy = [100.0, 140.0, 80.0]
    assert should_stop(noisy, target_width=0.05, elapsed_s=9, repeat_s=3, max_time_s=10) == TIME_CAP
    assert should_stop(noisy, target_width=0.05, elapsed_s=6, repeat_s=3, max_time_s=10) is None  # ends at 9 s
    # One repeat longer than twice the cap stops after it; shorter ones go on to MIN_REPEATS past the cap.
    assert should_stop([100.0], target_width=0.05, elapsed_s=21, repeat_s=21, max_time_s=10) == TIME_CAP
    assert should_stop([100.0, 120.0], target_width=0.05, elapsed_s=8, repeat_s=4, max_time_s=10) is None
    assert should_stop(noisy, target_width=0.05, elapsed_s=12, repeat_s=4, max_time_s=10) == TIME_CAP
    assert should_stop(noisy * 4, target_width=0.01, elapsed_s=12, repeat_s=1, max_time_s=60,
                       max_repeats=12) == MOST_REPEATS


def test_the_default_repeats_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("MBTUNE_REPEATS", raising=False)
    assert default_repeats() is None
    monkeypatch.setenv("MBTUNE_REPEATS", "4")
    assert default_repeats() == 4
    for bad in ("0", "-1", "two", ""):
        monkeypatch.setenv("MBTUNE_REPEATS", bad)
        assert default_repeats() is None


def test_ranks_are_pinned_to_disjoint_equal_runs_of_the_allowed_cores():
    allowed = {0, 1, 2, 3, 4, 5, 6, 7}
    runs = [own_cores(i, 3, allowed) for i in range(3)]
    assert runs == [(0, 1), (2, 3), (4, 5)]  # the remainder (6, 7) left idle
    assert own_cores(0, 2, {3, 9}) == (3,) and own_cores(1, 2, {3, 9}) == (9,)
    assert own_cores(0, 3, {0, 1}) == ()  # fewer cores than processes: nobody is pinned
    assert own_cores(2, 2, allowed) == ()


def test_later_repeats_measure_enough_steps_to_fill_the_window():
    assert steps_to_fill([0.1, 0.1], 2) == math.ceil(2 * MIN_REPEAT_WINDOW_S / 0.2)
    assert steps_to_fill([2.0, 2.0], 2) == 2  # already long enough: never fewer than asked
    assert steps_to_fill([1e-6, 1e-6], 2) == MAX_STEPS
    assert steps_to_fill([], 3) == 3


def _result(step_s: list[float]) -> PointResult:
    median = statistics.median(step_s)
    return PointResult(point=POINT, status="ok", step_times_s=tuple(step_s), step_time_median_s=median,
                       samples_per_s=POINT.global_batch / median, repeat_step_time_medians_s=(median,))


def test_merged_repeats_carry_the_interval_over_their_rates():
    repeats = [_result([0.10, 0.11]), _result([0.12, 0.12]), _result([0.11, 0.10])]
    merged = merge_repeats(repeats)
    rates = [POINT.global_batch / r.step_time_median_s for r in repeats]
    expected = interval(rates, "3 repeats")
    assert merged.ci_half_pct == pytest.approx(100 * expected.half) and merged.ci_basis == "3 repeats"
    low, high = merged.samples_per_s_ci
    assert low < merged.samples_per_s < high
    single = merge_repeats([_result([0.10, 0.12, 0.11])])
    assert single.ci_basis == "3 steps of one run" and single.ci_half_pct > 0


def test_ties_are_the_rows_a_95_percent_test_of_the_difference_cannot_tell_from_the_best():
    def row(rate: float, half_pct: float) -> PointResult:
        return PointResult(point=POINT, status="ok", samples_per_s=rate, ci_half_pct=half_pct,
                           samples_per_s_min=rate * 0.5, samples_per_s_max=rate * 1.5)

    results = [row(100.0, 2.0), row(98.0, 2.0), row(97.0, 2.0), row(90.0, 2.0)]
    # The difference's interval is the two combined in quadrature: +-2.8 here. 98 is within it; 97 is not,
    # though its interval (95.06-98.94) overlaps the best one's (98-102); the min-max ranges would tie all.
    assert tied_with_best(results, (0, 1, 2, 3), "throughput") == (1,)
    # Without intervals, the ranges decide.
    bare = [PointResult(point=POINT, status="ok", samples_per_s=r, samples_per_s_min=r - 5, samples_per_s_max=r + 5)
            for r in (100.0, 92.0, 80.0)]
    assert tied_with_best(bare, (0, 1, 2), "throughput") == (1,)


def _rounds(rates: list[float], rounds: list[int], half_pct: float = 20.0) -> PointResult:
    medians = tuple(POINT.global_batch / r for r in rates)
    return PointResult(point=POINT, status="ok", samples_per_s=statistics.median(rates), ci_half_pct=half_pct,
                       repeat_step_time_medians_s=medians, repeat_rounds=tuple(rounds))


def test_points_measured_in_the_same_rounds_are_compared_round_by_round():
    # The machine drifts +-20% from round to round, alike for both points: each interval alone is wide and
    # they overlap, but in every round the first point is 5% faster, so they are not tied.
    drift = [1.0, 1.2, 0.8, 1.1, 0.9]
    fast, slow = _rounds([105 * d for d in drift], [1, 2, 3, 4, 5]), _rounds([100 * d for d in drift], [1, 2, 3, 4, 5])
    found = paired_difference(fast, slow)
    assert found.mean == pytest.approx(math.log(1.05)) and found.half == pytest.approx(0.0, abs=1e-9)
    assert tied_with_best([fast, slow], (0, 1), "throughput") == ()
    # The same rates, a round apart (no round in common enough): the quadrature rule ties them.
    apart = _rounds([100 * d for d in drift], [6, 7, 8, 9, 10])
    assert paired_difference(fast, apart) is None
    assert tied_with_best([fast, apart], (0, 1), "throughput") == (1,)


def test_a_round_by_round_difference_that_changes_sign_is_a_tie():
    a = _rounds([100, 104, 99, 103, 101], [1, 2, 3, 4, 5], half_pct=1.0)
    b = _rounds([102, 100, 101, 100, 102], [1, 2, 3, 4, 5], half_pct=1.0)
    found = paired_difference(a, b)
    assert not found.separated and abs(found.mean) <= found.half
    assert tied_with_best([a, b], (0, 1), "throughput") == (1,)


def test_fewer_shared_rounds_than_five_are_not_compared_round_by_round():
    a = _rounds([105, 126, 84], [1, 2, 3], half_pct=20.0)  # 5% faster in each of three rounds
    b = _rounds([100, 120, 80], [1, 2, 3], half_pct=20.0)
    assert MIN_PAIRED_ROUNDS == 5 and paired_difference(a, b) is None
    assert tied_with_best([a, b], (0, 1), "throughput") == (1,)  # the intervals in quadrature: tied
