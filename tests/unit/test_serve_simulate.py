"""The queueing simulator reproduces textbook queues: M/D/1 and M/M/1 with one request a batch, and a
batch-service queue at saturation."""

from __future__ import annotations

import math
import random

import pytest

from mbtune.serving.records import BatchConfig, ServiceCurve, ServiceTime
from mbtune.serving.simulate import curve_sampler, predict, predicted_max_rate, simulate
from mbtune.serving.traffic import poisson_arrivals

ONE_AT_A_TIME = BatchConfig(max_batch_size=1)


def test_m_d_1_mean_wait_is_pollaczek_khinchine():
    """Poisson arrivals, a fixed 1 ms service, utilisation 0.6: Wq = rho D / (2 (1 - rho)) = 0.75 ms."""
    rate, service_s = 600.0, 0.001
    rho = rate * service_s
    result = simulate(ONE_AT_A_TIME, poisson_arrivals(rate, 400.0, seed=3), lambda n, rng: service_s)
    assert result.mean_queue_s == pytest.approx(rho * service_s / (2 * (1 - rho)), rel=0.05)
    assert result.mean_latency_s == pytest.approx(service_s + rho * service_s / (2 * (1 - rho)), rel=0.03)
    assert result.throughput_per_s == pytest.approx(rate, rel=0.02)


def test_m_m_1_time_in_system_is_exponential_so_its_p99_is_ln_100_over_mu_minus_lambda():
    rate, mu = 500.0, 1000.0
    result = simulate(ONE_AT_A_TIME, poisson_arrivals(rate, 400.0, seed=5),
                      lambda n, rng: rng.expovariate(mu), seed=5)
    assert result.p99_s == pytest.approx(math.log(100) / (mu - rate), rel=0.08)
    assert result.mean_latency_s == pytest.approx(1 / (mu - rate), rel=0.05)


def test_a_saturated_batch_server_serves_full_batches_at_its_capacity():
    """Max batch 8, a batch takes 10 ms whatever its size: capacity 800/s. Offered 2000/s, it serves full
    batches at 800/s and the rest wait past the queue timeout."""
    result = simulate(BatchConfig(max_batch_size=8), poisson_arrivals(2000.0, 20.0, seed=1), lambda n, rng: 0.010,
                      queue_timeout_s=0.5)
    assert result.mean_batch_size == pytest.approx(8.0, abs=0.05)
    assert result.throughput_per_s == pytest.approx(800.0, rel=0.03)
    assert result.rejected > 0 and math.isinf(result.p99_s)


def test_under_light_load_a_batch_server_with_no_delay_mostly_sends_single_requests():
    result = simulate(BatchConfig(max_batch_size=8), poisson_arrivals(10.0, 500.0, seed=2), lambda n, rng: 0.001)
    assert 1.0 <= result.mean_batch_size < 1.05
    assert result.p50_s == pytest.approx(0.001)


def curve(points):
    return ServiceCurve(times=tuple(ServiceTime(batch_size=b, times_s=(s,)) for b, s in points), threads=1)


def test_the_curve_interpolates_between_measured_sizes_and_extends_past_them():
    measured = curve([(1, 0.002), (4, 0.005), (8, 0.009)])
    assert measured.median_s(2) == pytest.approx(0.003)
    assert measured.median_s(16) == pytest.approx(0.017)
    assert measured.capacity_per_s(8) == pytest.approx(8 / 0.009)
    draw = curve_sampler(measured, scale=2.0)
    assert draw(4, random.Random(0)) == pytest.approx(0.010)  # one pass per size: the ratio is 1


def test_the_predicted_max_rate_is_the_highest_rate_within_the_budget():
    service = curve_sampler(curve([(1, 0.004), (8, 0.012)]))
    best, seen = predicted_max_rate(BatchConfig(max_batch_size=8), [50, 200, 400, 2000], service, 0.05)
    assert best == 400 and seen[2000].p99_s > 0.05
    assert all(seen[rate].p99_s <= 0.05 for rate in (50, 200, 400))
    assert predict(BatchConfig(max_batch_size=8), 50, service).throughput_per_s == pytest.approx(50, rel=0.05)


def test_quick_measures_the_two_configurations_the_simulator_predicts_sustain_the_most():
    from mbtune.serving.config import ServeConfig
    from mbtune.serving.run import _to_run

    service = curve_sampler(curve([(1, 0.004), (4, 0.006), (16, 0.012)]))
    rules = [BatchConfig(max_batch_size=size) for size in (1, 4, 16)]  # capacity 250, 667 and 1333 per second
    skipped = []
    plan = _to_run(ServeConfig(p99_budget_s=0.05, device="cpu", strategy="quick"), rules, (100.0, 500.0, 1000.0),
                   service, skipped)
    assert [rule.max_batch_size for rule, _ in plan] == [16, 4]
    assert all(rates == (100.0, 500.0, 1000.0) for _, rates in plan)
    assert len(skipped) == 1 and skipped[0].startswith("max 1, delay 0 ms: not run (--strategy quick")
    everything = _to_run(ServeConfig(p99_budget_s=0.05, device="cpu"), rules, (100.0,), service, [])
    assert [rule for rule, _ in everything] == rules


def test_the_default_grid_takes_the_largest_powers_of_two_within_half_the_budget_and_skips_what_cannot_run():
    import dataclasses

    from mbtune.serving.config import ServeConfig
    from mbtune.serving.run import _configurations
    from tests.unit.test_records import sample_probe

    probe = dataclasses.replace(sample_probe(), ceiling=100, safe_batch=85)
    measured = curve([(1, 0.002), (2, 0.004), (4, 0.008), (8, 0.016), (16, 0.032), (32, 0.064)])
    chosen = _configurations(ServeConfig(p99_budget_s=0.05, device="cpu"), probe, measured, [])
    assert sorted({r.max_batch_size for r in chosen}) == [2, 4, 8]  # 16 takes 32 ms, over half of 50
    assert sorted({r.max_queue_delay_s for r in chosen}) == [0.0, 0.005]
    skipped = []
    given = ServeConfig(p99_budget_s=0.05, device="cpu", max_batch_sizes=(8, 32, 128), queue_delays_s=(0.001,),
                        preferred=(4, 16))
    chosen = _configurations(given, probe, measured, skipped)
    assert [(r.max_batch_size, r.preferred) for r in chosen] == [(8, (4,))]
    assert any("32: one batch takes 64.0 ms" in s for s in skipped)
    assert any("128: above the inference safe batch (85)" in s for s in skipped)
