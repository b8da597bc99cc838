"""Equal within a declared size (sweeping/equivalence.py): the two one-sided tests against scipy's own
one-sided t-tests, a row's standing, the repeats that would settle it, and the sweep's decision; the
simulator's screen of a raced grid (sweeping/screen.py) on a predictor that knows the truth; a busy machine's
repeats kept, never thrown away (sweeping/repeat.py, sweeping/run.py)."""

from __future__ import annotations

import math
import random

import pytest
from scipy import stats

from mbtune.pipeline.point import SweepPoint
from mbtune.records import DeviceInfo, MachineLoad
from mbtune.sweeping import repeat, run
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.equivalence import (
    APART,
    DECIDED,
    EQUAL,
    EQUIVALENT,
    NOT_DECIDED,
    OPEN,
    decide,
    settling_factor,
    shown_equivalent,
    standing,
)
from mbtune.sweeping.ranking import Difference, paired_difference
from mbtune.sweeping.records import Balance, PointResult
from mbtune.sweeping.screen import MIN_ERROR, first_points, held_out_error, left_out

GLOBAL = 64


def _point(m: int, acc: int = 1, schedule: str = "gpipe") -> SweepPoint:
    return SweepPoint(schedule=schedule, num_ranks=2, num_micro_batches=m, grad_accum_steps=acc,
                      micro_batch_size=GLOBAL // (m * acc))


def _rounds(point: SweepPoint, rates: list[float], peak: int = 100) -> PointResult:
    """A point measured in rounds 1..n at these samples/s."""
    steps = [point.global_batch / r for r in rates]
    return PointResult(point=point, status="ok", step_time_median_s=sorted(steps)[len(steps) // 2],
                       samples_per_s=sum(rates) / len(rates), repeat_step_time_medians_s=tuple(steps),
                       repeat_rounds=tuple(range(1, len(rates) + 1)), num_repeats=len(rates),
                       peak_memory_bytes=(peak,), wall_s=float(len(rates)))


def test_the_equivalence_test_is_scipys_two_one_sided_t_tests():
    # Paired log ratios: equivalent within the size exactly where both one-sided tests reject at 5%.
    rng = random.Random(7)
    size = 0.03
    bound = math.log1p(size)
    agreed = {True: 0, False: 0}
    for _ in range(200):
        shift, noise = rng.uniform(-0.04, 0.04), rng.uniform(0.002, 0.03)
        base = [100 * math.exp(rng.gauss(0, 0.1)) for _ in range(8)]  # the machine's drift, shared by both
        a = [b * math.exp(shift + rng.gauss(0, noise)) for b in base]
        found = paired_difference(_rounds(_point(2), a), _rounds(_point(4), base))
        ratios = [math.log(x / y) for x, y in zip(a, base)]
        lower = stats.ttest_1samp(ratios, -bound, alternative="greater").pvalue
        upper = stats.ttest_1samp(ratios, bound, alternative="less").pvalue
        expected = max(lower, upper) < 0.05
        assert shown_equivalent(found, size) == expected
        agreed[expected] += 1
    assert agreed[True] > 10 and agreed[False] > 10  # both outcomes were tried


def test_a_rows_standing_known_values():
    found = Difference(mean=0.01, se=0.005, dof=10)  # 90% interval 0.01 +- 1.8125 x 0.005: [0.0009, 0.0191]
    assert standing(found, 0.03) == EQUAL  # inside +-log(1.03) = 0.0296
    assert standing(found, 0.015) == OPEN  # past +-log(1.015) = 0.0149; the 95% interval (+-0.0111) holds 0
    assert standing(Difference(mean=0.05, se=0.005, dof=10), 0.03) == APART
    assert standing(None, 0.03) == OPEN
    # Told apart by +-2.228 x 0.005 at 10 degrees of freedom: (2.228 x 0.005 / 0.01)^2 = 1.24 times the repeats;
    # shown within 1.5% would need (1.8125 x 0.005 / (0.0149 - 0.01))^2 = 3.4 times: the smaller wins.
    assert settling_factor(found, 0.015) == pytest.approx((stats.t.ppf(0.975, 10) * 0.005 / 0.01) ** 2)
    assert settling_factor(Difference(mean=0.0, se=0.0, dof=3), 0.03) is None


def _field(apart: float, noise: float = 0.01, paired: float = 0.0025, rounds: int = 8,
           peaks: tuple[int, ...] = (100, 50)) -> list[PointResult]:
    rng = random.Random(3)
    base = [100 * (1 + rng.gauss(0, noise)) for _ in range(rounds)]
    other = [b / (1 + apart) * (1 + rng.gauss(0, paired)) for b in base]
    return [_rounds(_point(2), base, peaks[0]), _rounds(_point(4), other, peaks[1])]


def test_the_decision_is_decided_equivalent_or_not_decided_with_what_would_settle_it():
    far = _field(apart=0.2)
    assert decide(far, (0, 1), 0.03).state == DECIDED
    near = _field(apart=0.005)
    equal = decide(near, (0, 1), 0.03)
    assert equal.state == EQUIVALENT and equal.group == (1,) and equal.size == 0.03
    # 0.5% apart, +-2% round by round: neither told apart nor shown within 1%: open, and the repeats that would
    # settle it are estimated.
    still = decide(_field(apart=0.005, paired=0.02), (0, 1), 0.01, why="the time budget (90 s) was spent")
    assert still.state == NOT_DECIDED and still.open == (1,) and still.why.startswith("the time budget")
    assert still.more_repeats is not None and still.more_repeats >= 1 and still.more_time_s > 0
    assert decide([], (), 0.03) is None


def test_equivalent_rows_are_listed_by_peak_memory_then_simplicity():
    rng = random.Random(5)
    base = [100 * (1 + rng.gauss(0, 0.01)) for _ in range(8)]
    best = _rounds(_point(8), base, peak=300)
    same = [_rounds(p, [b * (1 + rng.gauss(0, 0.002)) for b in base], peak)
            for p, peak in ((_point(4, 2), 200), (_point(2, 4), 200), (_point(8, 1, "1f1b"), 100))]
    decision = decide([best, *same], (0, 1, 2, 3), 0.03)
    assert decision.state == EQUIVALENT
    # The least memory first; at equal memory, fewer micro-batches (simpler) before more.
    assert [(r.point.schedule, r.point.num_micro_batches) for r in (same[i - 1] for i in decision.group)] == \
        [("1f1b", 8), ("gpipe", 2), ("gpipe", 4)]


class _Truth:
    """A predictor that knows every point's rate and memory, each off by `miss` (alternating sign)."""

    def __init__(self, rates: dict[SweepPoint, float], memory: dict[SweepPoint, float], miss: float = 0.0) -> None:
        self.rates, self.memory, self.miss, self.calls = rates, memory, miss, 0

    def __call__(self, results, points):
        self.calls += 1
        if not any(r.ok for r in results):
            raise ValueError("nothing measured")
        return [(self.rates[p] * (1 + (self.miss if i % 2 else -self.miss)), self.memory[p])
                for i, p in enumerate(points)]


GRID = [_point(m, acc, schedule) for schedule in ("gpipe", "1f1b") for m in (2, 4, 8) for acc in (1, 2)]


def _measured(points, rates, memory) -> list[PointResult]:
    return [_rounds(p, [rates[p]] * 2, peak=int(memory[p])) for p in points]


def test_the_screen_leaves_out_what_cannot_be_better_nor_equal_and_keeps_the_memory_front():
    rates = {p: 100.0 * (1.0 if p.schedule == "1f1b" else 0.7) * (1 + 0.01 * p.num_micro_batches) for p in GRID}
    memory = {p: 1000.0 - 10 * p.grad_accum_steps * p.num_micro_batches - 5 * (p.schedule == "gpipe") for p in GRID}
    cheapest = min(GRID, key=lambda p: memory[p])  # gpipe m=8 acc=2: slower, but the least memory
    first = first_points(GRID)
    # Every setting the grid uses measured once, and two more points than schedules: 4 of 12.
    assert len(first) == 4 and {p.schedule for p in first} == {"gpipe", "1f1b"}
    assert {p.num_micro_batches for p in first} == {2, 4, 8} and {p.grad_accum_steps for p in first} == {1, 2}
    error, out = left_out(GRID, _measured(first, rates, memory), _Truth(rates, memory), size=0.03,
                          fixed_global_batch=True)
    assert error == MIN_ERROR  # the predictor missed nothing: the floor
    left = {p.point for p in out}
    # Every gpipe point is 30% below any 1f1b one: left out, bar the cheapest in memory (on the front).
    assert left and all(p.schedule == "gpipe" for p in left) and cheapest not in left
    assert all(rates[p] * (1 + error) < max(rates.values()) * 0.97 for p in left)
    assert all(o.reason.endswith("not on the throughput-memory front") and o.samples_per_s == pytest.approx(rates[o.point]) for o in out)


def test_a_prediction_that_misses_more_than_the_gap_leaves_nothing_out():
    rates = {p: 100.0 if p.schedule == "1f1b" else 80.0 for p in GRID}
    memory = {p: 500.0 for p in GRID}
    truth = _Truth(rates, memory, miss=0.15)  # misses by 15%, more than the 20% gap allows with the 3% size
    measured = _measured(GRID[:6], rates, memory)
    assert held_out_error(truth, measured) == pytest.approx(0.15)
    assert left_out(GRID, measured, truth, size=0.03, fixed_global_batch=True)[1] == ()
    assert held_out_error(truth, measured[:3]) is None  # too few to state an error: nothing is left out
    # A point measured while the machine was busy: no error is stated on loaded figures, nothing is left out.
    from dataclasses import replace

    loaded = [replace(measured[0], load=MachineLoad(busy=True, reason="other processes took 50% of the CPUs")),
              *measured[1:]]
    assert held_out_error(_Truth(rates, memory), loaded) is None


class _Machine:
    """Stands in for the real runs: each point's rate, with jitter; `busy` marks every repeat loaded."""

    def __init__(self, rates: dict[SweepPoint, float], busy: bool = False) -> None:
        self.rates, self.busy, self.order = rates, busy, []
        self.jitter = iter([1.0, 1.01, 0.99, 1.005, 0.995] * 1000)

    def __call__(self, point, config, *_args, **_kwargs) -> PointResult:
        step = point.global_batch / (self.rates[point] * next(self.jitter))
        self.order.append(point)
        load = MachineLoad(busy=True, reason="other processes took 50% of the CPUs") if self.busy else None
        return PointResult(point=point, status="ok", step_times_s=(step,) * config.measured_steps,
                           step_time_median_s=step, samples_per_s=point.global_batch / step, load=load,
                           repeat_step_time_medians_s=(step,), peak_memory_bytes=(100,), wall_s=1.0,
                           warnings=("the machine was busy while it ran",) if self.busy else ())


def _points(monkeypatch, machine: _Machine, grid, **config) -> run._Points:
    monkeypatch.setattr(repeat, "run_point", machine)
    monkeypatch.setattr(run, "_balance", lambda *a: Balance())
    return run._Points(SweepConfig(pin_cpus=False, repeats=None, **config), "cpu", 1, None,
                       DeviceInfo(backend="cpu", name="cpu"), None, None, grid)


def test_a_screened_race_measures_a_few_points_then_only_the_contenders(monkeypatch):
    grid = [_point(m, acc, s) for s in ("gpipe", "1f1b") for m in (2, 4, 8) for acc in (1, 2)]
    rates = {p: (100.0 if p.schedule == "1f1b" else 60.0) for p in grid}
    machine = _Machine(rates)
    points = _points(monkeypatch, machine, grid, time_budget_s=None)
    truth = _Truth(rates, {p: 500.0 for p in grid})
    points.predictor = lambda **_: truth
    points.run_all(grid)
    never = set(grid) - set(machine.order)
    assert never and never == set(points.predicted)  # what was not measured is shown as predicted
    assert all(p.schedule == "gpipe" for p in never)
    assert {r.point for r in points.results} | never == set(grid)
    assert "predicted the grid from" in points.screen_note


def test_with_measure_all_every_point_is_measured(monkeypatch):
    grid = [_point(m, acc, s) for s in ("gpipe", "1f1b") for m in (2, 4, 8) for acc in (1, 2)]
    rates = {p: (100.0 if p.schedule == "1f1b" else 60.0) for p in grid}
    machine = _Machine(rates)
    points = _points(monkeypatch, machine, grid, time_budget_s=None, measure_all=True)
    points.predictor = lambda **_: _Truth(rates, {p: 500.0 for p in grid})
    points.run_all(grid)
    assert set(machine.order) == set(grid) and not points.predicted


def test_a_machine_busy_throughout_keeps_every_points_figures(monkeypatch):
    grid = [_point(m) for m in (2, 4, 8, 16)]
    machine = _Machine({p: 100.0 + p.num_micro_batches for p in grid}, busy=True)
    clock = iter(range(0, 100_000))
    monkeypatch.setattr("time.monotonic", lambda: float(next(clock)))
    points = _points(monkeypatch, machine, grid, time_budget_s=30.0)
    points.run_all(grid)
    assert not points.unmeasured and {r.point for r in points.results} == set(grid)
    assert all(r.ok and r.samples_per_s and r.warnings for r in points.results)
    # A lasting load is the machine's state: busy repeats are kept, not run again and again.
    assert sum(r.busy_reruns for r in points.results) <= repeat.LoadStreak.LASTING


def test_memory_counted_by_a_busy_repeat_run_again_stands(monkeypatch):
    from dataclasses import replace

    grid = [_point(2), _point(4)]
    machine = _Machine({p: 100.0 for p in grid})
    calls = iter(range(1000))

    def first_busy_and_counted(point, config, *args, **kwargs):
        result = machine(point, config, *args, **kwargs)
        if next(calls) == 0:  # the first repeat counts memory, while the machine was busy
            return replace(result, load=MachineLoad(busy=True, reason="a moment's load"), peak_memory_bytes=(123,))
        return replace(result, peak_memory_bytes=(None,))  # kept processes count memory once

    points = _points(monkeypatch, machine, grid, time_budget_s=None)
    monkeypatch.setattr(repeat, "run_point", first_busy_and_counted)
    points.run_all(grid)
    first = next(r for r in points.results if r.point == grid[0])
    assert first.busy_reruns == 1 and first.peak_memory_bytes == (123,)


def test_a_round_that_the_budget_holds_back_entirely_ends_the_race(monkeypatch):
    # Each repeat takes 10 s of the clock and nothing else moves it: after the first round (30 s of a 35 s
    # budget) every next repeat would end past the budget, though the budget is not yet spent.
    grid = [_point(m) for m in (2, 4, 8)]
    machine = _Machine({p: 100.0 + p.num_micro_batches for p in grid})
    now = {"t": 0.0, "reads": 0}

    def clock() -> float:
        now["reads"] += 1
        assert now["reads"] < 10_000, "the race spun without measuring"
        return now["t"]

    def ten_seconds(point, config, *args, **kwargs):
        now["t"] += 10.0
        return machine(point, config, *args, **kwargs)

    monkeypatch.setattr("time.monotonic", clock)
    points = _points(monkeypatch, machine, grid, time_budget_s=35.0)
    monkeypatch.setattr(repeat, "run_point", ten_seconds)
    points.run_all(grid)
    assert len(machine.order) == 3 and {r.stopped for r in points.results} <= {"time budget", "dropped"}
    assert "time budget (35 s) was spent" in points.stopped_by
