"""The probe's records: one trial's outcome, the memory model fitted to them, and the probe's result."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from mbtune.probing.confirm import ConfirmResult
from mbtune.recordio import (
    Record,
)
from mbtune.records import OK, DeviceInfo, MachineState, Outcome, frame


@dataclass(frozen=True, kw_only=True)
class TrialOutcome(Outcome):
    """How one isolated trial ended. OOM is data, not an exception."""

    status: str
    batch_size: int
    step_times_s: tuple[float, ...] = ()
    peak_memory_bytes: int | None = None  # CUDA: peak allocated; CPU: peak live tensor bytes (device/tensor_bytes.py)
    peak_reserved_bytes: int | None = None  # CUDA: peak reserved by the caching allocator; CPU: peak resident set
    budget_used_bytes: int | None = None  # what the budget caps (CUDA reserved; CPU live tensor bytes)
    loss: float | None = None
    wall_s: float = 0.0
    error: str = ""
    device: DeviceInfo | None = None
    error_kind: str = ""  # workload | harness when the trial failed (see ERROR_KINDS)
    error_tail: str = ""  # the last lines of the failure's traceback and of the trial process's stderr
    # A trial of the user's own command: its wall time less the steps measured after the first (the script's
    # start-up, its first step and its end); wall_s - startup_s is the steps'.
    startup_s: float | None = None
    # A trial of the user's own command: the evaluation passes and checkpoints its steps reached (the most of any
    # of its processes; probing/memory_watch.py); None where they were not watched.
    num_evaluations: int | None = None
    num_checkpoints: int | None = None
    # An out-of-memory trial whose error named them (device/oom_figures.py): the bytes the failing allocation
    # asked for, and those the budget held when it did (CPU: live tensor bytes; CUDA: what the caching
    # allocator reserved, which the per-process memory fraction caps).
    oom_requested_bytes: int | None = None
    oom_live_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def oom_need_bytes(self) -> int | None:
        """What the budget would have had to hold at the failing allocation (live + requested): a lower bound
        of this batch size's peak; None where the error did not name both."""
        if self.ok or self.oom_requested_bytes is None or self.oom_live_bytes is None:
            return None
        return self.oom_requested_bytes + self.oom_live_bytes

    @property
    def step_time_s(self) -> float | None:
        """Median step time over the steps after the first (the first builds optimizer state)."""
        measured = self.step_times_s[1:] or self.step_times_s
        return statistics.median(measured) if measured else None

    @property
    def samples_per_s(self) -> float | None:
        step = self.step_time_s
        return self.batch_size / step if self.ok and step else None


@dataclass(frozen=True, kw_only=True)
class MemoryModel(Record):
    """bytes = fixed_bytes + per_sample_bytes x batch, fitted to the peaks of the trials that ran."""

    fixed_bytes: float
    # None when the model is not resolved: the fitted slope then says nothing, so none is kept.
    per_sample_bytes: float | None = None
    fit_error_pct: float
    num_points: int
    # The slope's standard error over the fitted trials. A slope not clearly above it (memory that barely
    # grows with the batch over these trials) leaves the model unresolved: no per-sample memory at all.
    per_sample_stderr_bytes: float | None = None
    resolved: bool = True

    def __post_init__(self) -> None:
        if not self.resolved:  # a profile saved before unresolved models dropped their slope
            object.__setattr__(self, "per_sample_bytes", None)
        elif self.per_sample_bytes is None:
            raise ValueError("a resolved memory model needs its per_sample_bytes")

    def batch_for(self, memory_budget_bytes: float) -> float | None:
        """The batch size at which the model reaches the budget (None when it does not grow)."""
        if not self.resolved or self.per_sample_bytes is None or self.per_sample_bytes <= 0:
            return None
        return (memory_budget_bytes - self.fixed_bytes) / self.per_sample_bytes


