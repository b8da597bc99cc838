"""Serve's answer as a bracket on the ladder of rates, and the configurations tied with the best
(serving/answers.py): a p99 near the budget counts either way, one rung further."""

from __future__ import annotations

from mbtune.serving.answers import P99_NOISE, bracket, near_budget, tied_with_best
from mbtune.serving.records import BatchConfig, ConfigAnswer, LoadResult

BUDGET = 0.100
LADDER = [100.0, 200.0, 300.0, 400.0]
CONFIG = BatchConfig(max_batch_size=8)


def _load(rate: float, p99: float | None, spread: float | None = 0.05) -> LoadResult:
    return LoadResult(config=CONFIG, rate_per_s=rate, p99_s=p99, window_spread=spread)


def test_a_p99_far_from_the_budget_keeps_the_bracket_between_the_rates_measured():
    assert bracket(LADDER, _load(200, 0.050), _load(300, 0.300), BUDGET) == (200, 300)
    assert bracket(LADDER, _load(400, 0.050), None, BUDGET) == (400, None)  # nothing failed: no end above
    assert bracket(LADDER, None, _load(100, 0.300), BUDGET) == (0.0, 100)


def test_a_pass_or_a_failure_near_the_budget_moves_that_end_one_rung_out():
    near_below, near_above = BUDGET * (1 - P99_NOISE / 2), BUDGET * (1 + P99_NOISE / 2)
    assert bracket(LADDER, _load(200, near_below), _load(300, 0.300), BUDGET) == (100, 300)
    assert bracket(LADDER, _load(200, 0.050), _load(300, near_above), BUDGET) == (200, 400)
    assert bracket(LADDER, _load(100, near_below), _load(400, near_above), BUDGET) == (0.0, None)
    # Lost requests are far over the budget, whatever the windows did.
    assert not near_budget(_load(300, None, spread=None), BUDGET)


def test_a_load_whose_windows_spread_widely_is_near_the_budget_further_out():
    assert not near_budget(_load(300, 0.130, spread=0.10), BUDGET)
    assert near_budget(_load(300, 0.130, spread=0.40), BUDGET)
    assert near_budget(_load(300, 0.500, spread=None), BUDGET)  # windows that never agreed: anything is near


def _answer(label: int, low: float, high: float | None, ran: bool = True) -> ConfigAnswer:
    return ConfigAnswer(config=BatchConfig(max_batch_size=label), max_rate_per_s=low or None, ran=ran,
                        bracket_low_per_s=low, bracket_high_per_s=high)


def test_configurations_whose_brackets_overlap_the_best_ones_are_tied_with_it():
    answers = [_answer(1, 300, 400), _answer(2, 200, 400), _answer(4, 200, 300), _answer(8, 400, None),
               _answer(16, 100, 200), _answer(32, 300, None, ran=False)]
    assert tied_with_best(answers, 0) == (1,)  # [200, 400) overlaps [300, 400); [200, 300) only touches it
    assert tied_with_best(answers, 3) == ()  # [400, above) starts where the others end
    assert tied_with_best(answers, 1) == (0, 2)
    assert tied_with_best(answers, None) == ()


def test_serve_decides_by_the_sweeps_rule_equal_within_a_declared_size_is_an_answer():
    from mbtune.serving.answers import decide

    # The best sustains 400/s; configuration 2 is tied with it at 400/s too (the same rung): equal within 10%.
    same = [_answer(1, 400, 500), _answer(2, 400, 500), _answer(4, 200, 300)]
    decision = decide(same, 0, 0.10)
    assert decision.state == "equivalent" and decision.group == (1,) and decision.open == ()
    # Tied at 300/s, a quarter below: within the brackets' noise, but not within 10%: not decided.
    apart = [_answer(1, 400, 500), _answer(2, 300, 500)]
    assert decide(apart, 0, 0.10).state == "not decided" and decide(apart, 0, 0.10).open == (1,)
    assert decide(apart, 0, 0.30).state == "equivalent"  # a declared 30% holds it
    assert decide([_answer(1, 400, 500), _answer(2, 100, 200)], 0, 0.10).state == "decided"
    assert decide(same, None, 0.10) is None


def test_the_p99_interval_is_the_order_statistics_a_binomial_count_puts_it_between():
    from mbtune.serving.traffic import percentile, quantile_interval, relative_half

    values = [float(v) for v in range(1, 1001)]  # p99 by nearest rank: the 990th
    low, high = quantile_interval(values, 0.99)
    # 990 -+ 1.96 x sqrt(1000 x 0.99 x 0.01) = 990 -+ 6.17: ranks 983 and 997.
    assert (low, high) == (983.0, 997.0) and percentile(values, 0.99) == 990.0
    assert relative_half(low, high, 990.0) == (997 - 983) / 2 / 990
    # Ten times the requests, the same shape: the interval narrows about as 1 / sqrt(n).
    more = [v / 10 for v in range(1, 10001)]
    assert relative_half(*quantile_interval(more, 0.99), 990.0) < 0.4 * relative_half(low, high, 990.0)
    # Rejected requests are slower than all: enough of them put the top of the interval at infinity.
    assert quantile_interval(values, 0.99, rejected=10)[1] == float("inf")
    assert relative_half(1.0, float("inf"), 2.0) == float("inf")


def test_a_load_with_a_p99_interval_is_near_the_budget_within_it_not_within_its_windows_spread():
    wide = LoadResult(config=CONFIG, rate_per_s=300, p99_s=0.140, window_spread=0.01, p99_ci_half_pct=45.0)
    narrow = LoadResult(config=CONFIG, rate_per_s=300, p99_s=0.140, window_spread=0.90, p99_ci_half_pct=5.0)
    assert near_budget(wide, BUDGET) and not near_budget(narrow, BUDGET)
