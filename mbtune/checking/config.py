"""The check's settings (CheckConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mbtune.errors import ConfigError
from mbtune.pipeline.point import SweepPoint, micro_batch_size_for
from mbtune.pipeline.theory import DEFAULT_STAGES_PER_RANK
from mbtune.settings import (
    DEFAULT_LOAD_TIMEOUT_S,
    DEFAULT_TRIAL_TIMEOUT_S,
    MAX_COUNT,
    MAX_PROCESSES,
    MAX_SAMPLES,
    OPTIMIZERS,
    bound_load_timeout,
    check_at_most,
    check_lr,
    check_recompute_modes,
    check_seed,
    check_timeout,
)
from mbtune.units import parse_device
from mbtune.validation import check_types
from mbtune.validation import require as _require


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    """Settings of `mbtune check`: one configuration, run for one optimizer step through the real pipeline
    and through the plain model on the same global batch and seed."""

    workload: str = "gpt"
    workload_options: tuple[tuple[str, int | float | str], ...] = ()
    device: str = "auto"
    schedule: str = "1f1b"
    num_ranks: int = 2  # pipeline ranks
    num_micro_batches: int = 4
    grad_accum_steps: int = 1
    data_parallel_size: int = 1  # replicas of the pipeline, gradients all-reduced
    recompute: str = "none"  # the pipeline's; the plain model it is held to never recomputes
    micro_batch_size: int | None = None  # None: from global_batch, else 2
    global_batch: int | None = None
    stages_per_rank: int = DEFAULT_STAGES_PER_RANK
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
        for name in ("num_ranks", "num_micro_batches", "grad_accum_steps", "data_parallel_size"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        check_recompute_modes((self.recompute,))
        if self.micro_batch_size is not None and self.global_batch is not None:
            raise ConfigError("--micro-batch-size and --global-batch both given",
                              hint="Give one: the other follows from micro-batches and accumulation steps.")
        for name in ("micro_batch_size", "global_batch"):
            _require(getattr(self, name) is None or getattr(self, name) >= 1, name, getattr(self, name),
                     "an integer >= 1")
        _require(self.stages_per_rank >= 2, "stages_per_rank", self.stages_per_rank, "an integer >= 2")
        _require(self.precision in ("fp32", "bf16"), "precision", self.precision, "fp32 | bf16")
        _require(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, " | ".join(OPTIMIZERS))
        check_lr(self.lr)
        check_timeout(self.timeout_s, "timeout_s")
        check_timeout(self.load_timeout_s, "load_timeout_s")
        bound_load_timeout(self, self.timeout_s)
        check_at_most(self, MAX_SAMPLES, "micro_batch_size", "global_batch")
        check_at_most(self, MAX_COUNT, "num_micro_batches", "grad_accum_steps")
        check_at_most(self, MAX_PROCESSES, "num_ranks", "data_parallel_size", "stages_per_rank")
        check_seed(self.seed)
        if self.global_batch is not None:
            _, reason = micro_batch_size_for(self.global_batch, num_micro_batches=self.num_micro_batches,
                                             grad_accum_steps=self.grad_accum_steps,
                                             data_parallel_size=self.data_parallel_size)
            if reason:
                raise ConfigError(f"{reason}", field="global_batch",
                                  hint="Pick a global batch that micro-batches x accumulation steps x replicas "
                                       "divide.")

    @classmethod
    def for_point(cls, point: SweepPoint, **settings: Any) -> CheckConfig:
        """The check of one sweep point; `settings` (by name, as settings.build takes them) give the workload
        and the rest."""
        from mbtune.settings import build, settings_of

        return build(cls, {**settings_of(cls, point),
                           "stages_per_rank": max(DEFAULT_STAGES_PER_RANK, point.stages_per_rank), **settings})

    @property
    def point(self) -> SweepPoint:
        """The configuration as a sweep point."""
        from mbtune.pipeline.theory import stages_per_rank_of

        size = self.micro_batch_size or 2
        if self.global_batch is not None:
            size, _ = micro_batch_size_for(self.global_batch, num_micro_batches=self.num_micro_batches,
                                           grad_accum_steps=self.grad_accum_steps,
                                           data_parallel_size=self.data_parallel_size)
        return SweepPoint(schedule=self.schedule, num_ranks=self.num_ranks, num_micro_batches=self.num_micro_batches,
                          grad_accum_steps=self.grad_accum_steps, micro_batch_size=size,
                          stages_per_rank=stages_per_rank_of(self.schedule, self.stages_per_rank),
                          data_parallel_size=self.data_parallel_size, recompute=self.recompute)
