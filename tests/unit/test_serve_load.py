"""The load generator's pure half: Poisson arrivals, percentiles with lost requests, stable windows."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest

from mbtune.serving.traffic import Window, percentile, poisson_arrivals, spread_of, stable, window_of


def test_poisson_arrivals_have_the_rate_as_mean_and_counts_as_dispersed_as_a_poisson_process():
    rate, duration = 500.0, 400.0
    times = poisson_arrivals(rate, duration, seed=7)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.02)
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.03)  # exponential gaps: sd = mean
    counts = [0] * int(duration)
    for t in times:
        counts[int(t)] += 1
    mean = statistics.fmean(counts)
    assert mean == pytest.approx(rate, rel=0.02)
    assert statistics.variance(counts) / mean == pytest.approx(1.0, abs=0.2)  # index of dispersion of a Poisson count
    assert all(0 <= t < duration for t in times) and times == sorted(times)


def test_poisson_arrivals_are_reproducible_by_seed():
    assert poisson_arrivals(50, 10, seed=1) == poisson_arrivals(50, 10, seed=1) != poisson_arrivals(50, 10, seed=2)


def test_percentiles_use_the_nearest_rank_and_lost_requests_are_slower_than_all():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.99) == 99.0 and percentile(values, 0.50) == 50.0
    assert percentile(values, 0.99, rejected=1) == 100.0  # 101 requests: rank 100 is the slowest served one
    assert math.isinf(percentile(values, 0.99, rejected=2))  # 102: rank 101 falls among the lost
    assert math.isnan(percentile([], 0.5))


def window(completed, latency, offered=0, length=1.0):
    return Window(completed=completed, mean_latency_s=latency, throughput_per_s=completed / length, offered=offered)


def test_three_windows_that_agree_within_10_percent_are_stable():
    assert stable([window(100, 0.010), window(104, 0.0105), window(97, 0.0098)])
    assert not stable([window(100, 0.010), window(104, 0.0105)])  # only two
    assert not stable([window(100, 0.010), window(130, 0.010), window(100, 0.010)])  # throughput 30% off
    assert not stable([window(100, 0.010), window(100, 0.015), window(100, 0.010)])  # latency off
    assert not stable([window(0, math.inf), window(0, math.inf), window(0, math.inf)])


def test_in_an_open_loop_the_served_share_of_arrivals_decides_not_the_poisson_count():
    """Arrivals of 80, 120 and 100 (Poisson noise) all served: stable; a backlog growing is not."""
    kept_up = [window(80, 0.01, offered=80), window(120, 0.01, offered=120), window(100, 0.01, offered=100)]
    assert stable(kept_up) and spread_of(kept_up) < 0.1
    falling_behind = [window(100, 0.01, offered=100), window(80, 0.01, offered=100), window(60, 0.01, offered=100)]
    assert not stable(falling_behind)


def test_a_window_of_latencies_summarises_them():
    made = window_of([0.01, 0.03], 2.0, offered=3)
    assert made.completed == 2 and made.mean_latency_s == pytest.approx(0.02) and made.throughput_per_s == 1.0
    assert made.pace == pytest.approx(2 / 3)


def _windows(tails: list[int], size: int = 100) -> list[tuple[list[float], int]]:
    """Windows of `size` latencies each, all distinct: the others between 1.0 and 1.5, the first tails[i]
    of window i slow, just above 2.0 (the k-th slow of each window below the (k+1)-th of any)."""
    windows = []
    for index, tail in enumerate(tails):
        values = [1.0 + 0.5 * k / size + index * 1e-5 for k in range(size)]
        values[:tail] = [2.0 + 0.001 * (k * len(tails) + index + 1) for k in range(tail)]
        windows.append((values, 0))
    return windows


def test_a_p99_whose_slow_requests_come_evenly_keeps_the_binomial_interval():
    from mbtune.serving.traffic import percentile_half, sectioned_half

    even = _windows([2] * 10)  # 1000 requests, 20 slow, two a window: no more spread than the binomial
    pooled = [v for values, _ in even for v in values]
    assert 0 < sectioned_half(even, 0.99) == percentile_half(pooled, 0.99)
    assert sectioned_half([(pooled, 0)], 0.99) == percentile_half(pooled, 0.99)  # one section: binomial alone


def test_a_p99_whose_slow_requests_come_in_one_burst_has_a_wider_interval_than_the_binomial():
    from mbtune.serving.traffic import percentile_half, sectioned_half

    even = _windows([2] * 10)
    slow = sorted(v for values, _ in even for v in values if v > 2.0)
    # The same 1000 latencies, the 20 slow all in the first window (one stall), the fast they displace in the
    # second.
    fast = [[v for v in values if v < 2.0] for values, _ in even]
    burst = [(slow + fast[0][18:], 0), (fast[1] + fast[0][:18], 0)] + [(values, 0) for values in fast[2:]]
    pooled = sorted(v for values, _ in burst for v in values)
    assert pooled == sorted(v for values, _ in even for v in values)
    assert sectioned_half(burst, 0.99) > 2 * percentile_half(pooled, 0.99)
    # Rejected requests in one window are a burst too: counted beyond the p99, their window's count alone.
    rejected = [(values[20:], 20) if i == 0 else (values, 0) for i, (values, _) in enumerate(burst)]
    assert sectioned_half(rejected, 0.99) == float("inf")  # the interval's top falls among the rejected
    assert sectioned_half([], 0.99) == float("inf") and sectioned_half([([], 0), ([], 0)], 0.99) == float("inf")


def test_requests_are_placed_in_the_window_of_their_time():
    from mbtune.serving.requests import sections

    found = sections([(10.0, 0.1), (10.99, 0.2), (11.0, 0.3), (12.5, 0.4), (13.2, 0.5)], [11.5, 9.0], 10.0, 13.0, 1.0)
    # Three windows: [10, 11), [11, 12), [12, 13); a time outside the span goes to the nearest.
    assert found == [([0.1, 0.2], 1), ([0.3], 1), ([0.4, 0.5], 0)]


def test_a_poisson_load_runs_past_max_windows_until_it_holds_min_requests():
    from mbtune.serving.records import BatchConfig
    from mbtune.serving.server import LoadPlan

    plan = LoadPlan(rules=BatchConfig(max_batch_size=8), loads=(), budget_s=0.2, window_s=1.0, max_windows=16,
                    min_requests=4000)
    assert plan.window_of("poisson", 50.0) == 2.0  # 100 expected arrivals a window
    assert plan.window_of("poisson", 400.0) == 1.0 and plan.window_of("closed", 4.0) == 1.0
    assert plan.windows_of("poisson", 50.0) == 40  # 40 windows of 2 s: 4000 requests at 50 per s
    assert plan.windows_of("poisson", 91.0) == 40  # windows of 1.1 s, 100 arrivals each
    assert plan.windows_of("poisson", 400.0) == 16  # 6400 requests within max_windows already
    assert plan.windows_of("closed", 4.0) == 16  # a closed loop's pace is its own: the cap alone
    assert plan.requests_of("poisson") == 4000 and plan.requests_of("closed") == 0  # nor held to stop
    assert replace(plan, min_requests=0).windows_of("poisson", 50.0) == 16
