"""Frozen, keyword-only configs that validate themselves and name the field, value and valid range."""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

from mbtune.checks import check_types, require_unique
from mbtune.checks import require as _require
from mbtune.errors import ConfigError
from mbtune.records import RECOMPUTE_MODES, SweepPoint, micro_batch_size_for

if TYPE_CHECKING:
    from mbtune.pipeline.torchrun import Nodes

PRECISIONS = ("fp32", "bf16", "fp16")
# What a trial runs: full training steps, or forward passes in eval mode under torch.inference_mode.
TRAIN, INFER = "train", "infer"
MODES = (TRAIN, INFER)
OPTIMIZERS = ("adamw", "sgd")
# The learning rate each optimizer trains with when --lr is not given (memory and speed do not depend on it).
DEFAULT_LR = {"adamw": 1e-4, "sgd": 1e-3}


def lr_for(optimizer: str, lr: float | None) -> float:
    """The learning rate a run trains with: the one given, else the optimizer's default."""
    return lr if lr is not None else DEFAULT_LR[optimizer]
DEFAULT_MARGIN = 0.15
# Timeouts above a week are a typo (or inf): a hung trial would hold a CI runner for that long.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_TRIAL_TIMEOUT_S = 600.0
DEFAULT_LOAD_TIMEOUT_S = 120.0
USUAL_MARGIN_RANGE = (0.10, 0.20)

# Config fields whose command-line flag is not the field's name with dashes (every other field's is).
# The CLI names flags in hints from this; the Python API takes either name.
FLAG_NAMES = {"trial_timeout_s": "trial-timeout", "load_timeout_s": "load-timeout", "point_timeout_s": "point-timeout",
              "accum_steps": "accum", "measured_steps": "steps", "warmup_steps": "warmup", "num_stages": "stages",
              "memory_budget_bytes": "memory-budget", "workload_options": "option", "grad_accum_steps": "accum",
              "num_blocks": "blocks", "link_bandwidth_bytes_per_s": "link-bandwidth", "link_latency_s": "link-latency",
              "validation_method": "validation", "num_microbatches": "micro-batches", "timeout_s": "timeout",
              "p99_budget_s": "p99", "queue_delays_s": "queue-delays", "window_s": "window",
              "queue_timeout_s": "queue-timeout"}


_FIELDS_OF_KEY: dict[str, list[str]] = {"options": ["workload_options"]}  # flag name with underscores -> fields
for _field, _flag in FLAG_NAMES.items():
    _FIELDS_OF_KEY.setdefault(_flag.replace("-", "_"), []).append(_field)


def flag_for(field_name: str) -> str:
    """The command-line flag of a config field."""
    return "--" + FLAG_NAMES.get(field_name, field_name.replace("_", "-"))


def param_for(field_name: str) -> str:
    """The command's parameter (its flag with underscores, as the Python API and settings files name it)."""
    return flag_for(field_name)[2:].replace("-", "_")


