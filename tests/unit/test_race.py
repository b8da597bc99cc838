"""The race (sweeping/race.py) and the test it rests on (sweeping/ranking.py): a repeat's spread pooled over
the points, a point dropped only when that test separates it from the best and it is off the Pareto front,
the best decided once nothing is tied with it; and a raced sweep (sweeping/run.py) measures every point
once, gives later repeats to the contenders alone and stops at its time budget."""

from __future__ import annotations

import math

import pytest

from mbtune.pipeline.point import SweepPoint
from mbtune.records import DeviceInfo
from mbtune.sweeping import repeat, run
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.race import STAYS, race_verdict
from mbtune.sweeping.ranking import MIN_POOLED_DOF, pooled_repeat_spread, throughput_difference
from mbtune.sweeping.records import Balance, PointResult
from mbtune.sweeping.stopping import DECIDED, DROPPED, EQUIVALENT, FIXED, TIME_BUDGET

GLOBAL = 64


def _point(m: int, schedule: str = "gpipe") -> SweepPoint:
    return SweepPoint(schedule=schedule, num_ranks=2, num_micro_batches=m, grad_accum_steps=1,
                      micro_batch_size=GLOBAL // m)


def _result(point: SweepPoint, steps: list[float], peak: int = 100) -> PointResult:
    rates = [point.global_batch / s for s in steps]
    return PointResult(point=point, status="ok", step_time_median_s=sorted(steps)[len(steps) // 2],
                       samples_per_s=sum(rates) / len(rates), repeat_step_time_medians_s=tuple(steps),
                       num_repeats=len(steps), peak_memory_bytes=(peak,))


def test_the_pooled_spread_is_the_repeats_scatter_about_their_own_points_means():
    # Two points, each with repeats e^-0.1, e^0.1 around its own level: every log deviation is 0.1.
    steps = [math.exp(-0.1), math.exp(0.1)] * 3  # 6 repeats: 5 degrees of freedom each
    results = [_result(_point(2), steps), _result(_point(4), [2 * s for s in steps])]
    spread, dof = pooled_repeat_spread(results)
    assert dof == 10
    assert spread == pytest.approx(math.sqrt(2 * 6 * 0.1**2 / 10))  # 12 squares of 0.1 over 10


def test_no_pooled_spread_under_its_degrees_of_freedom():
    few = [_result(_point(m), [1.0, 1.1]) for m in (2, 4)]  # two degrees of freedom in all
    assert MIN_POOLED_DOF > 2 and pooled_repeat_spread(few) is None


def test_a_point_measured_once_is_compared_against_the_pooled_spread():
    best, other = _result(_point(2), [1.0, 1.0]), _result(_point(4), [2.0])
    found = throughput_difference(best, other, (0.05, 10))
    assert found.mean == pytest.approx(math.log(2))  # twice as fast
    assert found.dof == 10 and found.half == pytest.approx(2.228 * 0.05 * math.sqrt(1 / 2 + 1 / 1), rel=1e-3)


def _field(slow_peak: int = 200) -> list[PointResult]:
    """A best point, one tied with it, one half as fast: scatter enough for the pooled test."""
    noise = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0]
    return [_result(_point(2), noise, peak=100), _result(_point(4), [1.01 * s for s in noise], peak=150),
            _result(_point(8), [2.0], peak=slow_peak)]


def test_nothing_is_judged_before_the_repeats_can_be_pooled():
    once = [_result(_point(2), [1.0]), _result(_point(4), [2.0]), _result(_point(8), [4.0])]
    assert all(race_verdict(i, once, fixed_global_batch=True, size=0.03) == STAYS for i in range(3))


def test_a_point_the_test_separates_from_the_best_is_dropped_with_its_figures():
    verdict = race_verdict(2, _field(), fixed_global_batch=True, size=0.03)
    assert verdict.stopped == DROPPED
    assert verdict.detail == "after 1 repeat, 50% below the best then, p < 0.05"


def test_a_slower_point_cheaper_in_memory_stays_in_the_race():
    assert race_verdict(2, _field(slow_peak=50), fixed_global_batch=True, size=0.03) == STAYS  # on the Pareto front


def test_a_point_tied_with_the_best_stays_and_so_does_the_best():
    field = _field()
    # 1% apart, +-2% a repeat: not told apart, and not shown within 0.5% either.
    assert race_verdict(1, field, fixed_global_batch=True, size=0.005) == STAYS
    assert race_verdict(0, field, fixed_global_batch=True, size=0.005) == STAYS


def test_a_point_shown_within_the_declared_size_leaves_as_equivalent_and_the_best_is_decided():
    field = _field()
    # The same 1% is shown within 3% (the 90% interval of the log ratio inside +-log 1.03): equal is an answer.
    verdict = race_verdict(1, field, fixed_global_batch=True, size=0.03)
    assert verdict.stopped == EQUIVALENT and "within 3% (p < 0.05)" in verdict.detail
    best = race_verdict(0, field, fixed_global_batch=True, size=0.03)
    assert best.stopped == DECIDED and "1 shown within 3% of it" in best.detail


def test_the_best_is_decided_once_nothing_is_tied_with_it_and_it_has_three_repeats():
    field = _field()
    alone = [field[0], field[2]]
    assert race_verdict(0, alone, fixed_global_batch=True, size=0.03).stopped == DECIDED
    twice = _result(_point(2), [1.0, 1.01])
    assert race_verdict(0, [twice, _result(_point(8), [2.0, 2.02, 1.98, 2.0])], fixed_global_batch=True, size=0.03) == STAYS


POINTS = [_point(m) for m in (2, 4, 8)]


class _Machine:
    """Stands in for the real runs: a point's every repeat takes its step time, the clock a second each."""

    def __init__(self, steps: dict[SweepPoint, float]) -> None:
        self.steps, self.order = steps, []
        self.jitter = iter([1.0, 1.01, 0.99, 1.02, 0.98] * 100)

    def __call__(self, point, config, *_args, **_kwargs) -> PointResult:
        step = self.steps[point] * next(self.jitter)
        self.order.append(point)
        return PointResult(point=point, status="ok", step_times_s=(step,) * config.measured_steps,
                           step_time_median_s=step, samples_per_s=point.global_batch / step,
                           repeat_step_time_medians_s=(step,), peak_memory_bytes=(100,))


def _points(monkeypatch, machine: _Machine, **config) -> run._Points:
    monkeypatch.setattr(repeat, "run_point", machine)
    monkeypatch.setattr(run, "_balance", lambda *a: Balance())
    return run._Points(SweepConfig(pin_cpus=False, **config), "cpu", 1, None, DeviceInfo(backend="cpu", name="cpu"),
                       None, None, POINTS)


def test_a_raced_sweep_measures_every_point_once_then_drops_the_beaten(monkeypatch):
    machine = _Machine({POINTS[0]: 1.0, POINTS[1]: 1.0, POINTS[2]: 3.0})
    points = _points(monkeypatch, machine, repeats=None, target_ci=0.05, max_time_per_point_s=1e9,
                     time_budget_s=None)
    points.run_all(POINTS)
    assert machine.order[:3] == POINTS  # the first round: every point once
    slow = next(r for r in points.results if r.point == POINTS[2])
    assert slow.stopped == DROPPED and slow.stopped_detail.endswith("% below the best then, p < 0.05")
    assert machine.order.count(POINTS[2]) < machine.order.count(POINTS[0])


def test_fixed_repeats_measure_every_point_exactly_that_often(monkeypatch):
    machine = _Machine({POINTS[0]: 1.0, POINTS[1]: 1.0, POINTS[2]: 3.0})
    points = _points(monkeypatch, machine, repeats=4)
    points.run_all(POINTS)
    assert sorted(machine.order.count(p) for p in POINTS) == [4, 4, 4]
    assert {r.stopped for r in points.results} == {FIXED}


def test_the_time_budget_stops_the_race_but_every_point_is_measured_once(monkeypatch):
    clock = iter(range(0, 10_000))  # every reading a second later
    monkeypatch.setattr("time.monotonic", lambda: float(next(clock)))
    machine = _Machine({POINTS[0]: 1.0, POINTS[1]: 1.0, POINTS[2]: 1.0})
    points = _points(monkeypatch, machine, repeats=None, target_ci=0.001, max_time_per_point_s=1e9,
                     time_budget_s=2.0)
    points.run_all(POINTS)
    assert sorted(set(machine.order), key=POINTS.index) == POINTS
    assert {r.stopped for r in points.results} == {TIME_BUDGET}
    assert all("time budget (2 s) was spent" in r.stopped_detail for r in points.results)


def _report(results, ties=(), ranking=None, size=0.03):
    from mbtune.sweeping.equivalence import decide
    from mbtune.sweeping.records import SweepReport

    ranking = tuple(range(len(results))) if ranking is None else ranking
    return SweepReport(workload="mlp", device=DeviceInfo(backend="cpu", name="cpu"), objective="throughput",
                       results=tuple(results), ranking=ranking, ties=tuple(ties), repeats=None,
                       decision=decide(results, ranking, size))


def test_the_answer_says_how_decided_it_is_in_one_line():
    from mbtune.report.sweep_lines import decision_line

    field = _field()
    assert decision_line(_report([field[0], field[2]])).startswith("decided: gpipe p=2 m=2 accum=1 mbs=32 (")
    line = decision_line(_report(field))
    assert line.startswith("equivalent: gpipe p=2 m=2 accum=1 mbs=32 (") and "#2 gpipe p=2 m=4 accum=1 mbs=16" in line
    line = decision_line(_report(field, size=0.005))
    assert line.startswith("not decided: best so far gpipe p=2 m=2 accum=1 mbs=32 (")
    assert "1 row(s) neither told apart from it nor shown within 0.5%" in line and "\n" not in line
    assert "more repeat(s) each" in line


def test_point_warnings_come_one_line_per_cause_and_every_one_on_request():
    from dataclasses import replace

    from mbtune.report.sweep_lines import point_warnings

    busy = "the machine was busy while it ran (other processes took 40% of the CPUs): its figures are less certain"
    results = [replace(r, warnings=(busy,)) for r in _field()] + [
        replace(_result(_point(16), [1.0]), warnings=("step time varies 14% (over 10%): results unstable",))]
    summary = point_warnings(_report(results))
    assert summary == ["3 points measured while the machine was busy (other processes took its CPUs or GPU): their "
                       "figures are less certain (mbtune show --warnings lists them)",
                       "gpipe p=2 m=16 accum=1 mbs=4: step time varies 14% (over 10%): results unstable"]
    assert len(point_warnings(_report(results), every=True)) == 4


def test_a_sweep_made_as_a_baseline_measures_as_qualify_does_and_races_nothing():
    from mbtune.sweeping.stopping import QUALIFY_MAX_TIME_PER_POINT_S

    made = SweepConfig(as_baseline=True)
    assert made.target_ci == 0.025 and made.max_time_per_point_s == QUALIFY_MAX_TIME_PER_POINT_S
    assert made.time_budget_s is None and not made.races
    raced = SweepConfig(repeats=None)
    assert raced.races and not SweepConfig(repeats=None, race=False).races and not SweepConfig(repeats=3).races
    assert not SweepConfig(repeats=None, objective="memory").races
    assert not SweepConfig(repeats=None, points=tuple(POINTS)).races


def test_a_time_budget_must_be_positive():
    from mbtune.errors import ConfigError

    with pytest.raises(ConfigError, match="time_budget"):
        SweepConfig(time_budget_s=0)


def test_a_point_the_test_finds_faster_than_the_leader_is_never_dropped():
    from dataclasses import replace

    # Ranked by its pooled median, the leader's repeats' own mean says it is the slower of the two.
    noise = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0]
    leader = replace(_result(_point(2), [2.0 * s for s in noise]), samples_per_s=200.0)
    other = _result(_point(4), [1.0 * s for s in noise], peak=150)
    assert race_verdict(1, [leader, other], fixed_global_batch=True, size=0.03) == STAYS


