"""The dynamic batcher forms the batches its rules say, on a deterministic clock (the simulator drives
the same decision function the real server does)."""

from __future__ import annotations

import math

import pytest

from mbtune.errors import ConfigError
from mbtune.serving.batcher import Decision, expired, next_batch
from mbtune.serving.records import BatchConfig
from mbtune.serving.simulate import simulate


def rules(max_batch_size=8, delay_s=0.0, preferred=()):
    return BatchConfig(max_batch_size=max_batch_size, max_queue_delay_s=delay_s, preferred=preferred)


def test_an_empty_queue_waits_for_the_next_request():
    assert next_batch(rules(), 0, None, 5.0) == Decision()


def test_a_full_queue_sends_the_max_batch_size_at_once():
    assert next_batch(rules(8, delay_s=1.0), 20, 0.0, 0.0) == Decision(take=8)


def test_short_of_the_max_it_waits_until_the_oldest_request_has_waited_the_delay():
    assert next_batch(rules(8, delay_s=0.010), 3, 2.000, 2.004) == Decision(wait_until=pytest.approx(2.010))
    assert next_batch(rules(8, delay_s=0.010), 3, 2.000, 2.010) == Decision(take=3)


def test_a_zero_delay_sends_whatever_is_queued():
    assert next_batch(rules(8, delay_s=0.0), 3, 1.0, 1.0) == Decision(take=3)


def test_the_largest_preferred_size_the_queue_fills_goes_at_once():
    preferring = rules(16, delay_s=1.0, preferred=(4, 8))
    assert next_batch(preferring, 11, 0.0, 0.0) == Decision(take=8)
    assert next_batch(preferring, 5, 0.0, 0.0) == Decision(take=4)
    assert next_batch(preferring, 3, 0.0, 0.0).take == 0  # no preferred size yet: wait for the delay
    assert next_batch(preferring, 3, 0.0, 1.0) == Decision(take=3)
    assert next_batch(preferring, 40, 0.0, 0.0) == Decision(take=8)  # preferred, even with 16 waiting


def test_once_the_delay_has_passed_everything_queued_goes_whatever_the_preferred_sizes():
    """Triton's rule: a preferred size is formed only while the oldest request is within its delay."""
    preferring = rules(16, delay_s=0.010, preferred=(4, 8))
    assert next_batch(preferring, 11, 0.0, 0.010) == Decision(take=11)
    assert next_batch(preferring, 40, 0.0, 0.020) == Decision(take=16)


def test_preferred_sizes_above_the_max_are_refused():
    with pytest.raises(ConfigError, match="preferred"):
        rules(8, preferred=(16,))
    with pytest.raises(ConfigError, match="max_batch_sizes"):
        rules(0)


def test_a_request_past_the_queue_timeout_has_expired():
    assert expired(0.0, 2.5, 2.0) and not expired(0.0, 1.5, 2.0) and not expired(0.0, 1e9, None)


class Recorder:
    """A service time sampler that records the batch sizes it was asked for."""

    def __init__(self, seconds):
        self.seconds, self.sizes = seconds, []

    def __call__(self, size, rng):
        self.sizes.append(size)
        return self.seconds


def test_on_a_fake_clock_requests_gather_for_the_delay_then_go_together():
    """Arrivals at 0, 1 and 2 ms, max 4, delay 10 ms, a batch takes 5 ms: one batch of 3 at 10 ms, done at
    15 ms; the next arrival (at 30 ms) goes alone 10 ms after it came."""
    service = Recorder(0.005)
    result = simulate(rules(4, delay_s=0.010), [0.0, 0.001, 0.002, 0.030], service)
    assert service.sizes == [3, 1]
    assert result.completed == 4 and result.mean_batch_size == 2.0
    assert result.p50_s == pytest.approx(0.014) and result.p99_s == pytest.approx(0.015)  # 15, 14, 13 and 15 ms


def test_on_a_fake_clock_a_busy_model_gathers_what_arrives_while_it_works():
    """Delay 0: the first request goes alone; the four that arrive during its 10 ms batch go next, as one."""
    service = Recorder(0.010)
    simulate(rules(8, delay_s=0.0), [0.0, 0.001, 0.002, 0.003, 0.004], service)
    assert service.sizes == [1, 4]


def test_on_a_fake_clock_a_full_queue_is_cut_into_max_size_batches_in_order():
    service = Recorder(0.001)
    arrivals = [0.0] * 10
    simulate(rules(4, delay_s=0.050), arrivals, service)
    assert service.sizes == [4, 4, 2]  # the last two wait out the delay


def test_requests_past_the_queue_timeout_are_rejected_and_count_against_p99():
    service = Recorder(1.0)  # one slow batch: everything behind it waits a second
    result = simulate(rules(1), [0.001 * i for i in range(200)], service, queue_timeout_s=0.5)
    assert result.rejected > 100
    assert math.isinf(result.p99_s)
