"""What crosses a stage boundary: the module a stage runs, the shapes its hand-overs have (traced on fake
tensors where memory is predicted), and an audit of what each boundary sent and received.

The audit (`mbtune check` only): every tensor a stage sends or receives, forward and backward, is recorded
as its dtype, shape and a digest of its bytes, keyed by the stage's forward count and the tensor's position;
`first_difference` pairs each boundary's sent records with the next stage's received ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.schedules import StageShapes
from mbtune.training import on_device
from mbtune.workloads import Workload
from mbtune.workloads.chain import StageModule, batch_rows

FORWARD, BACKWARD = "forward", "backward"
SENT, RECEIVED = "sent", "received"


def step_batch(
    workload: Workload, batch_size: int, *, seed: int, step_index: int, accum_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) of one pipeline step, the same on every rank and in reference runs."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step_index * 10_007 + accum_index)
    return workload.make_batch(batch_size, generator)


class _Autocast(nn.Module):
    """Runs a stage's blocks under autocast; the parameters stay the blocks' own (fp32 master weights)."""

    def __init__(self, inner: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.device_type, self.dtype = inner, device.type, dtype

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            return self.inner(*args)


def stage_module(spec: PipelineSpec, module: nn.Module, blocks: Sequence[int],
                 keys: Sequence[tuple[str, ...] | None], device: torch.device, *, last: bool) -> nn.Module:
    """The module a stage of these blocks runs: their chain, taking and handing over flat tensors, under
    the spec's precision. `keys`: handover_keys (empty with one stage); `last`: the model's last stage."""
    stage = StageModule(module, in_keys=keys[blocks[0] - 1] if blocks[0] > 0 else None,
                        out_keys=keys[blocks[-1]] if keys else None, last=last)
    return _Autocast(stage, device, torch.bfloat16) if spec.precision == "bf16" else stage


def stage_shapes(spec: PipelineSpec, workload: Workload, blocks: Sequence[Sequence[int]],
                 keys: Sequence[tuple[str, ...] | None], device: torch.device) -> dict[int, StageShapes]:
    """Per model stage, its inputs and outputs of one micro-batch (from one forward of the chain on
    `device`'s operators; run it under fake tensors, where it costs no memory)."""
    # The first micro-batch as the step hands it over (the replicas' batch, the first replica's rows, torch's
    # chunk of them): torch checks given inputs against it, strides too, and a batch of one sample made at
    # size one can have other strides (a size-1 dimension's stride is free).
    inputs, _ = step_batch(workload, spec.replicas_batch_size, seed=spec.seed, step_index=0, accum_index=0)
    rows = batch_rows(inputs, slice(0, spec.pipeline_batch_size))
    args = tuple(torch.tensor_split(t.to(device), spec.num_micro_batches, 0)[0]
                 for t in (rows if isinstance(rows, tuple) else (rows,)))
    shapes: dict[int, StageShapes] = {}
    for stage, held in enumerate(blocks):
        built = on_device(workload.build(held, seed=spec.seed, recompute="none"), device)
        module = stage_module(spec, built, held, keys, device, last=stage == len(blocks) - 1)
        out = module(*args)
        outputs = tuple(out) if isinstance(out, tuple | list) else (out,)
        shapes[stage] = (args, outputs)
        args = outputs
    return shapes


@dataclass(frozen=True)
class Crossing:
    """One tensor at one side of a boundary: which stage, which way, which forward of it, which position."""

    stage: int
    direction: str  # forward | backward
    side: str  # sent | received
    call: int  # the stage's forward count (every micro-batch of every step, in order)
    position: int
    dtype: str
    shape: tuple[int, ...]
    digest: str

    @property
    def what(self) -> str:
        return f"{self.dtype} {tuple(self.shape)}"


def fingerprint(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """(dtype, shape, digest of the values' bytes): equal exactly when two tensors are."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    digest = hashlib.blake2b(raw.numpy().tobytes(), digest_size=12).hexdigest()
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), digest


class Audited(nn.Module):
    """A stage's module that records what it receives and sends, forward and backward (see Crossing)."""

    def __init__(self, inner: nn.Module, *, stage: int, first: bool, last: bool) -> None:
        super().__init__()
        self.inner, self.stage, self.first, self.last = inner, stage, first, last
        self.calls = 0
        self.armed = False  # the next forward is a schedule's micro-batch, not torch's shape inference
        self.crossings: list[Crossing] = []

    def arm(self, microbatch: int) -> None:
        """The schedule is about to compute `microbatch`'s forward (pipeline/schedules.py on_forward_chunk)."""
        self.armed = True

    def _record(self, direction: str, side: str, call: int, position: int, tensor: torch.Tensor) -> None:
        dtype, shape, digest = fingerprint(tensor)
        self.crossings.append(Crossing(stage=self.stage, direction=direction, side=side, call=call,
                                       position=position, dtype=dtype, shape=shape, digest=digest))

    def _watch_grad(self, tensor: torch.Tensor, side: str, call: int, position: int) -> None:
        if tensor.requires_grad:
            def seen(grad: torch.Tensor) -> None:
                handle.remove()  # once: torch receives into the same buffer again in later steps
                self._record(BACKWARD, side, call, position, grad)
            handle = tensor.register_hook(seen)

    def forward(self, *tensors: torch.Tensor) -> Any:
        if not self.armed:  # torch's shape inference runs the stage on buffers of zeros: nothing was sent
            return self.inner(*tensors)
        self.armed = False
        call, self.calls = self.calls, self.calls + 1
        if not self.first:
            for i, tensor in enumerate(tensors):
                self._record(FORWARD, RECEIVED, call, i, tensor)
                self._watch_grad(tensor, SENT, call, i)  # its gradient goes back to the stage before
        out = self.inner(*tensors)
        if self.last:
            return out
        # Each sent tensor its own node (a copy: check mode only), so its hook sees the gradient that came
        # back for it alone, not the sum over every output computed from it.
        sent = tuple(t.clone() if t.requires_grad else t for t in (out if isinstance(out, tuple | list) else (out,)))
        for i, tensor in enumerate(sent):
            self._record(FORWARD, SENT, call, i, tensor)
            self._watch_grad(tensor, RECEIVED, call, i)  # its gradient comes from the stage after
        return sent if isinstance(out, tuple | list) else sent[0]


def first_difference(crossings: Sequence[Crossing]) -> tuple[int, str]:
    """How many tensors crossed a boundary and were compared, and the first (by stage, forward before
    backward, call, position) whose receiver got other than its sender sent ("" where none did)."""
    by_key = {(c.stage, c.direction, c.side, c.call, c.position): c for c in crossings}
    compared, problems = 0, []
    for (stage, direction, side, call, position), sent in sorted(by_key.items()):
        if side != SENT:
            continue
        # Forward: stage s sends to s + 1. Backward: stage s sends its inputs' gradients to s - 1.
        peer = stage + 1 if direction == FORWARD else stage - 1
        got = by_key.get((peer, direction, RECEIVED, call, position))
        if got is None:
            if direction == FORWARD:
                problems.append((stage, direction, call, position,
                                 f"stage {stage} sent {sent.what} forward (micro-batch {call}, tensor {position}) "
                                 f"and stage {peer} received nothing"))
            continue
        compared += 1
        if (got.dtype, got.shape, got.digest) != (sent.dtype, sent.shape, sent.digest):
            change = "other values" if (got.dtype, got.shape) == (sent.dtype, sent.shape) else got.what
            problems.append((stage, direction, call, position,
                             f"stage {stage} sent {sent.what} {direction} to stage {peer} (forward {call}, tensor "
                             f"{position}) and it received {change}"))
    order = {FORWARD: 0, BACKWARD: 1}
    problems.sort(key=lambda p: (order[p[1]], p[2], p[0], p[3]))
    return compared, problems[0][4] if problems else ""
