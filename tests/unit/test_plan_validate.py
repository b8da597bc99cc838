"""The noise floor beside the validation's errors: between repeats where a point has them, within one run
where none has, and the verdict that compares the median error against it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mbtune.planning.accuracy import IN_SAMPLE, LEAVE_ONE_OUT, noise_floor, validate
from mbtune.planning.calibrate import calibrate
from mbtune.planning.planner import predict
from mbtune.planning.records import BETWEEN_RUN, SCATTER_NONE, WITHIN_RUN, Spread
from mbtune.sweeping.records import PointResult
from tests.unit.test_plan_calibrate import FACTS, TRUTH, measured, points


def with_repeats(result: PointResult, *medians_s: float) -> PointResult:
    return replace(result, num_repeats=len(medians_s), repeat_step_time_medians_s=medians_s)


def test_between_run_floor_is_the_range_of_repeat_medians_over_their_median() -> None:
    first, second, third = (measured(p) for p in points()[:3])
    results = [with_repeats(first, 1.0, 1.2), with_repeats(second, 2.0, 2.0, 2.2), third]  # third: no repeats
    floor = noise_floor(results)
    assert floor is not None and floor.kind == BETWEEN_RUN and floor.num_points == 2
    assert floor.worst == pytest.approx(0.2 / 1.1)  # a pair: |a - b| / their mean
    assert floor.median == pytest.approx((0.2 / 1.1 + 0.2 / 2.0) / 2)


def test_without_repeats_the_floor_is_the_spread_within_one_run() -> None:
    result = replace(measured(points()[0]), step_times_s=(1.0, 1.1, 1.2, 1.1))
    floor = noise_floor([result, replace(result, status="oom")])
    assert floor is not None and floor.kind == WITHIN_RUN and floor.num_points == 1
    assert floor.median == floor.worst == pytest.approx(0.2 / 1.1)
    assert noise_floor([measured(points()[0])]) is None  # one step, no repeats: nothing to tell noise from


def test_validation_carries_the_floor_and_says_whether_the_error_is_within_it() -> None:
    truth = [with_repeats(measured(p), 1.0, 1.1) for p in points(sizes=(8,))]
    fit = lambda runs: calibrate(truth, FACTS, workload="synthetic")  # noqa: E731 - the true model, always
    exact = validate(truth, fit, method=IN_SAMPLE)
    assert exact.noise_floor is not None and exact.noise_floor.median == pytest.approx(0.1 / 1.05)
    assert exact.within_noise_floor is True
    slow = [replace(r, step_time_median_s=r.step_time_median_s * 1.25) for r in truth]  # 20% below every one
    assert validate(slow, fit, method=IN_SAMPLE).within_noise_floor is False
    assert validate([measured(p) for p in points(sizes=(8,))], fit, method=IN_SAMPLE).within_noise_floor is None


def test_validation_without_scatter_predicts_with_average_costs() -> None:
    scattered = replace(TRUTH, spread=Spread(compute=(0.5, 1.0, 3.0)))
    results = [measured(p, scattered) for p in points(sizes=(8,))]
    check = validate(results, lambda runs: scattered, method=LEAVE_ONE_OUT, scatter=SCATTER_NONE)
    assert check.scatter == SCATTER_NONE
    for row in check.rows:
        assert row.predicted_step_s == predict(TRUTH, row.point).step_time_s  # TRUTH has no spread
    with pytest.raises(ValueError, match="unknown scatter mode"):
        validate(results, lambda runs: scattered, scatter="sometimes")