def field_for(key: str, fields: Collection[str]) -> str:
    """The config field, of `fields`, that a setting names: the field's own name, or its flag's with
    underscores or dashes (`accum` -> `accum_steps`, `trial-timeout` -> `trial_timeout_s`). A key that
    names none comes back as it is, for the caller to refuse."""
    if key in fields:
        return key
    return next((f for f in _FIELDS_OF_KEY.get(key.replace("-", "_"), ()) if f in fields), key)


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def parse_bytes(text: str, *, name: str = "memory size") -> int:
    """Parse '3GiB', '512MiB', '1.5G' or a plain byte count into bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(
            f"{name} {text!r} is not a size", hint="Write it like 3GiB, 512MiB, 2.5GB or a byte count."
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{name} {text!r} must be above zero", hint="Give a positive size such as 3GiB.")
    return value


def parse_device(text: str) -> str:
    """Normalise a device string ('auto', 'cpu', 'cuda', 'cuda:N'); presence is checked by device/."""
    match = _DEVICE_RE.fullmatch(str(text).strip().lower())
    if not match or (match.group(2) is not None and match.group(1) != "cuda"):
        raise ConfigError(
            f"device {text!r} is not recognised", hint="Use --device auto, cpu, cuda or cuda:N."
        )
    kind, index = match.groups()
    if kind == "cuda":
        return f"cuda:{int(index or 0)}"
    return kind


def parse_options(pairs: list[str] | tuple[str, ...]) -> tuple[tuple[str, int | float | str], ...]:
    """Parse KEY=VALUE workload options; numbers become int or float."""
    parsed: dict[str, int | float | str] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"workload option {pair!r} is not KEY=VALUE", hint="Write it like --option layers=4.")
        parsed[key.strip()] = _number_or_text(raw.strip())
    return tuple(sorted(parsed.items()))


def parse_duration(text: str, *, name: str) -> float:
    """'5us', '0.2ms', '1s' or plain seconds -> seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(us|µs|ms|s|)\s*", str(text))
    if not match:
        raise ConfigError(f"{name} {text!r} is not a duration", hint=f"Write it like {name} 5us, 0.2ms or 1e-6.")
    scale = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0}[match.group(2)]
    return float(match.group(1)) * scale


def parse_rate(text: str, *, name: str) -> float:
    """'50GB/s', '400Gbit/s' or bytes per second -> bytes per second."""
    raw = str(text).strip()
    body = raw[:-2] if raw.lower().endswith("/s") else raw
    if body.lower().endswith(("gbit", "mbit")):
        return parse_bytes(body[:-3], name=name) / 8
    return float(parse_bytes(body, name=name))


@overload
def parse_list(text: str, *, name: str, convert: type = int) -> tuple[Any, ...]: ...
@overload
def parse_list(text: str | None, *, name: str, convert: type = int) -> tuple[Any, ...] | None: ...
def parse_list(text: str | None, *, name: str, convert: type = int) -> tuple[Any, ...] | None:
    """Parse a comma-separated list ('2,4,8'); None stays None (use the default)."""
    if text is None:
        return None
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    try:
        values = tuple(convert(item) for item in items)
    except ValueError:
        raise ConfigError(f"{name} {text!r} is not a comma-separated list", hint=f"Write it like {name} 2,4,8.") from None
    if not values:
        raise ConfigError(f"{name} is empty", hint=f"Write it like {name} 2,4,8.")
    return values


def _number_or_text(raw: str) -> int | float | str:
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return raw




def _check_lr(lr: float | None) -> None:
    _require(lr is None or (math.isfinite(lr) and lr > 0), "lr", lr, "a finite number above 0 (e.g. 3e-4)")


def _check_timeout(seconds: float, field_name: str) -> None:
    _require(0 < seconds <= MAX_TIMEOUT_S, field_name, seconds, f"seconds above 0 and at most {MAX_TIMEOUT_S:g} (a week)")


