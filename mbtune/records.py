"""Typed, frozen result records: the handshake between modules. No torch import here."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mbtune.recordio import (  # noqa: F401 - the loader's names are part of this module's interface
    MAX_DEPTH,
    Record,
    RecordFieldError,
    load_value,
    short_repr,
    shorten,
)

# 2: a profile may hold `serve` (mbtune serve's report); version 1 files read as having none.
SCHEMA_VERSION = 2

OK, OOM, ERROR, TIMEOUT, KILLED = "ok", "oom", "error", "timeout", "killed"
NONFINITE = "nonfinite"  # the loss was NaN or infinite: the run stopped at that step
STATUSES = (OK, OOM, ERROR, TIMEOUT, KILLED, NONFINITE)

# Whose fault a failed trial or point is (error_kind): the workload's (it ran and failed: an error, OOM, a
# non-finite loss, a hang, a kill), or the harness's (the process died before it ran the trial, e.g. a main
# script without a main guard). Empty when it did not fail.
WORKLOAD_FAULT, HARNESS_FAULT = "workload", "harness"
ERROR_KINDS = ("", WORKLOAD_FAULT, HARNESS_FAULT)
ERROR_TAIL_LINES = 20  # how much of a failure's traceback and stderr a record keeps


@dataclass(frozen=True, kw_only=True)
class DeviceInfo(Record):
    """What a trial ran on, as reported from inside a trial process."""

    backend: str
    name: str
    index: int | None = None
    total_memory_bytes: int = 0
    uuid: str | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    torch_version: str = ""
    num_cpus: int = 0

    @property
    def label(self) -> str:
        return f"{self.backend}:{self.index}" if self.index is not None else self.backend


@dataclass(frozen=True, kw_only=True)
class TrialOutcome(Record):
    """How one isolated trial ended. OOM is data, not an exception."""

    __repr__ = Record.__repr__  # short: the dataclass one prints every trial and action

    @classmethod
    def field_choices(cls, name: str) -> tuple[str, ...] | None:
        return {"status": STATUSES, "error_kind": ERROR_KINDS}.get(name)

    status: str
    batch_size: int
    step_times_s: tuple[float, ...] = ()
    peak_memory_bytes: int | None = None  # CUDA: peak allocated; CPU: peak resident set of the trial process
    peak_reserved_bytes: int | None = None  # CUDA: peak reserved by the caching allocator
    budget_used_bytes: int | None = None  # what the budget caps (CUDA reserved; CPU address space over start-up)
    loss: float | None = None
    wall_s: float = 0.0
    error: str = ""
    device: DeviceInfo | None = None
    error_kind: str = ""  # workload | harness when the trial failed (see ERROR_KINDS)
    error_tail: str = ""  # the last lines of the failure's traceback and of the trial process's stderr
    flops_counted: float | None = None  # training FLOPs per sample, where the trial was asked to count them

    @property
    def ok(self) -> bool:
        return self.status == OK

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

    def batch_for(self, budget_bytes: float) -> float | None:
        """The batch size at which the model reaches the budget (None when it does not grow)."""
        if not self.resolved or self.per_sample_bytes is None or self.per_sample_bytes <= 0:
            return None
        return (budget_bytes - self.fixed_bytes) / self.per_sample_bytes


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
    FRAME_ROWS: ClassVar[str] = 'trials'

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


@dataclass(frozen=True, kw_only=True)
class GpuUsage(Record):
    """What NVML saw on one GPU while a trial ran. kernel_active_pct is NVML's "utilization": the share of
    time any kernel was running, not SM occupancy."""

    uuid: str
    name: str
    num_samples: int
    kernel_active_pct_median: float | None = None
    kernel_active_pct_max: float | None = None
    memory_used_bytes_max: int | None = None
    power_w_median: float | None = None
    sm_clock_mhz_median: float | None = None


@dataclass(frozen=True, kw_only=True)
class IdleShares(Record):
    """The measured bubble split by what each idle moment on a rank was waiting for, as shares of
    ranks x pipeline time (they add up to the measured bubble)."""

    schedule: float  # an input not yet computed upstream, or nothing left this step: fill, drain, imbalance
    transfer: float  # an input already computed on another rank but not yet here: communication
    overhead: float  # no input to wait for: the rank's own time between actions (Python, posting sends)


@dataclass(frozen=True, kw_only=True)
class MachineLoad(Record):
    """How busy the machine was with work other than the point's own while the point ran."""

    load_avg_1m: float | None = None  # os.getloadavg() at the end of the point
    other_cpu_share: float | None = None  # CPU time other processes took, as a share of all cores x wall time
    num_cpus: int = 0
    other_gpu_processes: tuple[str, ...] = ()  # NVML: processes on the point's GPUs that are not the point's
    busy: bool = False
    reason: str = ""  # why it counts as busy


