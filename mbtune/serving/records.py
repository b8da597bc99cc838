"""What `mbtune serve` measured, as typed frozen records (saved in the profile's `serve` section). No
torch import here."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from mbtune.probing.records import ProbeResult
from mbtune.recordio import Record
from mbtune.records import Decision, DeviceInfo, MachineLoad, frame, pct
from mbtune.serving.traffic import LOAD_KINDS, POISSON
from mbtune.validation import require


@dataclass(frozen=True, kw_only=True)
class BatchConfig(Record):
    """One dynamic-batching configuration (the rules batcher.py decides by)."""

    max_batch_size: int
    max_queue_delay_s: float = 0.0
    preferred: tuple[int, ...] = ()  # preferred batch sizes, each at most max_batch_size

    def __post_init__(self) -> None:
        require(self.max_batch_size >= 1, "max_batch_sizes", self.max_batch_size, "integers >= 1")
        require(math.isfinite(self.max_queue_delay_s) and self.max_queue_delay_s >= 0, "queue_delays_s",
                self.max_queue_delay_s, "durations >= 0")
        require(all(1 <= p <= self.max_batch_size for p in self.preferred), "preferred", self.preferred,
                f"sizes from 1 to the max batch size ({self.max_batch_size})")
        object.__setattr__(self, "preferred", tuple(sorted(set(self.preferred))))

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes sent without waiting: the preferred ones, else the max batch size alone."""
        return self.preferred or (self.max_batch_size,)

    @property
    def label(self) -> str:
        text = f"max {self.max_batch_size}, delay {self.max_queue_delay_s * 1e3:g} ms"
        return text + (f", preferred {','.join(map(str, self.preferred))}" if self.preferred else "")


@dataclass(frozen=True, kw_only=True)
class ServiceTime(Record):
    """The latency of one batch of a size: warm forward passes in a fresh process."""

    batch_size: int
    times_s: tuple[float, ...]  # every timed pass, in order

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    @property
    def max_s(self) -> float:
        return max(self.times_s)


