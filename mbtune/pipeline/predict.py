"""Every rank's peak memory, predicted before anything runs.

Each pipeline rank's own code runs as it would in a sweep (runner.py: its stages, the schedule's own action
order, its micro-batches, accumulation, recompute, precision, optimizer and its state, data-parallel buckets,
tied-weight sums), one optimizer step of it, on fake tensors: shapes and storages without memory or
arithmetic (torch's FakeTensorMode, which picks each operator's kernel as the real device would: CPU attention
saves what CPU attention saves), with torch's fake process group answering every send, receive and
all-reduce at once. Its live tensor bytes are counted as the CPU budget counts them (device/tensor_bytes.py),
so the prediction is the peak a sweep's rank measures on the CPU, and the allocated peak a CUDA rank's
allocator reports, less what CUDA adds on its own (cuBLAS workspaces, the allocator's rounding of large
blocks). The model is never built for real: 8B parameters predict as fast as 8M.

A real send's work object holds the tensor it sends for as long as the schedule holds the work (the
multi-stage schedules wait for their sends at the end of the step); the fake process group's works hold
nothing, so here each is wrapped to hold its tensors the same way.

Stage shapes are known before the step (one fake forward of the chain at the micro-batch size), so each
stage is built with them and torch's first-step shape exchange between ranks is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mbtune.device.tensor_bytes import TensorBytes, fake_tensors
from mbtune.pipeline.schedules import StageShapes, take_shapes_as_given, works_hold_their_tensors
from mbtune.pipeline.spec import PipelineSpec
from mbtune.workloads import Workload, load_workload
from mbtune.workloads.chain import handover_keys

CPU = torch.device("cpu")


def predict_rank_peaks(spec: PipelineSpec, *, workload: Workload | None = None) -> tuple[int, ...]:
    """Peak live tensor bytes of every pipeline rank (of the first replica; the others hold the same), in
    rank order, over one optimizer step that follows the optimizer's state being created. `workload`: the
    spec's, loaded already (a traced model is traced once, for real, on the meta device)."""
    from mbtune.pipeline.runner import stage_blocks

    if workload is None:
        workload = load_workload(spec.workload, spec.workload_options)
    with fake_tensors():
        blocks = stage_blocks(spec, workload)
        shapes = stage_shapes(spec, workload, blocks)
        return tuple(_rank_peak(spec, workload, blocks, shapes, rank) for rank in range(spec.num_ranks))


def stage_shapes(spec: PipelineSpec, workload: Workload, blocks: Sequence[Sequence[int]]) -> dict[int, StageShapes]:
    """Per model stage, its inputs and outputs of one micro-batch (from one forward of the chain)."""
    from mbtune.pipeline.runner import stage_module, step_batch

    keys = handover_keys(workload, spec.seed) if spec.num_model_stages > 1 else ()
    inputs, _ = step_batch(workload, spec.micro_batch_size, seed=spec.seed, step_index=0, accum_index=0)
    args = tuple(inputs) if isinstance(inputs, tuple) else (inputs,)
    shapes: dict[int, StageShapes] = {}
    for stage, stage_blocks in enumerate(blocks):
        module = stage_module(spec, workload.build(stage_blocks, seed=spec.seed, recompute="none"), stage_blocks,
                              keys, CPU, last=stage == len(blocks) - 1)
        out = module(*args)
        outputs = tuple(out) if isinstance(out, tuple | list) else (out,)
        shapes[stage] = (args, outputs)
        args = outputs
    return shapes


def _rank_peak(spec: PipelineSpec, workload: Workload, blocks: Sequence[Sequence[int]],
               shapes: dict[int, StageShapes], rank: int) -> int:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mbtune.pipeline.runner import _groups, _RankRun, _StepTimes, _tie_groups

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.world_size)
    try:
        count = TensorBytes()
        with count, works_hold_their_tensors():
            pipeline_group, replica_group = _groups(spec, rank)
            run = _RankRun(spec, rank, CPU, workload, tuple(tuple(b) for b in blocks), pipeline_group=pipeline_group,
                           replica_group=replica_group, tie_groups=_tie_groups(spec, workload, tuple(tuple(b) for b in blocks), rank),
                           count=count, stage_shapes=shapes)
            take_shapes_as_given(run.schedule)
            run.read_losses = False
            run._optimizer_step(0, _StepTimes(), timed_step=None, capture=False)
        return count.peak_bytes
    finally:
        dist.destroy_process_group()