@dataclass(frozen=True, kw_only=True)
class NvmlSummary(Record):
    """NVML samples of the GPUs a trial used, or why there are none ("n/a" in reports)."""

    available: bool
    reason: str = ""
    gpus: tuple[GpuUsage, ...] = ()


# Activation recompute per block (workloads/recompute.py): none keeps every activation, full keeps each
# block's input and runs its forward again in the backward.
RECOMPUTE_MODES = ("none", "full")


@dataclass(frozen=True, kw_only=True)
class SweepPoint(Record):
    """One configuration of the sweep grid."""

    schedule: str
    num_stages: int  # pipeline ranks (one process each; one GPU each on CUDA)
    num_microbatches: int
    grad_accum_steps: int
    micro_batch_size: int
    virtual_stages: int = 1  # stages per rank (looped and V schedules hold several)
    data_parallel_size: int = 1
    recompute: str = "none"  # one of RECOMPUTE_MODES

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.grad_accum_steps * self.data_parallel_size

    @property
    def label(self) -> str:
        replicas = f" dp={self.data_parallel_size}" if self.data_parallel_size > 1 else ""
        recompute = f" recompute={self.recompute}" if self.recompute != "none" else ""
        return (f"{self.schedule} p={self.num_stages} m={self.num_microbatches} "
                f"accum={self.grad_accum_steps} mbs={self.micro_batch_size}{replicas}{recompute}")

    @property
    def num_processes(self) -> int:
        """One process per pipeline rank of every replica."""
        return self.num_stages * self.data_parallel_size


def micro_batch_size_for(global_batch: int, *, num_microbatches: int, grad_accum_steps: int,
                         data_parallel_size: int = 1) -> tuple[int, str | None]:
    """The micro-batch size that makes `global_batch` (see SweepPoint.global_batch) and None; where the
    batch does not divide evenly, the size just below it (at least 1) and why the point cannot run."""
    per_step = num_microbatches * grad_accum_steps * data_parallel_size
    if global_batch % per_step:
        replicas = f" x {data_parallel_size} data-parallel replicas" if data_parallel_size != 1 else ""
        return max(1, global_batch // per_step), (
            f"global batch {global_batch} does not divide into {num_microbatches} micro-batches x "
            f"{grad_accum_steps} accumulation steps{replicas}")
    return global_batch // per_step, None


@dataclass(frozen=True, kw_only=True)
class LrAdvice(Record):
    """The learning rate a global batch implies: the reference batch's scaled by the rule (lr.py)."""

    global_batch: int
    reference_batch: int  # the recipe's global batch, or the smallest one the sweep ran
    rule: str  # linear (SGD family) | square-root (Adam family)
    scale: float  # advised lr / the reference batch's lr
    lr: float | None = None  # the advised learning rate, where the recipe's (--lr) is known


@dataclass(frozen=True, kw_only=True)
class BlockCheck(Record):
    """One block's gradients from the pipeline against the plain model's."""

    block: int
    max_abs_diff: float
    max_rel_diff: float  # max |pipeline - plain| / max |plain| over the block's parameters
    ok: bool


@dataclass(frozen=True, kw_only=True)
class CheckResult(Record):
    """`mbtune check`: one optimizer step through the real pipeline against the plain model on the same
    global batch and seed (check.py). status PASS or FAIL; cause and hint say why it failed."""

    __repr__ = Record.__repr__

    workload: str
    workload_options: dict[str, Any] = field(default_factory=dict)
    device: str
    precision: str
    point: SweepPoint
    status: str  # PASS | FAIL
    loss_pipeline: float
    loss_plain: float
    loss_rel_diff: float
    rtol: float
    atol: float
    blocks: tuple[BlockCheck, ...] = ()
    cause: str = ""
    hint: str = ""

    @property
    def worst(self) -> BlockCheck | None:
        return max(self.blocks, key=lambda b: b.max_rel_diff, default=None)


