"""The probe's configs: one isolated trial (TrialConfig) and the whole search (ProbeConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mbtune.errors import ConfigError
from mbtune.records import RECOMPUTE_MODES
from mbtune.settings import (
    DEFAULT_LOAD_TIMEOUT_S,
    DEFAULT_MARGIN,
    DEFAULT_TRIAL_TIMEOUT_S,
    MAX_BUDGET_BYTES,
    MAX_COUNT,
    MAX_PROCESSES,
    MAX_SAMPLES,
    MODES,
    OPTIMIZERS,
    PRECISIONS,
    TRAIN,
    USUAL_MARGIN_RANGE,
    as_tuple,
    bound_load_timeout,
    check_at_most,
    check_lr,
    check_recompute_modes,
    check_seed,
    check_timeout,
)
from mbtune.units import parse_device
from mbtune.validation import check_types, require_unique
from mbtune.validation import require as _require


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
    mode: str = TRAIN  # train: full training steps; infer: forward passes only (`steps` of them)

    def __post_init__(self) -> None:
        check_types(self)
        check_lr(self.lr)
        _require(self.mode in MODES, "mode", self.mode, " | ".join(MODES))
        _require(self.recompute in RECOMPUTE_MODES, "recompute", self.recompute, " | ".join(RECOMPUTE_MODES))
        _require(self.batch_size >= 1, "batch_size", self.batch_size, "an integer >= 1")
        _require(self.steps >= 2, "steps", self.steps, ">= 2 (optimizer state must exist)")
        _require(self.precision in PRECISIONS, "precision", self.precision, " | ".join(PRECISIONS))
        _require(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, " | ".join(OPTIMIZERS))
        _require(self.threads is None or self.threads >= 1, "threads", self.threads, ">= 1")
        check_at_most(self, MAX_SAMPLES, "batch_size")
        check_seed(self.seed)
        check_at_most(self, MAX_COUNT, "steps")
        check_at_most(self, MAX_PROCESSES, "threads")
        check_at_most(self, MAX_BUDGET_BYTES, "memory_budget_bytes")
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
    confirm: int | None = None  # None: 1 on the CPU (a size's outcome is the same every run), 2 on CUDA
    resolution: int | None = None  # None: 1% of the ceiling, at least one granule; 1: the exact answer
    predict: bool = True  # start the search from the ceiling predicted on fake tensors (probing/ceiling_prediction.py)
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
    # The user's own training command, its per-process batch size written {batch}: probed as it is, instead of
    # a workload (probing/command.py); `steps` are then its optimizer steps per trial.
    command: tuple[str, ...] = ()
    name: str | None = None  # a command's name in the profile (default: its script's name)
    # A line the command prints once a step (a regular expression): steps counted from its output, for a
    # script that steps no torch optimizer.
    steps_from_output: str | None = None
    # After the search, the command is run at the safe batch for this long (mbtune confirm --duration), through
    # its evaluation passes and checkpoints (None: not confirmed).
    confirm_duration_s: float | None = None
    command_line: str = ""
    extra_warnings: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        as_tuple(self, "recompute")
        if isinstance(self.command, list):
            object.__setattr__(self, "command", tuple(self.command))
        check_types(self)
        if self.command:
            from mbtune.probing.command import check_template, command_name

            object.__setattr__(self, "command", check_template(self.command))
            object.__setattr__(self, "workload", self.name or command_name(self.command))
            object.__setattr__(self, "predict", False)  # the script is not a workload mbtune can trace
            if self.steps_from_output is not None:
                from mbtune.probing.command import step_line

                step_line(self.steps_from_output)
        elif self.steps_from_output is not None:
            raise ConfigError("steps_from_output counts the steps of a command, and there is none",
                              field="steps_from_output", hint="Give the command after --: mbtune probe "
                              "--steps-from-output 'step \\d+' -- python train.py --batch-size {batch}")
        if self.confirm_duration_s is not None:
            check_timeout(self.confirm_duration_s, "confirm_duration_s")
            if not self.command:
                raise ConfigError("--confirm-duration runs a command at its safe batch, and there is none",
                                  field="confirm_duration_s", hint="Give the command after --: mbtune probe "
                                  "--confirm-duration 30m -- python train.py --batch-size {batch}")
        _require(self.mode in MODES, "mode", self.mode, " | ".join(MODES))
        check_recompute_modes(self.recompute)
        require_unique(self.recompute, "recompute")
        # Without recompute first, where asked for: the main search is the one a sweep's plain points take.
        object.__setattr__(self, "recompute", tuple(m for m in RECOMPUTE_MODES if m in self.recompute))
        object.__setattr__(self, "device", parse_device(self.device))
        _require(not math.isnan(self.margin) and 0.0 <= self.margin <= 0.5, "margin", self.margin, "0 to 0.5 (usual 0.10-0.20)")
        _require(self.granularity >= 1, "granularity", self.granularity, "an integer >= 1")
        _require(self.max_batch is None or self.max_batch >= self.granularity, "max_batch", self.max_batch,
                 f">= granularity ({self.granularity})")
        _require(self.confirm is None or self.confirm >= 1, "confirm", self.confirm, "an integer >= 1")
        _require(self.resolution is None or self.resolution >= 1, "resolution", self.resolution, "an integer >= 1")
        check_at_most(self, MAX_SAMPLES, "granularity", "max_batch", "resolution")
        check_at_most(self, MAX_COUNT, "confirm")
        check_timeout(self.trial_timeout_s, "trial_timeout_s")
        check_timeout(self.load_timeout_s, "load_timeout_s")
        bound_load_timeout(self, self.trial_timeout_s)
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
              ) -> TrialConfig:
        """The trial config for one batch size on a resolved device (recompute: the main mode's by default)."""
        return TrialConfig(
            workload=self.workload, workload_options=self.workload_options, device=device,
            batch_size=batch_size, precision=self.precision, optimizer=self.optimizer, steps=self.steps,
            memory_budget_bytes=self.memory_budget_bytes, threads=self.threads, seed=self.seed, lr=self.lr,
            recompute=recompute or self.recompute[0], mode=self.mode,
        )
