"""The code one stage process runs: join the group, build this rank's stages, run timed pipelined steps.

Every optimizer step is `grad_accum_steps` schedule steps whose gradients add up, then (with data-parallel
replicas) one all-reduce of the gradients over the replicas that hold the same stages, then one update. The
loss of each micro-batch is divided by (micro-batches x accumulation steps x replicas), so the summed
gradients equal those of the unpipelined model on one batch of the global batch's samples (the workload's
loss is a mean over the batch). Each replica takes its own slice of every step's samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from mbtune.device.tensor_bytes import TensorBytes, paused
from mbtune.errors import NonFiniteLossError
from mbtune.pipeline.action_timer import ActionTimer
from mbtune.pipeline.handover import Audited, StageShapes, stage_module, step_batch
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.rank_device import (
    count_memory,
    device_uuid,
    peak_memory,
    stop_counting,
    timing_event,
)
from mbtune.pipeline.rank_group import Joined, join_group, leave_group, rank_groups, tie_groups_of
from mbtune.pipeline.schedules import build_schedule, build_stage, on_forward_chunk, prime_schedule, run_schedule_step
from mbtune.pipeline.split import StageBlocks, split_blocks
from mbtune.pipeline.theory import stages_of_rank
from mbtune.pipeline.timeline import StageReport
from mbtune.training import on_device
from mbtune.workloads import Workload, load_workload
from mbtune.workloads.chain import batch_rows, batch_to, handover_keys, tensors_of

# A rank asked to hang (tests only) sleeps this long; the launcher's deadline must end it.
HANG_S = 3600.0
# Gradients are all-reduced in buckets that close once they reach this many bytes (DDP's default bucket
# size), so the reduction never needs a second copy of every gradient at once.
BUCKET_BYTES = 25 * 1024 * 1024


def stage_blocks(spec: PipelineSpec, workload: Workload) -> StageBlocks:
    """The global block indices of every stage (all ranks), split as the spec's balance says."""
    weights: Sequence[float] | None = {"parameters": workload.compute_weights, "time": lambda: spec.block_weights,
                                       "blocks": lambda: None}[spec.balance]()
    return split_blocks(workload.num_blocks, spec.num_model_stages, weights)


def run_rank(spec: PipelineSpec, *, rank: int, store_path: str | None, hang_rank: int | None = None,
             on_placed: Callable[[tuple[int, ...]], None] | None = None) -> StageReport:
    """Run this rank's share of the point in a process of its own and report what it measured.

    `rank` is this process's rank in the world (spec.place says which pipeline rank of which replica);
    `store_path` names a torch FileStore file that is fresh for this point (no ports, no races), or is
    None under torchrun, where the process group comes from the environment the elastic agent set
    (MASTER_ADDR, MASTER_PORT) and LOCAL_RANK names this process's GPU;
    `hang_rank` makes that rank sleep before its first step, to test deadlines; `on_placed` is told the
    global block indices this rank holds as soon as they are known, so a failure can name them. A NaN or
    infinite loss raises NonFiniteLossError at that step.
    """
    joined = join_group(spec, rank=rank, store_path=store_path)
    report = run_joined(spec, joined, hang_rank=hang_rank, on_placed=on_placed)
    # Only on success: tearing the group down on failure would let peers fail (and report) before we do.
    leave_group()
    # This process's whole CPU time (a forked rank starts from zero): it lives for this point alone.
    return replace(report, cpu_time_s=time.process_time())


