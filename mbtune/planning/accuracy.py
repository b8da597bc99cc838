"""Predicted against measured, for every point a sweep really ran. Pure: no torch.

Two methods: in-sample (one cost model fitted to every point, then each point predicted) shows how well the
simulator's structure reproduces what ran; leave-one-out (each point predicted by a model fitted to the
others) is the honest figure for a point the sweep did not run.

Beside the errors, the noise floor of the same measurements (see NoiseFloor): how far a point moves when it
is measured again. A median error within it is as close as these measurements can tell.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from mbtune.pipeline.point import SweepPoint
from mbtune.planning.calibrate import point_orders, usable
from mbtune.planning.orders import RankOrders
from mbtune.planning.planner import predict, with_scatter
from mbtune.planning.records import (
    BETWEEN_RUN,
    SCATTER_MEASURED,
    WITHIN_RUN,
    CostModel,
    NoiseFloor,
    Validation,
    ValidationRow,
)
from mbtune.sweeping.records import PointResult

IN_SAMPLE, LEAVE_ONE_OUT = "in-sample", "leave-one-out"
METHODS = (IN_SAMPLE, LEAVE_ONE_OUT)


def compare(result: PointResult, model: CostModel, *,
            orders_of: Callable[[SweepPoint], RankOrders] = point_orders) -> ValidationRow:
    """One point's predicted step time and bubble beside what it measured."""
    predicted = predict(model, result.point, orders_of=orders_of)
    measured = result.step_time_median_s
    assert measured, "compare needs a point that ran"
    bubble_error = None if result.bubble_measured is None else predicted.bubble - result.bubble_measured
    return ValidationRow(
        point=result.point, measured_step_s=measured, predicted_step_s=predicted.step_time_s,
        step_error=(predicted.step_time_s - measured) / measured, measured_bubble=result.bubble_measured,
        predicted_bubble=predicted.bubble, bubble_error=bubble_error, measured_samples_per_s=result.samples_per_s,
        predicted_samples_per_s=predicted.samples_per_s,
    )


def validate(results: Sequence[PointResult], fit: Callable[[Sequence[PointResult]], CostModel], *,
             method: str = LEAVE_ONE_OUT, orders_of: Callable[[SweepPoint], RankOrders] = point_orders,
             scatter: str = SCATTER_MEASURED) -> Validation:
    """Predict every point that ran with models from `fit` (a calibration over a list of results) and
    summarise the errors: median and worst |relative step-time error|, median and worst |bubble error|, with
    the noise floor of the same measurements beside them. `scatter` as in the plan (see with_scatter).

    Leave-one-out needs at least two points; with one it falls back to in-sample.
    """
    if method not in METHODS:
        raise ValueError(f"unknown validation method {method!r}; known: {', '.join(METHODS)}")
    runs = usable(results)
    if not runs:
        raise ValueError("no point with a measured timeline to validate against")
    if method == LEAVE_ONE_OUT and len(runs) < 2:
        method = IN_SAMPLE
    shared = with_scatter(fit(runs), scatter) if method == IN_SAMPLE else None
    rows = []
    for index, result in enumerate(runs):
        model = shared or with_scatter(fit(runs[:index] + runs[index + 1:]), scatter)
        rows.append(compare(result, model, orders_of=orders_of))
    return summarize(rows, method, noise=noise_floor(runs), scatter=scatter)


def summarize(rows: Sequence[ValidationRow], method: str, *, noise: NoiseFloor | None = None,
              scatter: str = SCATTER_MEASURED) -> Validation:
    """Median and worst errors over the rows, with the measurements' noise floor beside them."""
    steps = [abs(r.step_error) for r in rows]
    bubbles = [abs(r.bubble_error) for r in rows if r.bubble_error is not None]
    return Validation(
        method=method, rows=tuple(rows),
        median_step_error=statistics.median(steps) if steps else None, worst_step_error=max(steps, default=None),
        median_bubble_error=statistics.median(bubbles) if bubbles else None,
        worst_bubble_error=max(bubbles, default=None), noise_floor=noise, scatter=scatter,
    )


def noise_floor(results: Sequence[PointResult]) -> NoiseFloor | None:
    """The noise floor of the ok points' step times (see NoiseFloor): between runs over the points measured
    in two or more repeats; where none was, within one run over the points with two or more measured steps.
    None where no point has either."""
    ok = [r for r in results if r.ok]
    between = [_relative_range(r.repeat_step_time_medians_s) for r in ok if len(r.repeat_step_time_medians_s) >= 2]
    kind, spreads = BETWEEN_RUN, [x for x in between if x is not None]
    if not spreads:
        within = [_relative_range(r.step_times_s) for r in ok if len(r.step_times_s) >= 2]
        kind, spreads = WITHIN_RUN, [x for x in within if x is not None]
    if not spreads:
        return None
    return NoiseFloor(kind=kind, median=statistics.median(spreads), worst=max(spreads), num_points=len(spreads))


def _relative_range(values: Sequence[float]) -> float | None:
    """(max - min) / median; None where the median is not positive."""
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle > 0 else None
