"""The load generator's pure half: Poisson arrivals, percentiles with lost requests, stable windows."""

from __future__ import annotations

import math
import statistics

import pytest

from mbtune.serving.load import Window, percentile, poisson_arrivals, spread_of, stable, window_of


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
