"""Predicted against measured, for every point a sweep really ran. Pure: no torch.

Two methods: in-sample (one cost model fitted to every point, then each point predicted) shows how well the
simulator's structure reproduces what ran; leave-one-out (each point predicted by a model fitted to the
others) is the honest figure for a point the sweep did not run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from mbtune.plan.calibrate import point_orders, usable
from mbtune.plan.orders import RankOrders
from mbtune.plan.planner import predict
from mbtune.plan.records import CostModel, Validation, ValidationRow
from mbtune.records import SweepPoint, TrialResult

IN_SAMPLE, LEAVE_ONE_OUT = "in-sample", "leave-one-out"
METHODS = (IN_SAMPLE, LEAVE_ONE_OUT)


def compare(result: TrialResult, model: CostModel, *,
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


def validate(results: Sequence[TrialResult], fit: Callable[[Sequence[TrialResult]], CostModel], *,
             method: str = LEAVE_ONE_OUT, orders_of: Callable[[SweepPoint], RankOrders] = point_orders) -> Validation:
    """Predict every point that ran with models from `fit` (a calibration over a list of results) and
    summarise the errors: median and worst |relative step-time error|, median and worst |bubble error|.

    Leave-one-out needs at least two points; with one it falls back to in-sample.
    """
    if method not in METHODS:
        raise ValueError(f"unknown validation method {method!r}; known: {', '.join(METHODS)}")
    runs = usable(results)
    if not runs:
        raise ValueError("no point with a measured timeline to validate against")
    if method == LEAVE_ONE_OUT and len(runs) < 2:
        method = IN_SAMPLE
    shared = fit(runs) if method == IN_SAMPLE else None
    rows = []
    for index, result in enumerate(runs):
        model = shared or fit(runs[:index] + runs[index + 1:])
        rows.append(compare(result, model, orders_of=orders_of))
    return summarize(rows, method)


def summarize(rows: Sequence[ValidationRow], method: str) -> Validation:
    """Median and worst errors over the rows."""
    steps = [abs(r.step_error) for r in rows]
    bubbles = [abs(r.bubble_error) for r in rows if r.bubble_error is not None]
    return Validation(
        method=method, rows=tuple(rows),
        median_step_error=statistics.median(steps) if steps else None, worst_step_error=max(steps, default=None),
        median_bubble_error=statistics.median(bubbles) if bubbles else None,
        worst_bubble_error=max(bubbles, default=None),
    )