def run_joined(spec: PipelineSpec, joined: Joined, *, hang_rank: int | None = None,
               on_placed: Callable[[tuple[int, ...]], None] | None = None) -> StageReport:
    """One point on a rank already in its group: the workload loaded and this rank's stages built afresh,
    the memory count (CPU) or the allocator's peak (CUDA) started from what this point holds, the steps run.
    The report's CPU time is this point's alone."""
    import gc

    started_cpu_s = time.process_time()
    device, rank = joined.device, joined.rank
    gc.collect()  # a kept process: the previous point's stages gone before this one's are built
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    count = count_memory(device) if spec.count_memory else None
    workload = load_workload(spec.workload, spec.workload_options)
    all_blocks = stage_blocks(spec, workload)
    pipeline_group, replica_group = rank_groups(spec, rank)
    tie_groups = tie_groups_of(spec, workload, all_blocks, rank)
    report = RankRun(spec, rank, device, workload, all_blocks, on_placed, pipeline_group=pipeline_group,
                      replica_group=replica_group, tie_groups=tie_groups, count=count).run(hang=hang_rank == rank)
    # This point's CPU time (from zero in a forked rank), so the parent can tell its own CPU use from others'.
    return replace(report, cpu_time_s=time.process_time() - started_cpu_s, cores=joined.cores)


@dataclass
class StepTimes:
    step_s: list[float] = field(default_factory=list)
    pipeline_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    cuda_step_s: list[float] = field(default_factory=list)  # CUDA events: origin to the step's last work
    allreduce_spans_s: list[tuple[float, float]] = field(default_factory=list)  # from the step's origin
    first_start_unix_s: float | None = None  # time.time() as the first step started (NVML samples use it)
    last_end_unix_s: float | None = None  # time.time() as the last step ended