@dataclass(frozen=True, kw_only=True)
class TrialConfig:
    """Everything one isolated trial process needs to build a workload and run training steps."""

    workload: str
    workload_options: tuple[tuple[str, int | float | str], ...] = ()
    device: str = "cpu"
    batch_size: int = 1
    precision: str = "fp32"
    optimizer: str = "adamw"
    steps: int = 2
    memory_budget_bytes: int | None = None
    threads: int | None = None
    seed: int = 0
    lr: float | None = None  # None: the optimizer's default (DEFAULT_LR)
    recompute: str = "none"  # one of RECOMPUTE_MODES
    count_flops: bool = False  # after its steps, count the workload's FLOPs per sample (workloads/flops.py)
    mode: str = TRAIN  # train: full training steps; infer: forward passes only (`steps` of them)

    def __post_init__(self) -> None:
        check_types(self)
        _check_lr(self.lr)
        _require(self.mode in MODES, "mode", self.mode, " | ".join(MODES))
        _require(self.recompute in RECOMPUTE_MODES, "recompute", self.recompute, " | ".join(RECOMPUTE_MODES))
        _require(self.batch_size >= 1, "batch_size", self.batch_size, "an integer >= 1")
        _require(self.steps >= 2, "steps", self.steps, ">= 2 (optimizer state must exist)")
        _require(self.precision in PRECISIONS, "precision", self.precision, " | ".join(PRECISIONS))
        _require(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, " | ".join(OPTIMIZERS))
        _require(self.threads is None or self.threads >= 1, "threads", self.threads, ">= 1")
        if self.precision == "fp16" and not self.device.startswith("cuda") and self.mode == TRAIN:
            raise ConfigError("precision fp16 needs a CUDA device (its GradScaler is CUDA-only)",
                              hint="Use --precision bf16 or fp32 on CPU.")


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """Settings of `mbtune probe`."""

    workload: str = "gpt"
    workload_options: tuple[tuple[str, int | float | str], ...] = ()
    device: str = "auto"
    memory_budget_bytes: int | None = None
    margin: float = DEFAULT_MARGIN
    granularity: int = 1
    max_batch: int | None = None
    confirm: int = 2
    resolution: int | None = None  # None: 1% of the ceiling, at least one granule; 1: the exact answer
    precision: str = "fp32"
    optimizer: str = "adamw"
    steps: int = 2
    threads: int | None = None
    trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    seed: int = 0
    lr: float | None = None  # None: the optimizer's default (DEFAULT_LR)
    recompute: tuple[str, ...] = ("none",)  # one probe per mode; the first is the main one
    mode: str = TRAIN  # infer: the inference ceiling (forward passes only), as `mbtune serve` probes it
    command_line: str = ""
    extra_warnings: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        _as_tuple(self, "recompute")
        check_types(self)
        _require(self.mode in MODES, "mode", self.mode, " | ".join(MODES))
        _check_recompute(self.recompute)
        require_unique(self.recompute, "recompute")
        # Without recompute first, where asked for: the main search is the one a sweep's plain points take.
        object.__setattr__(self, "recompute", tuple(m for m in RECOMPUTE_MODES if m in self.recompute))
        object.__setattr__(self, "device", parse_device(self.device))
        _require(not math.isnan(self.margin) and 0.0 <= self.margin <= 0.5, "margin", self.margin, "0 to 0.5 (usual 0.10-0.20)")
        _require(self.granularity >= 1, "granularity", self.granularity, "an integer >= 1")
        _require(self.max_batch is None or self.max_batch >= self.granularity, "max_batch", self.max_batch,
                 f">= granularity ({self.granularity})")
        _require(self.confirm >= 1, "confirm", self.confirm, "an integer >= 1")
        _require(self.resolution is None or self.resolution >= 1, "resolution", self.resolution, "an integer >= 1")
        _check_timeout(self.trial_timeout_s, "trial_timeout_s")
        _check_timeout(self.load_timeout_s, "load_timeout_s")
        _require(self.memory_budget_bytes is None or self.memory_budget_bytes > 0, "memory_budget_bytes",
                 self.memory_budget_bytes, "a size above zero")
        if self.precision == "fp16" and self.device == "cpu" and self.mode == TRAIN:
            raise ConfigError("precision fp16 needs a CUDA device (its GradScaler is CUDA-only)",
                              field="precision", hint="Use --precision bf16 or fp32 on CPU.")
        # The remaining fields are validated by building a trial config from them.
        self.trial(batch_size=self.granularity,
                   device="cuda:0" if self.precision == "fp16" and self.mode == TRAIN else self.device)

    def warnings(self) -> tuple[str, ...]:
        """Settings that are allowed but unusual."""
        low, high = USUAL_MARGIN_RANGE
        found = list(self.extra_warnings)
        if not low <= self.margin <= high:
            found.append(f"margin {self.margin:.0%} is outside the usual {low:.0%}-{high:.0%} policy")
        return tuple(found)

    def trial(self, *, batch_size: int, device: str, recompute: str | None = None,
              count_flops: bool = False) -> TrialConfig:
        """The trial config for one batch size on a resolved device (recompute: the main mode's by default)."""
        return TrialConfig(count_flops=count_flops,
            workload=self.workload, workload_options=self.workload_options, device=device,
            batch_size=batch_size, precision=self.precision, optimizer=self.optimizer, steps=self.steps,
            memory_budget_bytes=self.memory_budget_bytes, threads=self.threads, seed=self.seed, lr=self.lr,
            recompute=recompute or self.recompute[0], mode=self.mode,
        )