@dataclass(frozen=True, kw_only=True)
class SkippedPoint(Record):
    """A grid point that was never spawned, and why."""

    point: SweepPoint
    reason: str


@dataclass(frozen=True, kw_only=True)
class TimelineAction(Record):
    """One compute action of a measured step: rank, stage, kind, micro-batch, start and end (s)."""

    rank: int
    stage: int
    kind: str  # forward | backward | backward_input | backward_weight
    microbatch: int
    accum: int
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True)
class TrialResult(Record):
    """What one sweep point measured."""

    __repr__ = Record.__repr__  # short: the dataclass one prints every trial and action

    @classmethod
    def field_choices(cls, name: str) -> tuple[str, ...] | None:
        return {"status": STATUSES, "error_kind": ERROR_KINDS}.get(name)

    point: SweepPoint
    status: str
    error: str = ""
    step_times_s: tuple[float, ...] = ()
    step_time_median_s: float | None = None
    step_time_cv_pct: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    mfu_pct: float | None = None
    bubble_measured: float | None = None
    bubble_theoretical: float | None = None
    excess_idle_pct: float | None = None  # measured minus theoretical bubble: communication and imbalance
    idle: IdleShares | None = None  # the measured bubble split into schedule, transfer and overhead
    peak_memory_bytes: tuple[int | None, ...] = ()  # per pipeline rank (the highest over data-parallel replicas)
    loss: float | None = None
    allreduce_s: float | None = None  # data parallel: median gradient all-reduce per step, inside the step time
    stage_blocks: tuple[tuple[int, ...], ...] = ()  # per model stage, the global blocks it held
    stage_imbalance: float | None = None  # slowest / fastest stage's compute over the measured steps
    nvml: NvmlSummary | None = None
    ran_as: str = ""
    warnings: tuple[str, ...] = ()
    timeline: tuple[TimelineAction, ...] = ()  # the actions of one measured step: the median one
    timeline_step: int = 0  # which measured step the timeline shows (index into step_times_s)
    wall_s: float = 0.0
    # Uncertainty. With repeats (fresh processes each), the range is over the repeats' medians; with one
    # run, over its measured steps. step_times_s then holds every repeat's steps, in order.
    num_repeats: int = 1
    repeat_step_time_medians_s: tuple[float, ...] = ()  # one per repeat that completed
    samples_per_s_min: float | None = None
    samples_per_s_max: float | None = None
    bubble_measured_min: float | None = None
    bubble_measured_max: float | None = None
    load: MachineLoad | None = None
    # CUDA only: per measured step, the device's own time (CUDA events, origin to the step's last work,
    # slowest rank), beside the wall-clock step_times_s it can only be below.
    cuda_step_times_s: tuple[float, ...] = ()
    # Why a failed point failed: the rank named as the root cause, the blocks that rank holds, whose fault
    # it is (see ERROR_KINDS), and the last lines of that rank's traceback and stderr.
    failed_rank: int | None = None
    failed_blocks: tuple[int, ...] = ()
    error_kind: str = ""
    error_tail: str = ""
    flops_counted: float | None = None  # training FLOPs per sample, where this point was asked to count them
    # Under torchrun, per pipeline rank (replica 0), the node it ran on ("node 1 (hostname)"); () on one host.
    rank_nodes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == OK

    def crosses_nodes(self, rank: int, other: int) -> bool:
        """Whether a hand-over between these two pipeline ranks crossed a node boundary."""
        nodes = self.rank_nodes
        return max(rank, other) < len(nodes) and nodes[rank].split(" (")[0] != nodes[other].split(" (")[0]

    @property
    def max_peak_memory_bytes(self) -> int | None:
        known = [b for b in self.peak_memory_bytes if b is not None]
        return max(known) if known else None

    @property
    def compute_per_sample_s(self) -> float | None:
        """Busy compute seconds per sample, all ranks of all replicas together: the arithmetic efficiency of
        the micro-batch size with the bubble and the all-reduce taken out ((median step - all-reduce) x
        processes x (1 - measured bubble) / global batch)."""
        if self.step_time_median_s is None or self.bubble_measured is None:
            return None
        point = self.point
        busy = (self.step_time_median_s - (self.allreduce_s or 0.0)) * point.num_processes
        return busy * (1 - self.bubble_measured) / point.global_batch


