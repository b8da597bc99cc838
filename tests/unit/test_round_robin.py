"""A sweep measures its points round-robin (sweeping/run.py): one repeat of every point still measuring,
round after round, so a machine whose speed drifts slows every point alike; each point stops by its own
rule, its time cap counting its own repeats; an interrupted sweep keeps the repeats it finished."""

from __future__ import annotations

import pytest

from mbtune.errors import Interrupted
from mbtune.pipeline.point import SweepPoint
from mbtune.records import DeviceInfo
from mbtune.sweeping import repeat, run
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.records import Balance, PointResult
from mbtune.sweeping.stopping import FIXED, INTERRUPTED, KNOWN, TIME_CAP

POINTS = [SweepPoint(schedule="gpipe", num_ranks=2, num_micro_batches=m, grad_accum_steps=1, micro_batch_size=4)
          for m in (2, 4, 8)]


# Every point measured until known, as qualify re-measures a baseline's points: none raced, no time budget.
NOT_RACED = {"points": tuple(POINTS), "time_budget_s": None}


class _Machine:
    """Stands in for the real runs: each point's repeats take the step times given, in order."""

    def __init__(self, steps: dict[SweepPoint, list[float]], *, interrupt_after: int | None = None) -> None:
        self.steps, self.order, self.interrupt_after = steps, [], interrupt_after

    def __call__(self, point, config, *_args, **_kwargs) -> PointResult:
        if self.interrupt_after is not None and len(self.order) == self.interrupt_after:
            raise Interrupted("stopped")
        step = self.steps[point][sum(1 for p in self.order if p == point)]
        self.order.append(point)
        return PointResult(point=point, status="ok", step_times_s=(step,) * config.measured_steps,
                           step_time_median_s=step, samples_per_s=point.global_batch / step,
                           repeat_step_time_medians_s=(step,))


def _points(monkeypatch, machine: _Machine, **config) -> run._Points:
    monkeypatch.setattr(repeat, "run_point", machine)
    monkeypatch.setattr(run, "_balance", lambda *a: Balance())
    return run._Points(SweepConfig(pin_cpus=False, **config), "cpu", 1, None, DeviceInfo(backend="cpu", name="cpu"),
                       None, None, POINTS)


def test_fixed_repeats_go_round_the_points_not_point_by_point(monkeypatch):
    machine = _Machine({p: [0.1] * 3 for p in POINTS})
    points = _points(monkeypatch, machine, repeats=3)
    points.run_all(POINTS)
    assert machine.order == POINTS * 3
    assert [r.point for r in points.results] == POINTS and {r.stopped for r in points.results} == {FIXED}
    assert {r.repeat_rounds for r in points.results} == {(1, 2, 3)}  # what the ties compare round by round


def test_a_point_known_early_leaves_the_round_and_the_others_go_on(monkeypatch):
    steady, noisy = [0.1] * 20, [0.1, 0.2, 0.1, 0.2, 0.1, 0.2, 0.1, 0.2, 0.1, 0.2] * 2
    machine = _Machine({POINTS[0]: noisy, POINTS[1]: steady, POINTS[2]: noisy})
    points = _points(monkeypatch, machine, repeats=None, target_ci=0.05, max_time_per_point_s=1e9, **NOT_RACED)
    points.run_all(POINTS)
    known = [r for r in points.results if r.point == POINTS[1]][0]
    assert known.stopped == KNOWN and len(known.repeat_step_time_medians_s) == 3
    assert machine.order[:9] == POINTS * 3 and POINTS[1] not in machine.order[9:]
    assert machine.order[9:11] == [POINTS[0], POINTS[2]]
    assert [r.point for r in points.results] == POINTS  # reported in the grid's order, whatever ended first


def test_the_time_cap_counts_the_points_own_repeats(monkeypatch):
    clock = iter(range(0, 10_000, 1))  # every reading one second later: each repeat takes one second
    monkeypatch.setattr("time.monotonic", lambda: float(next(clock)))
    noisy = [0.1, 0.2] * 10
    machine = _Machine({p: noisy for p in POINTS})
    points = _points(monkeypatch, machine, repeats=None, target_ci=0.001, max_time_per_point_s=4.5, **NOT_RACED)
    points.run_all(POINTS)
    # Each point's repeats take 1 s of its own; the others' repeats between them do not count against it.
    assert all(r.stopped == TIME_CAP and len(r.repeat_step_time_medians_s) == 4 for r in points.results)


def test_an_interrupted_sweep_keeps_the_repeats_each_point_finished(monkeypatch):
    machine = _Machine({p: [0.1] * 5 for p in POINTS}, interrupt_after=4)
    points = _points(monkeypatch, machine, repeats=3)
    with pytest.raises(Interrupted):
        points.run_all(POINTS)
    points.keep_unfinished()
    assert [(r.point, r.stopped, len(r.repeat_step_time_medians_s)) for r in points.results] == [
        (POINTS[0], INTERRUPTED, 2), (POINTS[1], INTERRUPTED, 1), (POINTS[2], INTERRUPTED, 1)]