DEFAULT_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
# `mbtune plan`'s defaults (PlanConfig's), here so that the CLI reads them without importing the planner.
DEFAULT_PLAN_RANKS = 8
DEFAULT_PLAN_MICRO_BATCHES = (8, 16, 32)
DEFAULT_PLAN_VALIDATION = "leave-one-out"  # planning.validate.LEAVE_ONE_OUT
DEFAULT_PLAN_SCATTER = "measured"  # planning.records.SCATTER_MEASURED
OBJECTIVES = ("throughput", "memory", "bubble")
BALANCES = ("parameters", "time")  # how a sweep splits blocks over stages (--balance params | time)
STRATEGIES = ("grid", "quick")


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """Settings of `mbtune sweep` (and the sweep half of `mbtune tune`)."""

    workload: str = "gpt"
    workload_options: tuple[tuple[str, int | float | str], ...] = ()
    device: str = "auto"
    num_stages: int = 2
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    micro_batches: tuple[int, ...] | None = None  # default: p, 2p, 4p
    accum_steps: tuple[int, ...] = (1, 2)
    micro_batch_size: tuple[int, ...] | None = None  # fixed sizes (the global batch then varies)
    global_batch: tuple[int, ...] | None = None  # held fixed, each split every way the grid allows
    data_parallel: tuple[int, ...] = (1,)  # replicas of the pipeline (world = stages x replicas processes)
    recompute: tuple[str, ...] = ("none",)  # activation recompute modes, one point each
    balance: str = "parameters"  # stages split by compute-bearing parameters, or by measured block time
    safe_batch: int | None = None  # from a probe: micro-batch sizes above it are skipped
    recompute_safe_batch: int | None = None  # the probe's with full recompute (bounds those points instead)
    ceiling: int | None = None
    ceiling_peak_memory_bytes: int | None = None
    virtual_stages: int = 2
    warmup_steps: int = 1
    measured_steps: int = 3
    repeats: int = 1  # each point run this many times, each in fresh processes
    optimizer: str = "adamw"
    precision: str = "fp32"
    threads: int | None = None
    point_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    objective: str = "throughput"
    strategy: str = "grid"
    seed: int = 0
    lr: float | None = None  # trains with it (None: the optimizer's default); with reference_batch, the recipe's
    reference_batch: int | None = None  # the recipe's global batch: each row's advised lr is scaled from it
    profiles_dir: str | None = None  # where to look for this device's probe when safe_batch is not given
    from_profile: str | None = None  # a saved profile whose probe bounds the micro-batch size instead
    points: tuple[SweepPoint, ...] | None = None  # run exactly these (qualification re-runs a baseline's)
    command_line: str = ""
    # Who starts each point's ranks: mbtune's own launcher on this host, or torch.distributed.run's elastic
    # agent (pipeline/torchrun.py), on this host or on nnodes hosts meeting at rdzv_endpoint.
    launcher: str = "local"
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    join_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        from mbtune.pipeline.theory import SCHEDULE_NAMES

        for name in ("global_batch", "micro_batch_size", "data_parallel", "recompute"):
            _as_tuple(self, name)
        check_types(self)
        _check_recompute(self.recompute)
        object.__setattr__(self, "device", parse_device(self.device))
        _require(self.num_stages >= 1, "num_stages", self.num_stages, "an integer >= 1")
        for name in ("schedules", "micro_batches", "accum_steps", "global_batch", "micro_batch_size",
                     "data_parallel", "recompute"):
            require_unique(getattr(self, name), name)
        _require(bool(self.schedules), "schedules", self.schedules, "at least one schedule")
        unknown = [s for s in self.schedules if s not in SCHEDULE_NAMES]
        _require(not unknown, "schedules", ",".join(unknown), " | ".join(SCHEDULE_NAMES))
        _require(self.micro_batches is None or (bool(self.micro_batches) and min(self.micro_batches) >= 1),
                 "micro_batches", self.micro_batches, "integers >= 1")
        _require(bool(self.accum_steps) and min(self.accum_steps) >= 1, "accum_steps", self.accum_steps,
                 "integers >= 1")
        if self.micro_batch_size is not None and self.global_batch is not None:
            raise ConfigError("--micro-batch-size and --global-batch both given",
                              hint="Give one: the other follows from micro-batches and accumulation steps.")
        for name in ("safe_batch", "recompute_safe_batch", "ceiling"):
            value = getattr(self, name)
            _require(value is None or value >= 1, name, value, "an integer >= 1")
        for name in ("global_batch", "micro_batch_size"):
            value = getattr(self, name)
            _require(value is None or (bool(value) and min(value) >= 1), name, value, "integers >= 1")
        _require(bool(self.data_parallel) and min(self.data_parallel) >= 1, "data_parallel", self.data_parallel,
                 "integers >= 1")
        _require(self.virtual_stages >= 2, "virtual_stages", self.virtual_stages, "an integer >= 2")
        _require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        _require(self.measured_steps >= 1, "measured_steps", self.measured_steps, "an integer >= 1")
        _require(self.repeats >= 1, "repeats", self.repeats, "an integer >= 1")
        _require(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, " | ".join(OPTIMIZERS))
        _require(self.precision in ("fp32", "bf16"), "precision", self.precision,
                 "fp32 | bf16 for pipelined steps (fp16 would need one loss scale across all ranks)")
        _require(self.threads is None or self.threads >= 1, "threads", self.threads, ">= 1")
        _check_timeout(self.point_timeout_s, "point_timeout_s")
        _check_timeout(self.load_timeout_s, "load_timeout_s")
        _require(self.objective in OBJECTIVES, "objective", self.objective, " | ".join(OBJECTIVES))
        _require(self.strategy in STRATEGIES, "strategy", self.strategy, " | ".join(STRATEGIES))
        if self.balance == "params":
            object.__setattr__(self, "balance", "parameters")
        _require(self.balance in BALANCES, "balance", self.balance, "params | time")
        _check_lr(self.lr)
        _require(self.reference_batch is None or self.reference_batch >= 1, "reference_batch", self.reference_batch,
                 "an integer >= 1")
        from mbtune.pipeline.torchrun import LAUNCHERS

        _require(self.launcher in LAUNCHERS, "launcher", self.launcher, " | ".join(LAUNCHERS))
        if self.nnodes > 1 and self.launcher != "torchrun":
            raise ConfigError(f"--nnodes {self.nnodes} needs --launcher torchrun",
                              hint="Add --launcher torchrun: mbtune's own launcher reaches one host only.")
        _ = self.nodes  # checks the node settings

    @property
    def nodes(self) -> Nodes:
        """The hosts this sweep's ranks run on (pipeline/torchrun.py)."""
        from mbtune.pipeline.torchrun import Nodes

        return Nodes(nnodes=self.nnodes, node_rank=self.node_rank, endpoint=self.rdzv_endpoint,
                     join_timeout_s=self.join_timeout_s)

    def safe_batch_for(self, recompute: str) -> int | None:
        """The probed safe batch that bounds a point's micro-batch size: with full recompute, the probe's
        with it where one ran."""
        if recompute == "full" and self.recompute_safe_batch is not None:
            return self.recompute_safe_batch
        return self.safe_batch

    @property
    def micro_batch_counts(self) -> tuple[int, ...]:
        p = self.num_stages
        return self.micro_batches or tuple(sorted({p, 2 * p, 4 * p}))

    @property
    def global_batches(self) -> tuple[int, ...]:
        """The global batches held fixed: the given ones; else, with a probed safe batch and no fixed
        micro-batch size, the one the default rule picks (default_global_batch); else none (the micro-batch
        size is fixed and the global batch varies from point to point)."""
        if self.global_batch is not None:
            return self.global_batch
        if self.micro_batch_size is None and self.safe_batch is not None:
            return (default_global_batch(self.safe_batch, self.micro_batch_counts, self.accum_steps,
                                         self.data_parallel),)
        return ()


