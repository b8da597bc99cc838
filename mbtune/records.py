"""Typed, frozen result records: the handshake between modules. No torch import here."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

SCHEMA_VERSION = 1

OK, OOM, ERROR, TIMEOUT, KILLED = "ok", "oom", "error", "timeout", "killed"
NONFINITE = "nonfinite"  # the loss was NaN or infinite: the run stopped at that step
STATUSES = (OK, OOM, ERROR, TIMEOUT, KILLED, NONFINITE)

# Whose fault a failed trial or point is (error_kind): the workload's (it ran and failed: an error, OOM, a
# non-finite loss, a hang, a kill), or the harness's (the process died before it ran the trial, e.g. a main
# script without a main guard). Empty when it did not fail.
WORKLOAD_FAULT, HARNESS_FAULT = "workload", "harness"
ERROR_KINDS = ("", WORKLOAD_FAULT, HARNESS_FAULT)
ERROR_TAIL_LINES = 20  # how much of a failure's traceback and stderr a record keeps


class Record:
    """Mixin: lossless to_dict/from_dict for frozen dataclasses of plain values, tuples and records."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _dump(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, path: str = "") -> Any:
        """Build the record from plain data (parsed JSON), checking every value against its field's type.
        Unknown keys are ignored (a newer mbtune's additions); anything else that does not fit raises
        RecordFieldError naming the field by its path from `path` (e.g. trials[3].status)."""
        return _load_record(cls, data, path, 0)


MAX_DEPTH = 64  # far deeper than any record nests: deeper input is refused rather than recursed into
_SHORT = 60  # the most of a value an error message echoes


class RecordFieldError(ValueError):
    """A value read into a record does not fit its field; path names the field (trials[3].status)."""

    def __init__(self, path: str, problem: str, *, expected: str = "") -> None:
        self.path = path or "the document"
        self.problem = problem
        self.expected = expected  # what would have fitted, when the value was of the wrong kind
        super().__init__(f"{shorten(self.path, 2 * _SHORT)} {problem}")


def shorten(text: str, limit: int = _SHORT) -> str:
    """text, cut to at most limit characters with an ellipsis in the middle when longer."""
    if len(text) <= limit:
        return text
    keep = max(limit - 3, 2)
    return f"{text[: keep - keep // 3]}...{text[len(text) - keep // 3:]}"


def short_repr(value: Any, limit: int = _SHORT) -> str:
    """value as JSON would spell it (Python's repr where JSON cannot), shortened for an error message."""
    if isinstance(value, str) and len(value) > limit:
        value = value[: 2 * limit]  # no need to encode 100 KB to show 60 characters of it
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(value)
        except (ValueError, RecursionError):
            text = f"a {type(value).__name__}"
    return shorten(text, limit)


def load_value(hint: Any, value: Any, *, path: str) -> Any:
    """value checked against a type hint as from_dict checks a field (lists become tuples); raises
    RecordFieldError naming path."""
    return _load(hint, value, path, 0)


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN: a diverged loss is saved as unknown, so the file stays readable
    return value


def _load_record(cls: Any, data: Any, path: str, depth: int) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise _refused(path, data, "an object")
    hints, kwargs = _hints(cls), {}
    for f in dataclasses.fields(cls):
        where = _join(path, f.name)
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecordFieldError(where, f"is missing, expected {_describe(hints[f.name])}")
            continue
        value = _load(hints[f.name], data[f.name], where, depth + 1)
        choices = _field_choices(cls, f.name)
        if choices is not None and value not in choices:
            raise _refused(where, value, "one of " + ", ".join(c or '""' for c in choices))
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # the record's own checks
        if isinstance(exc, RecordFieldError):
            raise
        raise RecordFieldError(path, f"is refused as {cls.__name__}: {shorten(str(exc), 2 * _SHORT)}") from None


def _field_choices(cls: Any, name: str) -> tuple[str, ...] | None:
    """The fixed set a field's value must come from, read now (not at import) so later additions count."""
    if cls in (TrialOutcome, TrialResult):
        return {"status": STATUSES, "error_kind": ERROR_KINDS}.get(name)
    return None