def test_a_point_busy_at_its_first_repeat_is_raced_once_it_has_one(monkeypatch):
    from dataclasses import replace

    from mbtune.records import MachineLoad

    machine = _Machine({POINTS[0]: 1.0, POINTS[1]: 1.0, POINTS[2]: 3.0})
    measured = machine.__call__
    busy = MachineLoad(busy=True, reason="others took 60% of the CPUs", other_cpu_share=0.6, num_cpus=2)
    calls = []

    def first_busy(point, config, *args, **kwargs):
        calls.append(point)
        result = measured(point, config, *args, **kwargs)
        return replace(result, load=busy) if point == POINTS[2] and calls.count(point) == 1 else result

    points = _points(monkeypatch, machine, repeats=None, target_ci=0.05, max_time_per_point_s=1e9,
                     time_budget_s=None)
    monkeypatch.setattr(repeat, "run_point", first_busy)
    points.run_all(POINTS)
    slow = next(r for r in points.results if r.point == POINTS[2])
    assert slow.busy_reruns == 1 and slow.num_repeats >= 1 and slow.stopped in (DROPPED, "known", "time cap")


def test_raced_points_still_tied_with_the_best_are_not_stopped_by_their_own_time_cap(monkeypatch):
    from mbtune.sweeping.stopping import MAX_REPEATS, MOST_REPEATS

    clock = iter(range(0, 100_000))  # every reading a second later: a point's own 2 s cap would stop it at once
    monkeypatch.setattr("time.monotonic", lambda: float(next(clock)))
    machine = _Machine({POINTS[0]: 1.0, POINTS[1]: 1.0})
    points = _points(monkeypatch, machine, repeats=None, target_ci=0.0001, max_time_per_point_s=2.0,
                     time_budget_s=None, equivalence=0.001)  # the 2% jitter never shows them within 0.1%
    points.run_all(POINTS[:2])
    assert {r.stopped for r in points.results} == {MOST_REPEATS}
    assert all(r.num_repeats == MAX_REPEATS for r in points.results)