def _as_tuple(config: Any, name: str) -> None:
    """A list field given one value (an int, a str), as before lists: that value alone."""
    value = getattr(config, name)
    if isinstance(value, int | str) and not isinstance(value, bool):
        object.__setattr__(config, name, (value,))


def _check_recompute(modes: tuple[str, ...]) -> None:
    unknown = [m for m in modes if m not in RECOMPUTE_MODES]
    _require(bool(modes) and not unknown, "recompute", ",".join(unknown) or modes, " | ".join(RECOMPUTE_MODES))


def default_global_batch(safe_batch: int, micro_batch_counts: tuple[int, ...], accum_steps: tuple[int, ...],
                         data_parallel: tuple[int, ...] = (1,)) -> int:
    """The global batch a sweep holds fixed by default: the largest power of two that the fewest
    micro-batches, accumulation steps and replicas of the grid hold at the probed safe batch. Every
    (micro-batches, accumulation, replicas) combination of powers of two then splits it with a micro-batch
    size within the safe batch."""
    most = safe_batch * min(micro_batch_counts) * min(accum_steps) * min(data_parallel)
    return 1 << (most.bit_length() - 1)


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    """Settings of `mbtune check`: one configuration, run for one optimizer step through the real pipeline
    and through the plain model on the same global batch and seed."""

    workload: str = "gpt"
    workload_options: tuple[tuple[str, int | float | str], ...] = ()
    device: str = "auto"
    schedule: str = "1f1b"
    num_stages: int = 2  # pipeline ranks
    num_microbatches: int = 4
    grad_accum_steps: int = 1
    data_parallel: int = 1  # replicas of the pipeline, gradients all-reduced
    recompute: str = "none"  # the pipeline's; the plain model it is held to never recomputes
    micro_batch_size: int | None = None  # None: from global_batch, else 2
    global_batch: int | None = None
    virtual_stages: int = 2
    precision: str = "fp32"
    optimizer: str = "adamw"
    lr: float | None = None
    seed: int = 0
    timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S

    def __post_init__(self) -> None:
        from mbtune.pipeline.theory import SCHEDULE_NAMES

        check_types(self)
        object.__setattr__(self, "device", parse_device(self.device))
        _require(self.schedule in SCHEDULE_NAMES, "schedule", self.schedule, " | ".join(SCHEDULE_NAMES))
        for name in ("num_stages", "num_microbatches", "grad_accum_steps", "data_parallel"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        _check_recompute((self.recompute,))
        if self.micro_batch_size is not None and self.global_batch is not None:
            raise ConfigError("--micro-batch-size and --global-batch both given",
                              hint="Give one: the other follows from micro-batches and accumulation steps.")
        for name in ("micro_batch_size", "global_batch"):
            _require(getattr(self, name) is None or getattr(self, name) >= 1, name, getattr(self, name),
                     "an integer >= 1")
        _require(self.virtual_stages >= 2, "virtual_stages", self.virtual_stages, "an integer >= 2")
        _require(self.precision in ("fp32", "bf16"), "precision", self.precision, "fp32 | bf16")
        _require(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, " | ".join(OPTIMIZERS))
        _check_lr(self.lr)
        _check_timeout(self.timeout_s, "timeout_s")
        _check_timeout(self.load_timeout_s, "load_timeout_s")
        if self.global_batch is not None:
            _, reason = micro_batch_size_for(self.global_batch, num_microbatches=self.num_microbatches,
                                             grad_accum_steps=self.grad_accum_steps,
                                             data_parallel_size=self.data_parallel)
            if reason:
                raise ConfigError(f"{reason}", field="global_batch",
                                  hint="Pick a global batch that micro-batches x accumulation steps x replicas "
                                       "divide.")

    @classmethod
    def for_point(cls, point: SweepPoint, **settings: Any) -> CheckConfig:
        """The check of one sweep point; `settings` give the workload and the rest."""
        return cls(schedule=point.schedule, num_stages=point.num_stages, num_microbatches=point.num_microbatches,
                   grad_accum_steps=point.grad_accum_steps, data_parallel=point.data_parallel_size,
                   recompute=point.recompute,
                   micro_batch_size=point.micro_batch_size, virtual_stages=max(2, point.virtual_stages), **settings)

    @property
    def point(self) -> SweepPoint:
        """The configuration as a sweep point."""
        from mbtune.pipeline.theory import stages_per_rank

        size = self.micro_batch_size or 2
        if self.global_batch is not None:
            size, _ = micro_batch_size_for(self.global_batch, num_microbatches=self.num_microbatches,
                                           grad_accum_steps=self.grad_accum_steps,
                                           data_parallel_size=self.data_parallel)
        return SweepPoint(schedule=self.schedule, num_stages=self.num_stages, num_microbatches=self.num_microbatches,
                          grad_accum_steps=self.grad_accum_steps, micro_batch_size=size,
                          virtual_stages=stages_per_rank(self.schedule, self.virtual_stages),
                          data_parallel_size=self.data_parallel, recompute=self.recompute)


THRESHOLD_KEYS = ("min_ceiling", "min_safe_batch", "min_best_samples_per_s", "max_best_bubble", "min_rate_at_p99")
SERVE_THRESHOLDS = ("min_rate_at_p99",)  # judged on `mbtune serve`'s answer (a spec's [serve] section)


def parse_fraction(text: str | float, *, name: str) -> float:
    """'10%' or '0.1' -> 0.1."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ConfigError(f"{name} {text!r} is not a fraction", hint=f"Write it like {name} 10% or 0.1.") from None
    _require(0 <= value < 1, name.lstrip("-").replace("-", "_"), text, "0% to 99%")
    return value


@dataclass(frozen=True, kw_only=True)
class QualifySpec:
    """What `mbtune qualify` runs and the bounds it holds the results to (from flags and/or a TOML file)."""

    baseline: str | None = None
    probe: ProbeConfig | None = None  # None: take it from the baseline
    sweep: SweepConfig | None = None  # None: re-run the baseline's points
    tolerance: float = 0.10
    thresholds: tuple[tuple[str, float], ...] = ()
    allow_different_device: bool = False
    # A [serve] section: `mbtune serve` runs too, for min_rate_at_p99. A ServeConfig (serving/config.py,
    # which builds on this module, so it is checked by name rather than by annotation).
    serve: Any = None

    def __post_init__(self) -> None:
        check_types(self)
        _require(self.serve is None or type(self.serve).__name__ == "ServeConfig", "serve", self.serve,
                 "a ServeConfig or nothing")
        if any(k in SERVE_THRESHOLDS for k, _ in self.thresholds) and self.serve is None:
            raise ConfigError("threshold min_rate_at_p99 needs a [serve] section in the spec (with its p99 budget)",
                              hint='Add [serve] with p99 = "50ms" (and any mbtune serve setting).')
        if self.baseline is None and self.probe is None and self.serve is None:
            raise ConfigError("nothing to qualify against: no baseline and no workload in the spec",
                              hint="Pass --baseline profiles/<device>/<workload>.json or --spec qualify.toml.")
        _require(0 <= self.tolerance < 1, "tolerance", self.tolerance, "0% to 99%")
        unknown = [k for k, _ in self.thresholds if k not in THRESHOLD_KEYS]
        _require(not unknown, "thresholds", ",".join(unknown), " | ".join(THRESHOLD_KEYS))
