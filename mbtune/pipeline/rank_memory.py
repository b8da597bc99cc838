"""Every rank's peak memory, predicted before anything runs.

Each pipeline rank's own code runs as it would in a sweep (runner.py: its stages, the schedule's own action
order, its micro-batches, accumulation, recompute, precision, optimizer and its state, data-parallel buckets,
tied-weight sums), one optimizer step of it, on fake tensors: shapes and storages without memory or
arithmetic (torch's FakeTensorMode, which picks each operator's kernel as the real device would: CPU attention
saves what CPU attention saves), with torch's fake process group answering every send, receive and
all-reduce at once. Its live tensor bytes are counted as the CPU budget counts them (device/tensor_bytes.py),
so the prediction is the peak a sweep's rank measures on the CPU; for a CUDA spec, predicted where CUDA is
visible, the cuBLAS workspaces the rank's allocator hands out are added (device/cuda.py), as the allocated
peak counts them. The model is never built for real: 8B parameters predict as fast as 8M.

A real send's work object holds the tensor it sends for as long as the schedule holds the work (the
multi-stage schedules wait for their sends at the end of the step); the fake process group's works hold
nothing, so here each is wrapped to hold its tensors the same way.

Every micro-batch of a stage runs the same operators on tensors of the same shapes, so only the first two of a
stage's forward order and of its backward order are computed; the others are echoed (pipeline/echoes.py): in
the counted bytes they rise, keep and let go as the module's last real pass did, while the schedule, its
sends, receives, buffers, losses and the optimizer run as they are. Each echo checks that it ends where the
pass it stands for ended; where one does not (or cannot be made), the rank is traced again with every
micro-batch computed. Echoed and computed steps predict the same peaks (bench/memory.py --against-computed).

Stage shapes are known before the step (one fake forward of the chain at the micro-batch size), so each
stage is built with them and torch's first-step shape exchange between ranks is skipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mbtune.device.cuda import training_workspace_bytes
from mbtune.device.tensor_bytes import TensorBytes, fake_tensors
from mbtune.pipeline.echoes import NUM_REAL, echo_stages, real_microbatches
from mbtune.pipeline.handover import stage_shapes
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.schedules import StageShapes, take_shapes_as_given, works_hold_their_tensors
from mbtune.workloads import Workload, load_workload
from mbtune.workloads.chain import handover_keys

CPU = torch.device("cpu")


def predict_rank_peaks(spec: PipelineSpec, *, workload: Workload | None = None) -> tuple[int, ...]:
    """Peak live tensor bytes of every pipeline rank (of the first replica; the others hold the same), in
    rank order, over one optimizer step that follows the optimizer's state being created. `workload`: the
    spec's, loaded already (a traced model is traced once, for real, on the meta device)."""
    if workload is None:
        workload = load_workload(spec.workload, spec.workload_options)
    return RankPeaks(workload)(spec)


@dataclass(frozen=True)
class Prepared:
    """What every rank of one spec shares: the fake mode its tensors live in, the stages' blocks and shapes."""

    spec: PipelineSpec
    mode: Any
    blocks: tuple[tuple[int, ...], ...]
    shapes: dict[int, StageShapes]
    keys: tuple[tuple[str, ...] | None, ...]


@dataclass(frozen=True)
class RankTrace:
    peak_bytes: int
    timeline: np.ndarray | None = None  # live bytes after every operator, when asked for
    seconds: float = 0.0
    num_echoed: int = 0  # stage forwards echoed from earlier micro-batches' (pipeline/echoes.py)