@dataclass(frozen=True, kw_only=True)
class TensorSignature(Record):
    """One input or output of the served model: its dtype (torch's name, e.g. int64) and its dimensions
    after the batch's."""

    dtype: str
    dims: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ServiceCurve(Record):
    """Service time by batch size, and why it stops where it does."""

    times: tuple[ServiceTime, ...]
    threads: int
    stopped: str = ""  # why larger sizes were not measured ("" when every size asked for was)
    # The model's tensors, as the serving files declare them (from one forward pass of one sample).
    inputs: tuple[TensorSignature, ...] = ()
    outputs: tuple[TensorSignature, ...] = ()

    def at(self, batch_size: int) -> ServiceTime | None:
        return next((t for t in self.times if t.batch_size == batch_size), None)

    def median_s(self, batch_size: int) -> float:
        """The median service time of a batch of this size, interpolated linearly between the measured
        sizes (and extrapolated along the last two beyond them)."""
        points = sorted((t.batch_size, t.median_s) for t in self.times)
        if not points:
            raise ValueError("an empty service curve")
        if len(points) == 1:
            return points[0][1] * batch_size / points[0][0] if batch_size > points[0][0] else points[0][1]
        if batch_size <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if batch_size <= x1:
                return y0 + (y1 - y0) * (batch_size - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = points[-2:]
        return y1 + (y1 - y0) * (batch_size - x1) / (x1 - x0)

    def capacity_per_s(self, max_batch_size: int) -> float:
        """The most requests a second this server can serve with batches of at most this size."""
        sizes = [t.batch_size for t in self.times if t.batch_size <= max_batch_size] or [max_batch_size]
        return max(size / self.median_s(size) for size in {*sizes, max_batch_size})


@dataclass(frozen=True, kw_only=True)
class LoadResult(Record):
    """One configuration under one load: every request's end-to-end latency, summarised."""

    @classmethod
    def field_choices(cls, name: str) -> tuple[str, ...] | None:
        return {"kind": LOAD_KINDS}.get(name)

    config: BatchConfig
    kind: str = POISSON  # poisson: open loop at rate_per_s | closed: `concurrency` requests always in flight
    rate_per_s: float | None = None
    concurrency: int | None = None
    sent: int = 0
    completed: int = 0
    rejected: int = 0  # waited past the queue timeout: the server dropped them
    timed_out: int = 0  # no answer by the end of the run
    not_sent: int = 0  # due while the figures were taken, but the generator fell behind and never sent them
    duration_s: float = 0.0  # the span the figures cover
    throughput_per_s: float = 0.0
    p50_s: float | None = None  # None: the percentile falls among the dropped requests
    p90_s: float | None = None
    p99_s: float | None = None
    p99_ci_half_pct: float | None = None  # its 95% interval's half width, % of it (order statistics; None: inf)
    mean_latency_s: float | None = None
    mean_batch_size: float = 0.0
    queue_share: float = 0.0  # of the mean latency, the share spent queued before the batch began
    mean_service_s: float | None = None  # the server's time from a request's batch beginning to its end
    windows: int = 0
    stable: bool = False
    window_spread: float | None = 0.0  # the largest share a window's figures strayed from their mean (None: inf)
    predicted_p99_s: float | None = None  # the simulator's, calibrated on the service-time curve

    @property
    def lost(self) -> int:
        return self.rejected + self.timed_out + self.not_sent

    def meets(self, budget_s: float) -> bool:
        """p99 within the budget (requests lost count as over it)."""
        return self.p99_s is not None and self.p99_s <= budget_s

    @property
    def label(self) -> str:
        return f"{self.rate_per_s:g}/s" if self.kind == POISSON else f"concurrency {self.concurrency}"


@dataclass(frozen=True, kw_only=True)
class ConfigRun(Record):
    """The loads one server process ran with one configuration, in the order it ran them."""

    config: BatchConfig
    loads: tuple[LoadResult, ...] = ()
    error: str = ""  # why the server or the load generator failed ("" when they did not)
    machine: MachineLoad | None = None  # how busy the machine was with other work meanwhile
    cores: tuple[tuple[int, ...], ...] = ()  # (the server's, the load generator's), as each process saw it


@dataclass(frozen=True, kw_only=True)
class ConfigAnswer(Record):
    """A configuration's answer: the highest Poisson rate whose p99 stayed within the budget."""

    config: BatchConfig
    max_rate_per_s: float | None  # measured; None when no rate it ran met the budget (or none ran)
    p99_at_max_s: float | None = None
    throughput_at_max_per_s: float | None = None
    first_failing_rate_per_s: float | None = None  # the lowest rate measured over the budget
    predicted_max_rate_per_s: float | None = None  # the simulator's, over the same rates
    ran: bool = True  # False: only simulated (--strategy quick did not pick it)
    stable: bool = True  # the measurement at max_rate_per_s was stable
    note: str = ""
    # Where the configuration's true highest rate lies, on the evidence: from max_rate_per_s up to the first
    # rate over the budget, each widened one rung of the rates where its p99 was within the noise of the
    # budget (a pass or a failure that a second measurement could turn); None above: no rate failed.
    bracket_low_per_s: float = 0.0
    bracket_high_per_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class SimulatorCheck(Record):
    """The queueing simulator against what was measured: |predicted - measured| / measured p99."""

    points: int
    misses: int = 0  # loads where one of measured and predicted lost over 1% of requests and the other not
    median_error_pct: float | None
    worst_error_pct: float | None
    overhead_s: float  # per request, calibrated: measured latency beyond queue + service (transport)
    service_scale: float = 1.0  # calibrated: a batch's service under load over the curve's (contention)
    noise_pct: float | None = None  # spread of the service curve's passes (median of max/min - 1 per size)


@dataclass(frozen=True, kw_only=True)
class ServeReport(Record):
    """Everything `mbtune serve` found."""

    __repr__ = Record.__repr__
    def to_frame(self) -> Any:
        """A pandas DataFrame shaped for analysis."""
        budget = self.p99_budget_s
        return frame({
            "max_batch_size": load.config.max_batch_size, "max_queue_delay_s": load.config.max_queue_delay_s,
            "preferred": ",".join(map(str, load.config.preferred)), "kind": load.kind, "rate_per_s": load.rate_per_s,
            "concurrency": load.concurrency, "throughput_per_s": load.throughput_per_s, "p50_s": load.p50_s,
            "p90_s": load.p90_s, "p99_s": load.p99_s, "predicted_p99_s": load.predicted_p99_s,
            "mean_batch_size": load.mean_batch_size, "queue_pct": pct(load.queue_share), "sent": load.sent,
            "completed": load.completed, "rejected": load.rejected, "timed_out": load.timed_out,
            "stable": load.stable, "windows": load.windows, "meets_budget": load.meets(budget),
        } for load in self.loads)

    workload: str
    workload_options: dict[str, Any] = field(default_factory=dict)
    device: DeviceInfo
    precision: str = "fp32"
    p99_budget_s: float
    ceiling: ProbeResult  # the inference ceiling: one forward pass, isolated trials, margin applied
    curve: ServiceCurve
    runs: tuple[ConfigRun, ...] = ()
    answers: tuple[ConfigAnswer, ...] = ()
    best: int | None = None  # index into answers: the configuration that sustains the highest rate
    ties: tuple[int, ...] = ()  # answers whose bracket overlaps the best one's: on this evidence, tied with it
    decision: Decision | None = None  # how decided the choice is (serving/answers.py decide)
    strategy: str = "grid"
    simulator: SimulatorCheck | None = None
    skipped: tuple[str, ...] = ()  # configurations and rates not run, each with its reason
    warnings: tuple[str, ...] = ()
    threads: int = 1
    interrupted: bool = False
    queue_timeout_s: float | None = None  # a request waiting longer was rejected
    # Requests/s the load generator carried here with a model that answers at once, measured before the
    # default rates were chosen (None: --rates given, or not measured).
    generator_capacity_per_s: float | None = None

    def __post_init__(self) -> None:
        require(self.best is None or 0 <= self.best < len(self.answers), "best", self.best,
                f"an index into the {len(self.answers)} answers, or nothing")

    @property
    def loads(self) -> tuple[LoadResult, ...]:
        return tuple(load for run in self.runs for load in run.loads)

    @property
    def winner(self) -> ConfigAnswer | None:
        return self.answers[self.best] if self.best is not None else None


def finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