def _load(hint: Any, value: Any, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise RecordFieldError(path, f"is nested more than {MAX_DEPTH} levels deep")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _load_union(hint, value, path, depth)
    if hint is Any or hint is object:
        return _load_plain(value, path, depth)
    if value is None:
        raise _refused(path, value, _describe(hint))
    if origin is tuple or hint is tuple:
        return _load_tuple(hint, value, path, depth)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise _refused(path, value, "an object")
        key_hint, item_hint = typing.get_args(hint) or (Any, Any)
        for key in value:
            if key_hint is str and not isinstance(key, str):
                raise _refused(f"{path} key", key, "a string")
        return {k: _load(item_hint, v, _join(path, str(k)), depth + 1) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Record):
        return _load_record(hint, value, path, depth)
    return _load_scalar(hint, value, path)


def _load_union(hint: Any, value: Any, path: str, depth: int) -> Any:
    args = typing.get_args(hint)
    if value is None:
        if type(None) in args:
            return None
        raise _refused(path, value, _describe(hint))
    options = [a for a in args if a is not type(None)]
    for option in options:
        try:
            return _load(option, value, path, depth)
        except RecordFieldError as exc:
            # With one option, a field inside the value (or a value nested too deep) is the one to name; a
            # value of the wrong kind is named with all that would have fitted ("an integer or null").
            if len(options) == 1 and (exc.path != (path or "the document") or not exc.expected):
                raise
    raise _refused(path, value, _describe(hint))


def _load_tuple(hint: Any, value: Any, path: str, depth: int) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise _refused(path, value, _describe(hint))
    args = typing.get_args(hint)
    if not args:
        items: tuple = (Any,) * len(value)
    elif len(args) == 2 and args[1] is Ellipsis:
        items = (args[0],) * len(value)
    elif len(args) != len(value):
        raise _refused(path, value, f"a list of {len(args)} items")
    else:
        items = args
    return tuple(_load(h, v, f"{path}[{i}]", depth + 1) for i, (h, v) in enumerate(zip(items, value)))


def _load_scalar(hint: Any, value: Any, path: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
    elif hint is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if math.isfinite(number):
                return number
            raise _refused(path, value, "a finite number")
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        return value  # a hint this loader does not know: taken as given
    raise _refused(path, value, _describe(hint))


def _load_plain(value: Any, path: str, depth: int) -> Any:
    """Free-form content (dict[str, Any] fields): any JSON value, but no NaN and no absurd nesting."""
    if depth > MAX_DEPTH:
        raise RecordFieldError(path, f"is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, float) and not math.isfinite(value):
        raise _refused(path, value, "a finite number")
    if isinstance(value, dict):
        return {k: _load_plain(v, _join(path, str(k)), depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_load_plain(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
    return value


_NAMES = {bool: ("true or false", "booleans"), int: ("an integer", "integers"),
          float: ("a finite number", "finite numbers"), str: ("a string", "strings")}


def _describe(hint: Any, plural: bool = False) -> str:
    """What a hint expects, in words: 'an integer or null', 'a list of strings'."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        words = [_describe(a, plural) for a in args if a is not type(None)] + (["null"] * (type(None) in args))
        return " or ".join(words) if len(words) < 3 else f"{', '.join(words[:-1])} or {words[-1]}"
    if origin is tuple or hint is tuple:
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return "lists" if plural else f"a list of {_describe(args[0], True)}" if len(set(args)) == 1 else "a list"
    if origin is dict or hint is dict or (isinstance(hint, type) and issubclass(hint, Record)):
        return "objects" if plural else "an object"
    if hint in _NAMES:
        return _NAMES[hint][plural]
    return "values" if plural else "a value"


def _refused(path: str, value: Any, expected: str) -> RecordFieldError:
    return RecordFieldError(path, f"is {short_repr(value)}, expected {expected}", expected=expected)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@functools.lru_cache(maxsize=None)
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)

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

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def step_time_s(self) -> float | None:
        """Median step time over the steps after the first (the first builds optimizer state)."""
        measured = sorted(self.step_times_s[1:] or self.step_times_s)
        if not measured:
            return None
        mid = len(measured) // 2
        return measured[mid] if len(measured) % 2 else (measured[mid - 1] + measured[mid]) / 2

    @property
    def samples_per_s(self) -> float | None:
        step = self.step_time_s
        return self.batch_size / step if self.ok and step else None


@dataclass(frozen=True, kw_only=True)
class MemoryModel(Record):
    """bytes = fixed_bytes + per_sample_bytes x batch, fitted to the peaks of the trials that ran."""

    fixed_bytes: float
    per_sample_bytes: float
    fit_error_pct: float
    num_points: int
    # The slope's standard error over the fitted trials. A slope not clearly above it (memory that barely
    # grows with the batch over these trials) leaves the model unresolved: no per-sample memory at all.
    per_sample_stderr_bytes: float | None = None
    resolved: bool = True

    def predict_bytes(self, batch_size: int) -> float:
        return self.fixed_bytes + self.per_sample_bytes * batch_size

    def batch_for(self, budget_bytes: float) -> float | None:
        """The batch size at which the model reaches the budget (None when it does not grow)."""
        if not self.resolved or self.per_sample_bytes <= 0:
            return None
        return (budget_bytes - self.fixed_bytes) / self.per_sample_bytes


@dataclass(frozen=True, kw_only=True)
class ProbeResult(Record):
    """Everything a probe found, trial by trial."""

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

    @property
    def stopped_at_max_batch(self) -> bool:
        return self.first_failing is None


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

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.grad_accum_steps * self.data_parallel_size

    @property
    def label(self) -> str:
        return (f"{self.schedule} p={self.num_stages} m={self.num_microbatches} "
                f"accum={self.grad_accum_steps} mbs={self.micro_batch_size}")


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
    peak_memory_bytes: tuple[int | None, ...] = ()  # per rank
    loss: float | None = None
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

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def max_peak_memory_bytes(self) -> int | None:
        known = [b for b in self.peak_memory_bytes if b is not None]
        return max(known) if known else None


@dataclass(frozen=True, kw_only=True)
class SweepReport(Record):
    """A whole sweep: every point run, every point skipped, the ranking and the best."""

    workload: str
    workload_options: dict[str, Any] = field(default_factory=dict)
    device: DeviceInfo
    objective: str
    results: tuple[TrialResult, ...] = ()
    skipped: tuple[SkippedPoint, ...] = ()
    ranking: tuple[int, ...] = ()  # indices into results, best first (ok points only)
    pareto: tuple[int, ...] = ()  # indices of the throughput-vs-peak-memory Pareto front
    ties: tuple[int, ...] = ()  # indices whose throughput range overlaps the best's (tied with it)
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

    @property
    def best(self) -> TrialResult | None:
        return self.results[self.ranking[0]] if self.ranking else None


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


@dataclass(frozen=True, kw_only=True)
class Profile(Record):
    """The versioned file saved under profiles/<device>/<workload>.json."""

    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    schema_version: int
    metadata: Metadata
    probe: ProbeResult | None = None
    sweep: SweepReport | None = None