@dataclass(frozen=True, kw_only=True)
class CeilingPrediction(Record):
    """Where the fake steps put the ceiling, before any trial."""

    ceiling: int  # the largest size (a multiple of the granularity) whose predicted peak fits the budget
    peak_bytes: int  # its predicted peak
    fixed_bytes: float  # the line the sizes gave: fixed + per_sample x batch
    per_sample_bytes: float


@dataclass(frozen=True, kw_only=True)
class RecomputeCeiling(Record):
    """What the probe found with activation recompute set otherwise than its main search (ProbeResult's
    own fields), searched the same way right after it."""

    recompute: str  # one of RECOMPUTE_MODES
    ceiling: int
    first_failing: int | None
    safe_batch: int
    safe_batch_verified: bool
    trials: int
    peak_memory_bytes: int | None = None  # at the ceiling


@dataclass(frozen=True, kw_only=True)
class ProbeResult(Record):
    """Everything a probe found, trial by trial."""

    __repr__ = Record.__repr__  # short: the dataclass one prints every trial and action
    def to_frame(self) -> Any:
        """A pandas DataFrame shaped for analysis."""
        return frame({
            "batch_size": t.batch_size, "status": t.status, "peak_memory_bytes": t.peak_memory_bytes,
            "peak_reserved_bytes": t.peak_reserved_bytes, "budget_used_bytes": t.budget_used_bytes,
            "step_time_s": t.step_time_s, "samples_per_s": t.samples_per_s, "wall_s": t.wall_s,
            "startup_s": t.startup_s, "error": t.error,
        } for t in self.trials)

    workload: str
    workload_options: dict[str, Any] = field(default_factory=dict)
    device: DeviceInfo
    trials: tuple[TrialOutcome, ...]
    ceiling: int
    first_failing: int | None  # None when the probe stopped at max_batch
    margin: float
    granularity: int
    safe_batch: int
    safe_batch_verified: bool
    memory_budget_bytes: int | None
    memory_model: MemoryModel | None
    precision: str = "fp32"
    optimizer: str = "adamw"
    num_parameters: int | None = None
    flops_per_sample: float | None = None  # training FLOPs (forward + backward) per sample
    max_batch: int | None = None  # the search settings, so qualification can repeat them
    confirm: int = 2
    steps: int = 2
    resolution: int | None = None  # the search stopped once [ceiling, first_failing) was this narrow
    safe_batch_first: int | None = None  # the safe batch the margin gave, before any step down
    warnings: tuple[str, ...] = ()
    recompute: str = "none"  # activation recompute of the trials above (one of RECOMPUTE_MODES)
    recompute_ceilings: tuple[RecomputeCeiling, ...] = ()  # the other modes asked for
    mode: str = "train"  # train: full training steps | infer: forward passes only (mbtune serve's ceiling)
    predicted: CeilingPrediction | None = None  # where the trial's steps on fake tensors put the ceiling
    command: tuple[str, ...] = ()  # the user's own training command that was probed (with {batch}), if one was
    steps_from_output: str | None = None  # the line that counted its steps, where it was not torch's optimizer
    machine_state: MachineState | None = None  # the machine's state while the trials ran
    # The command run at the safe batch for --confirm-duration after the search (its memory over time, the
    # evaluation passes and checkpoints it went through), where one was asked for.
    confirmed: ConfirmResult | None = None

    @property
    def stopped_at_max_batch(self) -> bool:
        return self.first_failing is None

    def ceiling_with(self, recompute: str) -> RecomputeCeiling | None:
        """The probe's answer with this recompute mode (the main search's too), or None if none ran."""
        if recompute == self.recompute:
            peaks = [t.peak_memory_bytes for t in self.trials if t.ok and t.batch_size == self.ceiling
                     and t.peak_memory_bytes]
            return RecomputeCeiling(recompute=recompute, ceiling=self.ceiling, first_failing=self.first_failing,
                                    safe_batch=self.safe_batch, safe_batch_verified=self.safe_batch_verified,
                                    trials=len(self.trials), peak_memory_bytes=max(peaks) if peaks else None)
        return next((c for c in self.recompute_ceilings if c.recompute == recompute), None)