class RankPeaks:
    """Predicts the ranks' peaks of many specs of one workload; what does not depend on the spec (the blocks'
    handover keys, a trace of the whole chain) is found once."""

    def __init__(self, workload: Workload, *, echoes: bool = True) -> None:
        self.workload = workload
        self.echoes = echoes  # later micro-batches echoed from earlier ones (else every one computed)
        self._keys: dict[int, tuple[tuple[str, ...] | None, ...]] = {}

    def keys(self, spec: PipelineSpec) -> tuple[tuple[str, ...] | None, ...]:
        if spec.num_model_stages == 1:
            return ()
        if spec.seed not in self._keys:
            self._keys[spec.seed] = handover_keys(self.workload, spec.seed)
        return self._keys[spec.seed]

    def __call__(self, spec: PipelineSpec) -> tuple[int, ...]:
        prepared = self.prepare(spec)
        return tuple(self.rank(prepared, rank).peak_bytes for rank in range(spec.num_ranks))

    def prepare(self, spec: PipelineSpec) -> Prepared:
        """The fake mode, blocks and stage shapes of `spec` (its ranks may then be traced in any process)."""
        from mbtune.pipeline.runner import stage_blocks

        keys = self.keys(spec)
        mode = fake_tensors()
        with mode:
            blocks = tuple(tuple(b) for b in stage_blocks(spec, self.workload))
            shapes = stage_shapes(spec, self.workload, blocks, keys, CPU)
        return Prepared(spec=spec, mode=mode, blocks=blocks, shapes=shapes, keys=keys)

    def rank(self, prepared: Prepared, rank: int, *, timeline: bool = False) -> RankTrace:
        """One rank's step on fake tensors: its peak (and its live bytes after every operator)."""
        started = time.perf_counter()
        spec = prepared.spec
        extra = training_workspace_bytes(spec.device)
        with prepared.mode:
            try:
                count, num_echoed = _rank_count(spec, self.workload, prepared, rank, timeline=timeline,
                                                echoes=self.echoes)
            except Exception:
                if not self.echoes:
                    raise
                num_echoed = -1  # the step computed whole says what is wrong, if it is not the echoes
            if num_echoed < 0:  # an echo did not reproduce what it stood for: every micro-batch computed
                count, num_echoed = _rank_count(spec, self.workload, prepared, rank, timeline=timeline,
                                                echoes=False)
        line = None if count.timeline is None else np.asarray(count.timeline, dtype=np.int64) + extra
        return RankTrace(peak_bytes=extra + count.peak_bytes, timeline=line, seconds=time.perf_counter() - started,
                         num_echoed=num_echoed)


def _real(spec: PipelineSpec, rank: int) -> dict[int, frozenset[int]] | None:
    """Per stage of the pipeline rank, the micro-batches its step computes for real; None where none are
    echoed (a schedule that splits the backward, or too few micro-batches to echo any)."""
    from mbtune.pipeline.schedules import schedule_action_orders
    from mbtune.pipeline.theory import schedule_info

    if schedule_info(spec.schedule).splits_backward or spec.num_micro_batches <= NUM_REAL:
        return None
    try:
        orders = schedule_action_orders(spec.schedule, num_ranks=spec.num_ranks,
                                        num_micro_batches=spec.num_micro_batches, stages_per_rank=spec.num_model_stages // spec.num_ranks)
    except ValueError:
        return None
    return real_microbatches(orders[rank])


def _rank_count(spec: PipelineSpec, workload: Workload, prepared: Prepared, rank: int, *,
                timeline: bool, echoes: bool) -> tuple[TensorBytes, int]:
    """The rank's step counted, and how many stage forwards were echoed (-1: an echo failed its check)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mbtune.pipeline.rank_group import rank_groups, tie_groups_of
    from mbtune.pipeline.runner import RankRun, StepTimes

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.world_size)
    try:
        count = TensorBytes(timeline=timeline)
        with count, works_hold_their_tensors():
            pipeline_group, replica_group = rank_groups(spec, rank)
            run = RankRun(spec, rank, CPU, workload, prepared.blocks, pipeline_group=pipeline_group,
                           replica_group=replica_group,
                           tie_groups=tie_groups_of(spec, workload, prepared.blocks, rank), count=count,
                           stage_shapes=prepared.shapes, keys=prepared.keys)
            take_shapes_as_given(run.schedule)
            echoing = echo_stages(run.stages, count, real) if echoes and (real := _real(spec, run.rank)) else []
            run.read_losses = False
            run._optimizer_step(0, StepTimes(), timed_step=None, capture=False)
        if any(module.failed for module in echoing):
            return count, -1
        return count, sum(module.num_echoed for module in echoing)
    finally:
        dist.destroy_process_group()