@dataclass(frozen=True, kw_only=True)
class Balance(Record):
    """How a sweep split the blocks over stages: by compute-bearing parameters, or by block times measured
    once by a timing pass (forward + backward per block, the last with the loss) at one micro-batch size."""

    by: str = "parameters"  # parameters | time
    block_times_s: tuple[float, ...] = ()
    micro_batch_size: int | None = None  # what the timing pass ran


@dataclass(frozen=True, kw_only=True)
class SweepReport(Record):
    """A whole sweep: every point run, every point skipped, the ranking and the best."""

    __repr__ = Record.__repr__  # short: the dataclass one prints every trial and action
    FRAME_ROWS: ClassVar[str] = 'results'

    workload: str
    workload_options: dict[str, Any] = field(default_factory=dict)
    device: DeviceInfo
    objective: str
    results: tuple[TrialResult, ...] = ()
    skipped: tuple[SkippedPoint, ...] = ()
    ranking: tuple[int, ...] = ()  # indices into results, best first (ok points only)
    pareto: tuple[int, ...] = ()  # indices of the throughput-vs-peak-memory Pareto front
    ties: tuple[int, ...] = ()  # indices whose throughput range overlaps the best's (tied with it)
    global_batches: tuple[int, ...] = ()  # held fixed, rows ranked within each; empty: the global batch varies
    global_batch_default: bool = False  # the global batch is the default rule's (config.default_global_batch)
    tradeoff: tuple[int, ...] = ()  # the best row and its neighbours in micro-batch size (grid.tradeoff)
    padding: tuple[int, ...] = ()  # (best, a row it beats by more micro-batches and fewer accumulation steps)
    # (without, with full recompute) per point that ran both ways (grid.recompute_pairs)
    recompute_pairs: tuple[tuple[int, int], ...] = ()
    balance: Balance = field(default_factory=Balance)
    ceiling: int | None = None  # from the probe, when one ran
    safe_batch: int | None = None
    ceiling_peak_memory_bytes: int | None = None  # the probe's peak at its ceiling, same measure as stage peaks
    warmup_steps: int = 1
    measured_steps: int = 3
    repeats: int = 1
    strategy: str = "grid"  # grid: every runnable point; quick: the simulator picks (the rest are skipped)
    num_grid_points: int = 0
    interrupted: bool = False
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # what the run did that is worth knowing but not a problem
    lr_advice: tuple[LrAdvice, ...] = ()  # one per global batch that ran (lr.py)
    check: CheckResult | None = None  # tune: the best row's update against the plain model's (check.py)
    check_error: str = ""  # why that check could not run, where it could not

    @property
    def best(self) -> TrialResult | None:
        return self.results[self.ranking[0]] if self.ranking else None

    def advice_for(self, global_batch: int) -> LrAdvice | None:
        """The learning-rate advice of one global batch, if the sweep ran it."""
        return next((a for a in self.lr_advice if a.global_batch == global_batch), None)


@dataclass(frozen=True, kw_only=True)
class Metadata(Record):
    """The environment a profile was measured in."""

    mbtune_version: str
    torch_version: str
    python_version: str
    host: str
    platform: str
    command_line: str
    created_at: str
    allocator_settings: dict[str, str] = field(default_factory=dict)


from mbtune.serving.records import ServeReport  # noqa: E402 - it builds on the records above


@dataclass(frozen=True, kw_only=True)
class Profile(Record):
    """The versioned file saved under profiles/<device>/<workload>.json."""

    __repr__ = Record.__repr__  # short: the dataclass one prints every trial and action

    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    schema_version: int
    metadata: Metadata
    probe: ProbeResult | None = None
    sweep: SweepReport | None = None
    serve: ServeReport | None = None
