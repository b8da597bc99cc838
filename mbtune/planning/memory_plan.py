"""`mbtune plan` without a saved profile: every stage's peak memory predicted for configurations beyond this
machine, and the largest micro-batch size each stage holds in a device's memory.

Per schedule, micro-batch count and recompute mode, every rank's step is traced (pipeline/rank_memory.py: the
rank's own code on fake tensors, counted as a device's allocator counts) at micro-batch sizes 1 and 2, with
its live bytes after every operator. The same step at two sizes runs the same operators, and every tensor
that holds the batch grows with it, so each moment's bytes are a line in the micro-batch size: the largest
size at which every moment of a rank's step fits is that rank's limit (a peak that moves from one moment to
another as the size grows is found too). The smallest limit binds; the peaks are then predicted at that size
(and the size stepped down where the lines were optimistic), so every peak printed is a prediction, not an
extrapolation. The ranks' steps are traced in forked processes, one per core, each stage's later
micro-batches echoed from its first ones (pipeline/echoes.py), so a step costs about two micro-batches.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from mbtune.errors import ConfigError
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.theory import check_point, stages_per_rank_of
from mbtune.recordio import Record

if TYPE_CHECKING:
    from mbtune.pipeline.rank_memory import Prepared, RankPeaks, RankTrace

MAX_STEPS_DOWN = 4  # sizes tried below the lines' answer where a rank's line was optimistic
NO_LIMIT = 2**30  # a rank's limit where nothing in its step grows with the micro-batch size


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
    stages_per_rank: int | None = None
    precision: str = "fp32"
    optimizer: str = "adamw"
    timeout_s: float = 3600.0
    workers: int | None = None  # processes tracing ranks at once (None: one per core this process may use)

    def __post_init__(self) -> None:
        from mbtune.settings import OPTIMIZERS, as_tuple
        from mbtune.validation import check_types, require

        for name in ("schedules", "micro_batches", "recompute"):
            as_tuple(self, name)
        check_types(self)
        require(self.precision in ("fp32", "bf16"), "precision", self.precision, "fp32 | bf16")
        require(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, " | ".join(OPTIMIZERS))
        for name in ("num_ranks", "data_parallel_size", "grad_accum_steps"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        require(self.device_memory_bytes > 0, "device_memory_bytes", self.device_memory_bytes, "a size above zero")

    def specs(self) -> list[tuple[str, int, str, PipelineSpec | None, str]]:
        """Every configuration (schedule, micro-batches, recompute) as a spec at micro-batch size 1, or None
        with why it cannot run."""
        out: list[tuple[str, int, str, PipelineSpec | None, str]] = []
        for schedule in self.schedules:
            for m in self.micro_batches:
                for recompute in self.recompute:
                    per_rank = stages_per_rank_of(schedule, self.stages_per_rank)
                    why = check_point(schedule, self.num_ranks * per_rank, self.num_ranks, m)
                    point = SweepPoint(schedule=schedule, num_ranks=self.num_ranks, num_micro_batches=m,
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
    num_micro_batches: int
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
    from mbtune.errors import WHOLE_TEXT, WorkloadError
    from mbtune.worker import run_isolated

    result = run_isolated(_plan_here, config, timeout_s=config.timeout_s)
    if result.status != "ok":
        raise WorkloadError(f"the memory plan could not be predicted: {result.cause}", detail=result.error,
                            hint=f"{WHOLE_TEXT[0].upper()}{WHOLE_TEXT[1:]}.")
    if isinstance(result.value, _Refused):  # bad input: the configuration's or the workload's
        raise result.value.error()
    return result.value


@dataclass(frozen=True)
class _Refused:
    """What the child answers where the input is at fault (a configuration the workload it loaded cannot take,
    a workload that cannot be loaded or pipelined): the error to raise, as data."""

    why: str
    hint: str | None = None
    config: bool = False  # a ConfigError (else a WorkloadError)

    def error(self) -> Exception:
        from mbtune.errors import WorkloadError

        return ConfigError(self.why, hint=self.hint) if self.config else WorkloadError(self.why, hint=self.hint)


def _plan_here(config: MemoryPlanConfig) -> MemoryPlan | _Refused:
    from mbtune.errors import WorkloadError

    # The plan is for other machines' devices, traced on fake CPU tensors: this machine's GPUs are hidden, so
    # that nothing the workload's libraries ask of CUDA starts it here (its forked workers could not use it).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        return _plan(config)
    except (ConfigError, WorkloadError) as exc:
        return _Refused(exc.message, exc.hint, config=isinstance(exc, ConfigError))


def _plan(config: MemoryPlanConfig) -> MemoryPlan:
    from mbtune.workloads import load_workload

    started = time.perf_counter()
    workload = load_workload(config.workload, config.workload_options)
    if config.num_ranks > workload.num_blocks:
        raise ConfigError(f"the workload has {workload.num_blocks} blocks, too few for {config.num_ranks} stages")
    from mbtune.pipeline.rank_memory import RankPeaks

    planned = config.specs()
    runnable = {index: spec for index, (*_, spec, _why) in enumerate(planned) if spec is not None}
    traces = _Traces(RankPeaks(workload), config.workers)
    traces.run([replace(spec, micro_batch_size=size) for spec in runnable.values() for size in (1, 2)],
               timeline=True)
    lines = {index: [_Line.of(traces.get(spec, 1, rank), traces.get(spec, 2, rank))
                     for rank in range(spec.num_ranks)] for index, spec in runnable.items()}
    sizes = {index: min(line.largest(config.device_memory_bytes) for line in lines[index]) for index in runnable}
    traces.run([replace(spec, micro_batch_size=sizes[index]) for index, spec in runnable.items()
                if sizes[index] > 2])
    rows = [_row(*planned[index], config, traces, lines.get(index), sizes.get(index, 0))
            for index in range(len(planned))]
    return MemoryPlan(workload=config.workload, workload_options=dict(config.workload_options),
                      device_memory_bytes=config.device_memory_bytes, num_ranks=config.num_ranks,
                      data_parallel_size=config.data_parallel_size, grad_accum_steps=config.grad_accum_steps,
                      precision=config.precision, optimizer=config.optimizer, rows=tuple(rows),
                      seconds=time.perf_counter() - started)


def _row(schedule: str, m: int, recompute: str, spec: PipelineSpec | None, why: str, config: MemoryPlanConfig,
         traces: _Traces, lines: list[_Line] | None, size: int) -> MemoryPlanRow:
    if spec is None or lines is None:
        return MemoryPlanRow(schedule=schedule, num_micro_batches=m, recompute=recompute, micro_batch_size=0,
                             global_batch=0, binding_rank=None, skipped=why)
    memory = config.device_memory_bytes
    at = traces.peaks(spec, max(size, 1))
    for _ in range(MAX_STEPS_DOWN):  # where the lines were optimistic (rounding, a path that changed): the
        if size <= 1 or max(at) <= memory:  # size the lines give in the memory less what they missed
            break
        missed = max(peak - line.peak(size) for peak, line in zip(at, lines, strict=True))
        size = max(1, min(size - 1, *(line.largest(memory - max(missed, 0)) for line in lines)))
        traces.run([replace(spec, micro_batch_size=size)])
        at = traces.peaks(spec, size)
    if max(at) > memory:
        size = 0
    limits = tuple(line.largest(memory) for line in lines)
    binding = min(range(len(limits)), key=lambda r: (limits[r], -at[r]))
    return MemoryPlanRow(schedule=spec.schedule, num_micro_batches=spec.num_micro_batches, recompute=spec.recompute,
                         micro_batch_size=size, global_batch=size * spec.num_micro_batches * spec.grad_accum_steps
                         * spec.data_parallel_size, binding_rank=binding, peak_bytes=at, limits=limits,
                         seconds=traces.seconds(spec))


@dataclass(frozen=True)
class _Line:
    """A rank's live bytes at every moment of its step as a line in the micro-batch size b: at + (b - 1) *
    grows (from the same step counted at sizes 1 and 2; its peak alone where the two steps differ)."""

    at: np.ndarray
    grows: np.ndarray

    @classmethod
    def of(cls, one: RankTrace, two: RankTrace) -> _Line:
        if one.timeline is None or two.timeline is None or len(one.timeline) != len(two.timeline):
            return cls(np.array([one.peak_bytes]), np.array([two.peak_bytes - one.peak_bytes]))
        return cls(one.timeline, two.timeline - one.timeline)

    def peak(self, size: int) -> int:
        return int((self.at + (size - 1) * self.grows).max())

    def largest(self, memory: int) -> int:
        """The largest micro-batch size whose every moment fits `memory` (0: not even one sample)."""
        if int(self.at.max()) > memory:
            return 0
        growing = self.grows > 0
        if not growing.any():
            return NO_LIMIT
        return int(((memory - self.at[growing]) // self.grows[growing]).min()) + 1


class _Traces:
    """Every rank of many specs traced, in forked processes on every core this one may use, and kept by
    (spec, rank) for the plan to read."""

    def __init__(self, predict: RankPeaks, workers: int | None) -> None:
        self.predict = predict
        self.workers = workers or len(os.sched_getaffinity(0))
        self.done: dict[tuple[PipelineSpec, int], RankTrace] = {}

    def run(self, specs: list[PipelineSpec], *, timeline: bool = False) -> None:
        jobs = [(prepared, rank, timeline) for prepared in map(self.predict.prepare, specs)
                for rank in range(prepared.spec.num_ranks)]
        for (prepared, rank, _), trace in zip(jobs, _fork_map(self.predict, jobs, self.workers), strict=True):
            self.done[prepared.spec, rank] = trace

    def get(self, spec: PipelineSpec, size: int, rank: int) -> RankTrace:
        return self.done[replace(spec, micro_batch_size=size), rank]

    def peaks(self, spec: PipelineSpec, size: int) -> tuple[int, ...]:
        return tuple(self.get(spec, size, rank).peak_bytes for rank in range(spec.num_ranks))

    def seconds(self, spec: PipelineSpec) -> float:
        return sum(trace.seconds for (traced, _), trace in self.done.items()
                   if replace(traced, micro_batch_size=1) == spec)


_JOBS: list[tuple[Any, ...]] = []  # what forked workers trace, set before they fork


def _fork_map(predict: RankPeaks, jobs: list[tuple[Prepared, int, bool]], workers: int) -> list[RankTrace]:
    """Each job's rank traced: in this process when one worker would do, else in forked workers (they
    inherit the loaded workload and the prepared fake tensors, so nothing but the answers crosses)."""
    if workers <= 1 or len(jobs) <= 1 or _cuda_started():
        return [predict.rank(prepared, rank, timeline=timeline) for prepared, rank, timeline in jobs]
    _JOBS[:] = [(predict, *job) for job in jobs]
    try:
        with multiprocessing.get_context("fork").Pool(min(workers, len(jobs)), initializer=_one_thread) as pool:
            return pool.map(_traced_job, range(len(jobs)), chunksize=1)
    finally:
        _JOBS.clear()


def _cuda_started() -> bool:
    """Whether CUDA was started in this process: a forked child could not use it (nor trace beside it)."""
    import torch

    return torch.cuda.is_initialized()


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _traced_job(index: int) -> RankTrace:
    predict, prepared, rank, timeline = _JOBS[index]
    return predict.rank(prepared, rank, timeline=timeline)
