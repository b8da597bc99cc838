"""ServeConfig: the settings of `mbtune serve`, frozen and keyword-only, validating themselves like the
training configs (probing/config.py, sweeping/config.py), with the checks of settings.py they share."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from mbtune.probing.config import ProbeConfig
from mbtune.settings import (
    DEFAULT_LOAD_TIMEOUT_S,
    DEFAULT_MARGIN,
    DEFAULT_TRIAL_TIMEOUT_S,
    INFER,
    MAX_COUNT,
    MAX_SAMPLES,
    PRECISIONS,
    STRATEGIES,
    bound_load_timeout,
    check_at_most,
    check_timeout,
)
from mbtune.units import parse_device
from mbtune.validation import check_types, require_unique
from mbtune.validation import require as _require

# The inference probe grows no further than this by default: batches this large rarely meet a latency
# budget, and each trial at them takes seconds.
DEFAULT_SERVE_MAX_BATCH = 1024
# Defaults relative to what was measured: queue delays as shares of the p99 budget, Poisson rates as
# shares of the largest configuration's capacity (its largest batch over that batch's service time).
DEFAULT_DELAY_SHARES = (0.0, 0.1)
DEFAULT_RATE_SHARES = (0.2, 0.4, 0.6, 0.75, 0.9, 1.05)
DEFAULT_MAX_BATCH_SIZES = 3  # the largest powers of two whose batch fits in the budget and the safe batch
# A Poisson load measures at least this many requests, running past max_windows where its rate is too low
# to reach them within it: its p99 then rests on its 40 slowest, not the 15 of a 16 s load at 90 per s
# (whose p99 moved by a median 18% between two measurements, bench/serve.py).
DEFAULT_MIN_REQUESTS = 4000
QUEUE_TIMEOUT_BUDGETS = 10  # by default a request waiting ten budgets in the queue is rejected
INFERENCE_STEPS = 2  # forward passes per inference probe trial (the second is warm)


# Settings written as durations ("50ms", or a list of them for queue delays): flag name -> field.
def serve_threads(threads: int | None) -> int:
    """torch threads of the model process: as given, else all cores this process may run on but one (the
    load generator's)."""
    return threads or max(1, len(os.sched_getaffinity(0)) - 1)


def serve_cores(threads: int | None, device: str, *, pin: bool = True,
                allowed: set[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the server's cores, the load generator's): on the CPU, the first serve_threads(threads) of the
    cores this process may run on hold the server (its model threads and its reader), the rest the load
    generator, so neither takes the other's time; ((), ()) where nothing is pinned (not asked, not the
    CPU, or no core would be left for the generator)."""
    cores = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    count = threads or max(1, len(cores) - 1)
    if not pin or device != "cpu" or len(cores) <= count:
        return (), ()
    return tuple(cores[:count]), tuple(cores[count:])


def pin_process(cores: tuple[int, ...]) -> None:
    """Keep this process (and the threads it starts) on `cores`; nothing where they are ()."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


SERVE_EQUIVALENCE = 0.10


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Settings of `mbtune serve`: find the dynamic-batching configuration that sustains the highest
    Poisson rate with its p99 latency within the budget."""

    p99_budget_s: float
    workload: str = "gpt"
    workload_options: tuple[tuple[str, int | float | str], ...] = ()
    device: str = "auto"
    precision: str = "fp32"
    rates: tuple[float, ...] | None = None  # Poisson rates, requests/s (default: shares of the capacity)
    concurrency: tuple[int, ...] = ()  # closed-loop runs too: this many requests always in flight
    max_batch_sizes: tuple[int, ...] | None = None
    queue_delays_s: tuple[float, ...] | None = None
    preferred: tuple[int, ...] = ()  # preferred batch sizes (each configuration keeps those within its max)
    memory_budget_bytes: int | None = None
    margin: float = DEFAULT_MARGIN
    granularity: int = 1
    max_batch: int | None = DEFAULT_SERVE_MAX_BATCH  # the inference probe grows no further
    confirm: int | None = None  # None: the probe's default (1 on the CPU, 2 on CUDA)
    resolution: int | None = None
    threads: int | None = None  # the model process's torch threads (default: all cores but one)
    pin_cpus: bool = True  # on the CPU, the server on its threads' cores and the load generator on the rest
    window_s: float = 1.0  # a measurement window (open loop: long enough for 100 expected arrivals)
    max_windows: int = 16
    min_requests: int = DEFAULT_MIN_REQUESTS  # a Poisson load measures this many before its p99 counts as known
    queue_timeout_s: float | None = None  # default: ten budgets
    strategy: str = "grid"  # grid: every configuration; quick: those the simulator finds promising
    recheck: bool = True  # measure the loads that decide the choice a second time (serving/answers.py to_confirm)
    seed: int = 0
    # Equal is an answer: configurations tied with the best whose highest rates lie within this share of its
    # own are equivalent to it (the default rate ladder's rungs lie about 10% apart: neighbours are equal).
    equivalence: float = SERVE_EQUIVALENCE
    trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    command_line: str = ""

    def __post_init__(self) -> None:
        for name in ("rates", "concurrency", "max_batch_sizes", "queue_delays_s", "preferred"):
            value = getattr(self, name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                object.__setattr__(self, name, (value,))
        check_types(self)
        object.__setattr__(self, "device", parse_device(self.device))
        _require(0 < self.equivalence < 0.5, "equivalence", self.equivalence, "a share between 0% and 50%, e.g. 10%")
        _require(math.isfinite(self.p99_budget_s) and self.p99_budget_s > 0, "p99_budget_s", self.p99_budget_s,
                 "a duration above 0 (e.g. 50ms)")
        _require(self.rates is None or (bool(self.rates) and all(math.isfinite(r) and r > 0 for r in self.rates)),
                 "rates", self.rates, "request rates above 0 per second (e.g. 10,50,100)")
        _require(all(c >= 1 for c in self.concurrency), "concurrency", self.concurrency, "integers >= 1")
        _require(self.max_batch_sizes is None or (bool(self.max_batch_sizes) and min(self.max_batch_sizes) >= 1),
                 "max_batch_sizes", self.max_batch_sizes, "integers >= 1")
        _require(self.queue_delays_s is None or (bool(self.queue_delays_s) and all(
            math.isfinite(d) and d >= 0 for d in self.queue_delays_s)), "queue_delays_s", self.queue_delays_s,
            "durations >= 0 (e.g. 0,2ms,10ms)")
        _require(all(p >= 1 for p in self.preferred), "preferred", self.preferred, "integers >= 1")
        for name in ("rates", "concurrency", "max_batch_sizes", "queue_delays_s", "preferred"):
            require_unique(getattr(self, name), name)
        _require(self.precision in PRECISIONS, "precision", self.precision, " | ".join(PRECISIONS))
        _require(self.threads is None or self.threads >= 1, "threads", self.threads, ">= 1")
        _require(math.isfinite(self.window_s) and self.window_s > 0, "window_s", self.window_s, "seconds above 0")
        _require(self.max_windows >= 3, "max_windows", self.max_windows, "an integer >= 3 (3 windows must agree)")
        _require(self.queue_timeout_s is None or (math.isfinite(self.queue_timeout_s) and self.queue_timeout_s > 0),
                 "queue_timeout_s", self.queue_timeout_s, "seconds above 0")
        _require(self.strategy in STRATEGIES, "strategy", self.strategy, " | ".join(STRATEGIES))
        check_at_most(self, MAX_SAMPLES, "max_batch_sizes", "preferred", "concurrency")
        _require(self.min_requests >= 0, "min_requests", self.min_requests, "an integer >= 0 (0: max_windows alone)")
        check_at_most(self, MAX_COUNT, "max_windows", "min_requests")
        check_timeout(self.trial_timeout_s, "trial_timeout_s")
        check_timeout(self.load_timeout_s, "load_timeout_s")
        bound_load_timeout(self, self.trial_timeout_s)
        self.probe_config()  # the probe's own checks: margin, granularity, max batch, confirm, budget

    def cores(self, device: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the server's cores, the load generator's) on `device` (serve_cores; ((), ()): not pinned)."""
        return serve_cores(self.threads, device, pin=self.pin_cpus)

    @property
    def queue_timeout(self) -> float:
        """Seconds a request may wait in the queue before the server rejects it."""
        return self.queue_timeout_s if self.queue_timeout_s is not None else QUEUE_TIMEOUT_BUDGETS * self.p99_budget_s

    @property
    def delays_s(self) -> tuple[float, ...]:
        """The max queue delays tried: as given, else shares of the budget."""
        if self.queue_delays_s is not None:
            return tuple(sorted(self.queue_delays_s))
        return tuple(round(share * self.p99_budget_s, 6) for share in DEFAULT_DELAY_SHARES)

    def probe_config(self) -> ProbeConfig:
        """The inference ceiling's probe: forward passes only, under the same budget and precision."""
        from mbtune.settings import build, settings_of

        return build(ProbeConfig, {**settings_of(ProbeConfig, self), "steps": INFERENCE_STEPS,
                                   "threads": serve_threads(self.threads), "mode": INFER},
                     command_line=self.command_line)