class RankRun:
    """One rank's stages, schedule, optimizer and timers."""

    def __init__(self, spec: PipelineSpec, process: int, device: torch.device, workload: Workload,
                 all_blocks: StageBlocks, on_placed: Callable[[tuple[int, ...]], None] | None = None, *,
                 pipeline_group: dist.ProcessGroup | None = None,
                 replica_group: dist.ProcessGroup | None = None,
                 tie_groups: dict[int, dist.ProcessGroup] | None = None, count: TensorBytes | None = None,
                 stage_shapes: dict[int, StageShapes] | None = None,
                 keys: Sequence[tuple[str, ...] | None] | None = None) -> None:
        self.spec, self.device, self.workload, self.count = spec, device, workload, count
        self.rank, self.replica = spec.place(process)
        self.replica_group, self.tie_groups = replica_group, tie_groups or {}
        self.stage_indices = stages_of_rank(spec.schedule, spec.num_ranks, spec.num_model_stages, self.rank)
        self.blocks = tuple(all_blocks[s] for s in self.stage_indices)
        if on_placed is not None:
            on_placed(tuple(b for blocks in self.blocks for b in blocks))
        self.modules = [on_device(workload.build(b, seed=spec.seed, recompute=spec.recompute), device) for b in self.blocks]
        self.tied = _tie_across(workload, self.modules, self.blocks)
        self.has_first = 0 in self.stage_indices
        self.has_last = spec.num_model_stages - 1 in self.stage_indices
        self.timer = ActionTimer(new_event=timing_event if device.type == "cuda" else None)
        if keys is None:
            with paused(count):  # a trace of shapes, not training memory
                keys = handover_keys(workload, spec.seed) if spec.num_model_stages > 1 else ()
        last = spec.num_model_stages - 1
        self.audits = [Audited(stage_module(spec, m, b, keys, device, last=s == last), stage=s, first=s == 0,
                               last=s == last) if spec.capture_grads else None
                       for m, s, b in zip(self.modules, self.stage_indices, self.blocks)]
        stages = [build_stage(audit or stage_module(spec, m, b, keys, device, last=s == last), stage_index=s,
                              num_model_stages=spec.num_model_stages, device=device, group=pipeline_group,
                              shapes=(stage_shapes or {}).get(s))
                  for audit, m, s, b in zip(self.audits, self.modules, self.stage_indices, self.blocks)]
        for stage, audit in zip(stages, self.audits):
            self.timer.instrument(stage)
            if audit is not None:
                on_forward_chunk(stage, audit.arm)
        self.stages = stages
        self.schedule = build_schedule(spec.schedule, stages, num_micro_batches=spec.num_micro_batches,
                                       loss_fn=self.timer.wrap_loss(self._scaled_loss))
        self.parameters = list({id(p): p for m in self.modules for p in m.parameters()}.values())
        self.optimizer = _make_optimizer(spec, self.parameters)
        self.output_dtype = ""
        self.read_losses = True  # off where the tensors are fake (pipeline/rank_memory.py): they hold no values

    def _sum_tied(self) -> None:
        """Each tie held on several ranks: its copies' gradients summed over those ranks (the update is then
        the tied model's on every copy)."""
        for index, group in sorted(self.tie_groups.items()):
            parameter = self.tied[index]
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, group=group)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        first = tensors_of(output)[0]  # a model may return a tuple, its own loss beside the logits
        self.output_dtype = str(first.dtype).removeprefix("torch.")
        spec = self.spec
        return self.workload.loss(output, target) / (spec.num_micro_batches * spec.grad_accum_steps * spec.data_parallel_size)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _barrier(self) -> None:
        self._synchronize()
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def run(self, *, hang: bool) -> StageReport:
        spec = self.spec
        if hang:
            time.sleep(HANG_S)
        warmup_steps = spec.warmup_steps
        if spec.primed:
            args, target = self._step_inputs(0, 0)
            if prime_schedule(self.schedule, args, target=target):
                warmup_steps = max(0, warmup_steps - 1)  # the first warm-up step's work is done
        total_steps = warmup_steps + spec.measured_steps
        warmup = StepTimes()
        measured = StepTimes()
        grads = None
        for step in range(total_steps):
            is_measured = step >= warmup_steps
            capture = spec.capture_grads and step == total_steps - 1
            step_grads = self._optimizer_step(step, measured if is_measured else warmup,
                                              timed_step=step - warmup_steps if is_measured else None,
                                              capture=capture)
            grads = step_grads if capture else grads
            if step + 1 >= max(warmup_steps, 1):
                stop_counting(self.count)  # the warmup steps (or the first) held what every step holds
        return self._report(warmup, measured, grads)

    def _optimizer_step(self, step: int, times: StepTimes, *, timed_step: int | None,
                        capture: bool) -> dict[str, torch.Tensor] | None:
        self._barrier()
        start = time.perf_counter()
        start_unix_s = time.time()
        if timed_step is not None:
            self.timer.begin_step()
        losses: list[torch.Tensor] = []
        for accum in range(self.spec.grad_accum_steps):
            if timed_step is not None:
                self.timer.start(step=timed_step, accum=accum, origin_s=start)
            losses += self._pipeline_step(step, accum)
            self.timer.stop()
        self._sum_tied()
        self._barrier()
        pipeline_end = time.perf_counter()
        if self.replica_group is not None:
            self._all_reduce()
            times.allreduce_spans_s.append((pipeline_end - start, time.perf_counter() - start))
        grads = self._gradients() if capture else None
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.timer.end_step()
        self._barrier()
        end = time.perf_counter()
        end_unix_s = time.time()
        cuda_step_s = self.timer.finish_step()  # reads this step's events, outside the timed region
        if cuda_step_s is not None:
            times.cuda_step_s.append(cuda_step_s)
        if times.first_start_unix_s is None:
            times.first_start_unix_s = start_unix_s
        times.last_end_unix_s = end_unix_s
        times.step_s.append(end - start)
        times.pipeline_s.append(pipeline_end - start)
        if losses and self.read_losses:
            loss = float(torch.stack([loss.detach().float() for loss in losses]).sum())
            if not math.isfinite(loss):
                raise NonFiniteLossError(loss, step + 1)
            times.losses.append(loss)
        return grads

    def _step_inputs(self, step: int, accum: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """What this rank's schedule takes for one pipeline step: the inputs on the first stage's rank, the
        target on the last's."""
        spec = self.spec
        if not (self.has_first or self.has_last):
            return (), None
        inputs, targets = step_batch(self.workload, spec.replicas_batch_size, seed=spec.seed,
                                     step_index=step, accum_index=accum)
        mine = slice(self.replica * spec.pipeline_batch_size, (self.replica + 1) * spec.pipeline_batch_size)
        inputs, targets = batch_to(batch_rows(inputs, mine), self.device), targets[mine]
        args = (tuple(inputs) if isinstance(inputs, tuple) else (inputs,)) if self.has_first else ()
        return args, targets.to(self.device) if self.has_last else None

    def _pipeline_step(self, step: int, accum: int) -> list[torch.Tensor]:
        args, target = self._step_inputs(step, accum)
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        run_schedule_step(self.schedule, args, target=target, losses=losses)
        return losses or []

    def _all_reduce(self) -> None:
        """Sum this rank's gradients over the replicas that hold the same stages, bucket by bucket (each
        flattened into one tensor, reduced, copied back), and wait until it is done."""
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in [p.grad for p in self.parameters if p.grad is not None]:
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= BUCKET_BYTES:
                self._reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            self._reduce_bucket(bucket)
        self._synchronize()

    def _reduce_bucket(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.replica_group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def _gradients(self) -> dict[str, torch.Tensor]:
        """This rank's gradients on the CPU, named as in the whole model (`<block>.<param>`); a tie's copies
        after its first are the first (the whole model names it once)."""
        grads: dict[str, torch.Tensor] = {}
        copies = self.workload.tied_copies()
        for module, blocks in zip(self.modules, self.blocks):
            for name, param in module.named_parameters():
                local, _, rest = name.partition(".")
                if param.grad is not None and (blocks[int(local)], rest) not in copies:
                    grads[f"{blocks[int(local)]}.{rest}"] = param.grad.detach().to("cpu", copy=True)
        return grads

    def _report(self, warmup: StepTimes, measured: StepTimes, grads: dict[str, torch.Tensor] | None) -> StageReport:
        peak, source = peak_memory(self.device, self.count)
        return StageReport(
            rank=self.rank, num_ranks=self.spec.num_ranks, replica=self.replica, device=str(self.device),
            stage_indices=self.stage_indices, block_indices=self.blocks,
            num_parameters=sum(p.numel() for p in self.parameters),
            step_times_s=tuple(measured.step_s), pipeline_times_s=tuple(measured.pipeline_s),
            warmup_step_times_s=tuple(warmup.step_s), actions=tuple(self.timer.records),
            allreduce_spans_s=tuple(measured.allreduce_spans_s),
            losses=tuple(measured.losses), peak_memory_bytes=peak, memory_source=source, grads=grads,
            output_dtype=self.output_dtype, cuda_step_times_s=tuple(measured.cuda_step_s),
            measured_window_unix_s=(measured.first_start_unix_s, measured.last_end_unix_s)
            if measured.first_start_unix_s is not None and measured.last_end_unix_s is not None else None,
            device_uuid=device_uuid(self.device),
            crossings=tuple(c for audit in self.audits if audit is not None for c in audit.crossings),
        )


def _tie_across(workload: Workload, modules: Sequence[nn.Module],
                blocks: Sequence[Sequence[int]]) -> dict[int, nn.Parameter]:
    """Per tie with a member on this rank: one parameter for every member this rank holds (its stages are
    separate builds), returned by tie index."""
    where = {block: (module, position) for module, held in zip(modules, blocks)
             for position, block in enumerate(held)}
    tied = {}
    for index, tie in enumerate(workload.ties):
        held = [(where[b], name) for b, name in tie if b in where]
        if not held:
            continue
        (module, position), name = held[0]
        shared = module.get_parameter(f"{position}.{name}")
        for (other, other_position), other_name in held[1:]:
            owner, _, leaf = f"{other_position}.{other_name}".rpartition(".")
            setattr(other.get_submodule(owner), leaf, shared)
        tied[index] = shared
    return tied


def _make_optimizer(spec: PipelineSpec, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer | None:
    if not params:
        return None
    from mbtune.training import create_optimizer_state, make_optimizer

    optimizer = make_optimizer(spec.optimizer, list(params), lr=spec.lr)
    create_optimizer_state(list(params), optimizer)  # so every step, the first included, holds what training holds
    return optimizer
