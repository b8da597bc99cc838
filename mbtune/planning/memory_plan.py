"""`mbtune plan` without a saved profile: every stage's peak memory predicted for configurations beyond this
machine, and the largest micro-batch size each stage holds in a device's memory.

Per schedule, micro-batch count and recompute mode, every rank's peak is predicted (pipeline/predict.py: the
rank's own code on fake tensors, counted as a device's allocator counts) at micro-batch sizes 1 and 2; a
rank's activations grow with the micro-batch size, so the two give each rank's line and the largest size it
holds. The smallest of those binds; the peaks are then predicted at that size (and the size stepped down
where a rank's line was optimistic), so every peak printed is a prediction, not an extrapolation.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

from mbtune.errors import ConfigError
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.spec import PipelineSpec
from mbtune.pipeline.theory import check_point, stages_per_rank
from mbtune.recordio import Record

MAX_STEPS_DOWN = 4  # sizes tried below the lines' answer where a rank's line was optimistic


@dataclass(frozen=True, kw_only=True)
class MemoryPlanConfig:
    workload: str
    workload_options: tuple[tuple[str, Any], ...] = ()
    device_memory_bytes: int
    num_ranks: int
    schedules: tuple[str, ...]
    micro_batches: tuple[int, ...]
    recompute: tuple[str, ...] = ("none",)
    data_parallel_size: int = 1
    grad_accum_steps: int = 1
    virtual_stages: int | None = None
    precision: str = "fp32"
    optimizer: str = "adamw"
    timeout_s: float = 3600.0

    def specs(self) -> list[tuple[str, int, str, PipelineSpec | None, str]]:
        """Every configuration (schedule, micro-batches, recompute) as a spec at micro-batch size 1, or None
        with why it cannot run."""
        out: list[tuple[str, int, str, PipelineSpec | None, str]] = []
        for schedule in self.schedules:
            for m in self.micro_batches:
                for recompute in self.recompute:
                    per_rank = stages_per_rank(schedule, self.virtual_stages)
                    why = check_point(schedule, self.num_ranks * per_rank, self.num_ranks, m)
                    point = SweepPoint(schedule=schedule, num_ranks=self.num_ranks, num_microbatches=m,
                                       grad_accum_steps=self.grad_accum_steps, micro_batch_size=1,
                                       stages_per_rank=per_rank, data_parallel_size=self.data_parallel_size,
                                       recompute=recompute)
                    spec = None if why else PipelineSpec.for_point(
                        point, workload=self.workload, workload_options=self.workload_options, device="cpu",
                        precision=self.precision, optimizer=self.optimizer, measured_steps=1)
                    out.append((schedule, m, recompute, spec, why or ""))
        return out


@dataclass(frozen=True, kw_only=True)
class MemoryPlanRow(Record):
    schedule: str
    num_microbatches: int
    recompute: str
    micro_batch_size: int  # the largest every rank holds (0: not even one sample)
    global_batch: int
    binding_rank: int | None  # the rank whose memory binds
    peak_bytes: tuple[int, ...] = ()  # every rank's predicted peak at micro_batch_size
    limits: tuple[int, ...] = ()  # per rank, the largest micro-batch size its line holds
    seconds: float = 0.0
    skipped: str = ""  # why this configuration cannot run


@dataclass(frozen=True, kw_only=True)
class MemoryPlan(Record):
    workload: str
    workload_options: dict[str, Any]
    device_memory_bytes: int
    num_ranks: int
    data_parallel_size: int
    grad_accum_steps: int
    precision: str
    optimizer: str
    rows: tuple[MemoryPlanRow, ...]
    seconds: float


def plan_memory(config: MemoryPlanConfig) -> MemoryPlan:
    """The memory plan, predicted in a child process (the workload is user code) under the timeout."""
    from mbtune.errors import WorkloadError
    from mbtune.worker import run_isolated

    result = run_isolated(_plan_here, config, timeout_s=config.timeout_s)
    if result.status != "ok":
        raise WorkloadError(f"the memory plan could not be predicted: {result.cause}", detail=result.error)
    return result.value


def _plan_here(config: MemoryPlanConfig) -> MemoryPlan:
    from mbtune.workloads import load_workload

    started = time.perf_counter()
    workload = load_workload(config.workload, config.workload_options)
    if config.num_ranks > workload.num_blocks:
        raise ConfigError(f"the workload has {workload.num_blocks} blocks, too few for {config.num_ranks} stages")
    from mbtune.pipeline.predict import RankPeaks

    predict = RankPeaks(workload)
    rows = [_row(*planned, config, predict) for planned in config.specs()]
    return MemoryPlan(workload=config.workload, workload_options=dict(config.workload_options),
                      device_memory_bytes=config.device_memory_bytes, num_ranks=config.num_ranks,
                      data_parallel_size=config.data_parallel_size, grad_accum_steps=config.grad_accum_steps,
                      precision=config.precision, optimizer=config.optimizer, rows=tuple(rows),
                      seconds=time.perf_counter() - started)


def _row(schedule: str, m: int, recompute: str, spec: PipelineSpec | None, why: str, config: MemoryPlanConfig,
         predict: Any) -> MemoryPlanRow:
    if spec is None:
        return MemoryPlanRow(schedule=schedule, num_microbatches=m, recompute=recompute, micro_batch_size=0,
                             global_batch=0, binding_rank=None, skipped=why)
    started = time.perf_counter()
    memory = config.device_memory_bytes

    known: dict[int, tuple[int, ...]] = {}

    def peaks(size: int) -> tuple[int, ...]:
        if size not in known:
            known[size] = predict(replace(spec, micro_batch_size=size))
        return known[size]

    one, two = peaks(1), peaks(2)
    limits = tuple(_largest(memory, a, b) for a, b in zip(one, two, strict=True))
    size = min(limits)
    at = peaks(max(size, 1))
    for _ in range(MAX_STEPS_DOWN):
        if size <= 1 or max(at) <= memory:
            break
        size -= 1
        at = peaks(size)
    if max(at) > memory:
        size = 0
    binding = min(range(len(limits)), key=lambda r: (limits[r], -at[r]))
    return MemoryPlanRow(schedule=spec.schedule, num_microbatches=spec.num_microbatches, recompute=spec.recompute,
                         micro_batch_size=size, global_batch=size * spec.num_microbatches * spec.grad_accum_steps
                         * spec.data_parallel_size, binding_rank=binding, peak_bytes=at, limits=limits,
                         seconds=time.perf_counter() - started)


def _largest(memory: int, at_one: int, at_two: int) -> int:
    """The largest micro-batch size a rank holds, from its peaks at sizes 1 and 2 (0: not even one)."""
    if at_one > memory:
        return 0
    grows = at_two - at_one
    return 2**30 if grows <= 0 else max(1, math.floor((memory - at_one) / grows) + 1)
