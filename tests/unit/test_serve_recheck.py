"""Serve's second look and its quiet measurement (serving/answers.py, serving/config.py): which loads decide
the choice and are measured again, what a rate measured twice counts as, the choice among configurations
that sustain the same rate, and the cores the server and the load generator keep to."""

from __future__ import annotations

import dataclasses

from mbtune.serving import simulate
from mbtune.serving.answers import answer, best_answer, to_confirm
from mbtune.serving.config import ServeConfig, serve_cores
from mbtune.serving.records import BatchConfig, ConfigAnswer, ConfigRun, LoadResult, ServiceCurve, ServiceTime

BUDGET = 0.100
RATES = (100.0, 200.0, 300.0, 400.0, 500.0)
RULE = BatchConfig(max_batch_size=8)
CONFIG = ServeConfig(p99_budget_s=BUDGET, workload="mlp", device="cpu", rates=RATES)
SERVICE = simulate.curve_sampler(ServiceCurve(times=(ServiceTime(batch_size=1, times_s=(0.001,) * 3),
                                                     ServiceTime(batch_size=8, times_s=(0.004,) * 3)), threads=1))


def _load(rate: float, p99: float) -> LoadResult:
    return LoadResult(config=RULE, rate_per_s=rate, p99_s=p99, window_spread=0.01, stable=True)


def _answer_of(*loads: LoadResult) -> ConfigAnswer:
    return answer(RULE, [ConfigRun(config=RULE, loads=loads)], RATES, SERVICE, 0.0, CONFIG)


def test_a_rate_measured_twice_is_sustained_only_where_both_looks_met_the_budget():
    first = (_load(100, 0.02), _load(200, 0.03), _load(300, 0.04), _load(400, 0.50))
    once = _answer_of(*first)
    assert (once.max_rate_per_s, once.bracket_low_per_s, once.bracket_high_per_s) == (300, 300, 400)
    # The second look fails 300: the highest rate sustained falls to 200, and since 300 met the budget once,
    # the highest rate may still be 300, so the bracket reaches the rung above it.
    both = _answer_of(*first, _load(200, 0.035), _load(300, 0.30))
    assert (both.max_rate_per_s, both.first_failing_rate_per_s) == (200, 300)
    assert (both.bracket_low_per_s, both.bracket_high_per_s) == (200, 400)
    assert both.p99_at_max_s == 0.035  # the worse of the rate's two measurements
    # Both looks meet 300: unchanged.
    again = _answer_of(*first, _load(200, 0.03), _load(300, 0.045), _load(400, 0.40))
    assert (again.max_rate_per_s, again.bracket_high_per_s, again.p99_at_max_s) == (300, 400, 0.045)


def _ranked(rate: float, delay: float, size: int, p99: float) -> ConfigAnswer:
    return ConfigAnswer(config=BatchConfig(max_batch_size=size, max_queue_delay_s=delay), max_rate_per_s=rate,
                        p99_at_max_s=p99, bracket_low_per_s=rate, bracket_high_per_s=rate + 100)


def test_among_configurations_at_the_same_rate_the_one_that_waits_then_holds_least_is_chosen():
    answers = [_ranked(300, 0.02, 8, 0.030), _ranked(300, 0.0, 16, 0.060), _ranked(300, 0.0, 8, 0.070),
               _ranked(200, 0.0, 4, 0.010)]
    assert best_answer(answers) == 2  # the shortest delay, then the smallest batch; its higher p99 decides nothing
    assert best_answer([_ranked(300, 0.0, 8, 0.07), _ranked(400, 0.02, 32, 0.09)]) == 1  # a higher rate wins
    assert best_answer([_ranked(300, 0.0, 8, 0.07), _ranked(300, 0.0, 8, 0.05)]) == 1  # same settings: the p99
    unstable = dataclasses.replace(_ranked(300, 0.0, 8, 0.09), stable=False)
    assert best_answer([unstable, _ranked(300, 0.0, 16, 0.03)]) == 0  # windows that disagreed decide nothing here
    assert best_answer([unstable, _ranked(300, 0.0, 8, 0.09)]) == 1  # but between the same settings, they do


def test_the_loads_measured_again_are_the_rungs_around_the_best_rate_for_every_configuration_that_reaches_them():
    answers = [_ranked(300, 0.0, 8, 0.03),  # the best
               _ranked(200, 0.0, 16, 0.03),  # [200, 300): one rung below the best's: a second look could swap them
               ConfigAnswer(config=BatchConfig(max_batch_size=32), max_rate_per_s=100, bracket_low_per_s=100,
                            bracket_high_per_s=200),  # [100, 200): ends at the rung below the best's: out
               ConfigAnswer(config=BatchConfig(max_batch_size=4), max_rate_per_s=None, bracket_low_per_s=0.0,
                            bracket_high_per_s=100),  # met the budget nowhere
               ConfigAnswer(config=BatchConfig(max_batch_size=2), max_rate_per_s=None, ran=False)]
    assert to_confirm(answers, 0, RATES) == {0: (200.0, 300.0, 400.0), 1: (200.0, 300.0, 400.0)}
    # At the top of the ladder there is no rung above; at the bottom none below.
    top = [_ranked(500, 0.0, 8, 0.03)]
    assert to_confirm(top, 0, RATES) == {0: (400.0, 500.0)}
    assert to_confirm([_ranked(100, 0.0, 8, 0.03)], 0, RATES) == {0: (100.0, 200.0)}
    assert to_confirm(answers, None, RATES) == {}


def test_the_server_keeps_the_model_threads_cores_and_the_generator_the_rest():
    assert serve_cores(None, "cpu", allowed={0, 1}) == ((0,), (1,))
    assert serve_cores(2, "cpu", allowed={4, 5, 6, 7}) == ((4, 5), (6, 7))
    assert serve_cores(None, "cpu", allowed={0, 1, 2, 3}) == ((0, 1, 2), (3,))
    # Nothing pinned: not asked, not the CPU, or no core left for the generator.
    assert serve_cores(None, "cpu", pin=False, allowed={0, 1}) == ((), ())
    assert serve_cores(None, "cuda", allowed={0, 1}) == ((), ())
    assert serve_cores(2, "cpu", allowed={0, 1}) == ((), ())
    assert serve_cores(None, "cpu", allowed={0}) == ((), ())
