"""The queueing simulator: one model instance behind the dynamic batcher (batcher.py's own rules), fed
Poisson arrivals, each batch taking a service time drawn from the measured service-time curve. It predicts
p99 and throughput for configurations and rates that were not run, and --strategy quick runs only the
ones it finds promising.

Service times are the curve's median at the batch size (interpolated between measured sizes) times a
ratio drawn from every measured pass over its size's median, so the simulated batches scatter as the
measured ones did. Two figures are calibrated on the loads that ran (run.py): how much longer a
batch takes under load than alone (the server also receives requests meanwhile), and a constant
per-request overhead (transport, beyond its queue wait and its batch's service).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mbtune.serving.batcher import expired, next_batch
from mbtune.serving.records import BatchConfig, ServiceCurve
from mbtune.serving.traffic import percentile, poisson_arrivals

ServiceSampler = Callable[[int, random.Random], float]  # (batch size, draw) -> seconds
# Simulated requests per prediction: enough that p99 rests on a hundred requests above it.
SIMULATED_REQUESTS = 10_000
WARMUP_SHARE = 0.05  # the first requests, before the queue reaches its steady state, are not counted


@dataclass(frozen=True)
class Simulated:
    """What the simulator predicts for one configuration under one load."""

    throughput_per_s: float
    p50_s: float
    p99_s: float  # inf when more than 1% of requests were rejected
    mean_latency_s: float
    mean_batch_size: float
    mean_queue_s: float
    completed: int
    rejected: int


def curve_sampler(curve: ServiceCurve, scale: float = 1.0) -> ServiceSampler:
    """Service times from a measured curve: the interpolated median times a measured pass/median ratio,
    times `scale` (a batch served under load, beside the requests arriving, takes longer than alone)."""
    ratios = [t / s.median_s for s in curve.times for t in s.times_s if s.median_s > 0] or [1.0]
    mean = sum(ratios) / len(ratios)
    ratios = [r / mean for r in ratios]  # mean 1: `scale` alone says how far the mean moves from the median

    def draw(batch_size: int, rng: random.Random) -> float:
        return curve.median_s(batch_size) * scale * rng.choice(ratios)

    return draw


def simulate(rules: BatchConfig, arrivals_s: Sequence[float], service: ServiceSampler, *,
             overhead_s: float = 0.0, queue_timeout_s: float | None = None, seed: int = 0) -> Simulated:
    """Serve `arrivals_s` (sorted times) through the batcher on one model instance."""
    # Its own stream: drawn from the arrivals' (poisson_arrivals with the same seed), service times would
    # follow the gaps between arrivals, and queues would form less than they do.
    rng = random.Random(seed * 1_000_003 + 17)
    queue: deque[float] = deque()
    latencies: list[float] = []
    waits: list[float] = []
    batches: list[int] = []
    rejected, now, index, total = 0, 0.0, 0, len(arrivals_s)
    counted_from = arrivals_s[int(total * WARMUP_SHARE)] if total else 0.0
    last_end = 0.0
    while index < total or queue:
        while index < total and arrivals_s[index] <= now:
            queue.append(arrivals_s[index])
            index += 1
        while queue and expired(queue[0], now, queue_timeout_s):
            rejected += queue.popleft() >= counted_from
        decision = next_batch(rules, len(queue), queue[0] if queue else None, now)
        if decision.take:
            batch = [queue.popleft() for _ in range(decision.take)]
            end = now + service(decision.take, rng)
            for arrival in batch:
                if arrival >= counted_from:
                    latencies.append(end - arrival + overhead_s)
                    waits.append(now - arrival)
            batches.append(decision.take)
            now = last_end = end
            continue
        upcoming = arrivals_s[index] if index < total else math.inf
        wake = min(upcoming, decision.wait_until if decision.wait_until is not None else math.inf)
        if not math.isfinite(wake):
            break
        now = max(now, wake)
    span = max(last_end - counted_from, 1e-12)
    return Simulated(
        throughput_per_s=len(latencies) / span, p50_s=percentile(latencies, 0.50, rejected=rejected),
        p99_s=percentile(latencies, 0.99, rejected=rejected),
        mean_latency_s=sum(latencies) / len(latencies) if latencies else math.inf,
        mean_batch_size=sum(batches) / len(batches) if batches else 0.0,
        mean_queue_s=sum(waits) / len(waits) if waits else 0.0, completed=len(latencies), rejected=rejected)


def predict(rules: BatchConfig, rate_per_s: float, service: ServiceSampler, *, overhead_s: float = 0.0,
            queue_timeout_s: float | None = None, seed: int = 0, requests: int = SIMULATED_REQUESTS) -> Simulated:
    """The simulator's figures for Poisson arrivals at `rate_per_s`."""
    arrivals = poisson_arrivals(rate_per_s, requests / rate_per_s, seed=seed)
    return simulate(rules, arrivals, service, overhead_s=overhead_s, queue_timeout_s=queue_timeout_s, seed=seed)


def predicted_max_rate(rules: BatchConfig, rates: Sequence[float], service: ServiceSampler, budget_s: float, *,
                       overhead_s: float = 0.0, queue_timeout_s: float | None = None,
                       seed: int = 0) -> tuple[float | None, dict[float, Simulated]]:
    """The highest of `rates` (tried in ascending order, up to the first over the budget) whose predicted
    p99 is within the budget, and the predictions made on the way."""
    best, seen = None, {}
    for rate in sorted(rates):
        seen[rate] = predict(rules, rate, service, overhead_s=overhead_s, queue_timeout_s=queue_timeout_s, seed=seed)
        if seen[rate].p99_s > budget_s:
            break
        best = rate
    return best, seen
