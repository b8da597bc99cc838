"""What one pipelined point runs: a frozen, self-validating spec every rank receives. No torch import."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mbtune.errors import ConfigError
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.theory import check_point, stages_per_rank_of
from mbtune.records import RECOMPUTE_MODES
from mbtune.settings import OPTIMIZERS
from mbtune.validation import require as _require

BALANCES = ("parameters", "blocks", "time")


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """One pipelined point: workload, schedule, batch shape, how many steps to time, and where to run.

    Each optimizer step runs, on each of `data_parallel_size` replicas, `grad_accum_steps` pipeline steps of
    `num_micro_batches` micro-batches of `micro_batch_size` samples; the replicas' gradients are all-reduced,
    and add up to those of one batch of `global_batch` samples. Process r is pipeline rank
    r % num_ranks of replica r // num_ranks.
    """

    workload: str
    workload_options: tuple[tuple[str, Any], ...] = ()
    schedule: str = "1f1b"
    num_ranks: int = 2  # pipeline ranks of one replica
    data_parallel_size: int = 1  # replicas of the pipeline; world = num_ranks x data_parallel_size processes
    # Stages each rank holds: None, the schedule's own (1 for gpipe and 1f1b, 2 for zbv, DEFAULT_STAGES_PER_RANK
    # for the looped schedules); what a looped schedule is given. Resolved to a count when the spec is made.
    stages_per_rank: int | None = None
    num_micro_batches: int = 4
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    warmup_steps: int = 1
    measured_steps: int = 2
    seed: int = 0
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (nccl, rank r on cuda:r)
    optimizer: str = "adamw"
    precision: str = "fp32"  # fp32 or bf16 (autocast per stage); fp16 needs a pipeline-wide scaler: not here
    lr: float = 1e-4
    threads: int | None = 1  # torch threads per rank process
    # On the CPU, each rank process pinned to its own cores: the cores this host's processes may use, split
    # evenly over the point's processes on it (pipeline/rank_device.py); off where they would share cores.
    pin_cpus: bool = False
    # Split by compute-bearing parameters (embeddings excluded), by block count, or by measured block time
    # (block_weights, from pipeline/balance.py's timing pass).
    balance: str = "parameters"
    block_weights: tuple[float, ...] | None = None
    recompute: str = "none"  # "full": every block an activation checkpoint (workloads/recompute.py)
    pg_timeout_s: float = 60.0
    capture_grads: bool = False  # return the last step's gradients (for equivalence tests)
    # On the CPU, count the point's live tensor bytes over its first step (its peak memory); off for a repeat
    # on kept processes that counted this very point before (the same program counts the same bytes, and the
    # count slows the step it watches).
    count_memory: bool = True
    # A repeat on kept processes that ran this very point before (CPU): torch's first-step setup is done before
    # the steps (pipeline/schedules.py prime_schedule), in place of the first warm-up step; the process's
    # allocator and caches are warm from that point already.
    primed: bool = False

    def __post_init__(self) -> None:
        _require(self.num_ranks >= 1, "num_ranks", self.num_ranks, "an integer >= 1")
        _require(self.data_parallel_size >= 1, "data_parallel_size", self.data_parallel_size, "an integer >= 1")
        _require(self.num_micro_batches >= 1, "num_micro_batches", self.num_micro_batches, "an integer >= 1")
        _require(self.micro_batch_size >= 1, "micro_batch_size", self.micro_batch_size, "an integer >= 1")
        _require(self.grad_accum_steps >= 1, "grad_accum_steps", self.grad_accum_steps, "an integer >= 1")
        _require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        _require(self.measured_steps >= 1, "measured_steps", self.measured_steps, "an integer >= 1")
        _require(self.device in ("cpu", "cuda"), "device", self.device, "cpu | cuda")
        _require(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, " | ".join(OPTIMIZERS))
        _require(self.precision in ("fp32", "bf16"), "precision", self.precision,
                 "fp32 | bf16 (pipelined fp16 would need one loss scale across ranks)")
        _require(self.balance in BALANCES, "balance", self.balance, " | ".join(BALANCES))
        _require((self.balance == "time") == (self.block_weights is not None), "block_weights", self.block_weights,
                 "measured block times exactly when balance is time")
        _require(self.recompute in RECOMPUTE_MODES, "recompute", self.recompute, " | ".join(RECOMPUTE_MODES))
        _require(self.threads is None or self.threads >= 1, "threads", self.threads, ">= 1")
        _require(math.isfinite(self.pg_timeout_s) and self.pg_timeout_s > 0, "pg_timeout_s", self.pg_timeout_s,
                 "seconds > 0")
        _require(math.isfinite(self.lr) and self.lr >= 0, "lr",
                 self.lr, "a finite number >= 0")
        try:
            per_rank = stages_per_rank_of(self.schedule, self.stages_per_rank)
        except ValueError as exc:
            raise ConfigError(str(exc), hint="Fix --schedule.") from None
        object.__setattr__(self, "stages_per_rank", per_rank)
        reason = check_point(self.schedule, per_rank * self.num_ranks, self.num_ranks, self.num_micro_batches)
        if reason:
            raise ConfigError(f"this pipeline point cannot run: {reason}",
                              hint="Change --schedule, --stages or --micro-batches.")

    @classmethod
    def for_point(cls, point: SweepPoint, *, workload: str, workload_options: tuple[tuple[str, Any], ...],
                  device: str, **run: Any) -> PipelineSpec:
        """What every rank of one point runs: the point's shape on a resolved device ('cpu', 'cuda' or
        'cuda:N'); `run` sets the rest (optimizer, lr, precision, seed, steps, threads, balance...). The one
        conversion of a point into a spec."""
        return cls(workload=workload, workload_options=workload_options, schedule=point.schedule,
                   num_ranks=point.num_ranks, data_parallel_size=point.data_parallel_size, recompute=point.recompute,
                   stages_per_rank=point.stages_per_rank,
                   num_micro_batches=point.num_micro_batches, micro_batch_size=point.micro_batch_size,
                   grad_accum_steps=point.grad_accum_steps, device="cuda" if device.startswith("cuda") else "cpu",
                   **run)

    @property
    def num_model_stages(self) -> int:
        """Every stage the model is split into: ranks x stages per rank (virtual stages included). Not a
        SweepPoint's num_ranks, which counts ranks (that is `num_ranks` here)."""
        assert self.stages_per_rank is not None, "resolved when the spec is made"
        return self.stages_per_rank * self.num_ranks

    @property
    def pipeline_batch_size(self) -> int:
        """Samples one pipeline step (one schedule.step call) pushes through."""
        return self.micro_batch_size * self.num_micro_batches

    @property
    def replicas_batch_size(self) -> int:
        """Samples one pipeline step pushes through all replicas together (each takes its slice)."""
        return self.pipeline_batch_size * self.data_parallel_size

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, over every replica."""
        return self.replicas_batch_size * self.grad_accum_steps

    @property
    def world_size(self) -> int:
        """Processes: pipeline ranks x data-parallel replicas."""
        return self.num_ranks * self.data_parallel_size

    def place(self, process: int) -> tuple[int, int]:
        """(pipeline rank, replica) of process `process` of the world."""
        return process % self.num_ranks, process // self.num_ranks

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.measured_steps
