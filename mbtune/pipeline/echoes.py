"""A traced rank step's later micro-batches echoed from its earlier ones (memory predictions only).

Every micro-batch of a stage runs the same operators on tensors of the same shapes, so a fake step spends
most of its time computing what it already knows. Here each stage's module computes for real (on fake
tensors) only the micro-batches that come first in its forward order and first in its backward order (two
of each); every other micro-batch's forward is echoed: a stand-in that takes the stage's inputs and, in
the counted live bytes, does what the module's last real forward did: rises to its high-water mark above
its start and falls back, keeps what the module kept for its backward, and hands over fresh outputs of the
same shapes, strides and dtypes (or the very input where the module handed an input on). Its backward does
what the module's last real backward did (not the stage's first, which creates the gradients): rises to
its high-water mark above its start, lets go of what the forward kept, and hands back input gradients.
Everything around the module stays real: the schedule's action order, its sends, receives and their
buffers, the loss and its backward, gradient accumulation, the optimizer step.

A real forward is measured from its call to its return; a real backward from the moment the gradient of
the module's output arrives (a hook on the output) to the end of that backward pass (a callback of
autograd's engine), which is where the stand-in's backward runs and ends too. Each echo checks that it
reproduced what it stands for (the live bytes it ends at); where one cannot (outputs that share storage with
each other, are views into a larger tensor or of what the module held before, a schedule that splits the
backward, a pass not yet seen), the trace says so and the rank is traced again without echoes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mbtune.actions import BACKWARD, FORWARD
from mbtune.device.tensor_bytes import TensorBytes, block_bytes
from mbtune.pipeline.schedules import at_backward_end, on_forward_chunk

NUM_REAL = 2  # micro-batches computed for real at the head of a stage's forward order and of its backward order


@dataclass(frozen=True)
class _Output:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    alias: int | None  # the position of the input handed on as this output (None: a fresh tensor)


@dataclass(frozen=True)
class _Forward:
    high: int  # the live bytes' highest point above the forward's start
    kept: int  # what the module still held after it, beyond its fresh outputs
    outputs: tuple[_Output, ...]


@dataclass(frozen=True)
class _Backward:
    high: int  # the highest point above the moment the output's gradient arrived
    change: int  # the live bytes at the end of the backward pass, less those at that moment


class Echoing(nn.Module):
    """A stage's module whose micro-batches outside `real` are echoed (see the module's text)."""

    def __init__(self, inner: nn.Module, count: TensorBytes, real: frozenset[int]) -> None:
        super().__init__()
        self.inner, self.count, self.real = inner, count, real
        # An input of every echo that requires a gradient, so its outputs do where the module's do (a first
        # stage's inputs are token ids): a parameter, which the echo's backward leaves alone.
        self.anchor = next((p for p in inner.parameters() if p.requires_grad), None)
        self.chunk = 0  # the micro-batch the stage is computing (set by its forward_one_chunk)
        self.forward_seen: _Forward | None = None
        self.backward_seen: _Backward | None = None
        self.num_backwards = 0
        self.num_echoed = 0
        self.failed = ""  # why an echo did not reproduce what it stood for

    def forward(self, *args: torch.Tensor) -> Any:
        if self.chunk in self.real or self.forward_seen is None or self.failed:
            return self._real(args)
        self.num_echoed += 1
        outputs = _Echo.apply(self, self.anchor, *args)
        return outputs[0] if len(outputs) == 1 else outputs

    def _real(self, args: Sequence[torch.Tensor]) -> Any:
        count = self.count
        start, high_before = count.live_bytes, count.peak_bytes
        count.peak_bytes = start
        out = self.inner(*args)
        high, end = count.peak_bytes - start, count.live_bytes - start
        count.peak_bytes = max(high_before, count.peak_bytes)
        outputs = tuple(out) if isinstance(out, tuple | list) else (out,)
        seen = _forward_seen(args, outputs, high, end)
        if isinstance(seen, str):
            self.failed = self.failed or seen
        else:
            self.forward_seen = seen
        watched = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        if watched:
            _watch_backward(self, watched)
        return out

    def computing(self, chunk: int) -> None:
        self.chunk = chunk

    def saw_backward(self, seen: _Backward) -> None:
        self.num_backwards += 1
        if self.num_backwards > 1:  # the stage's first backward also creates the gradients
            self.backward_seen = seen


def _forward_seen(args: Sequence[torch.Tensor], outputs: Sequence[Any], high: int, end: int) -> _Forward | str:
    """What a real forward did, as an echo repeats it; or why it cannot be repeated."""
    inputs = {_storage_key(a): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    seen: set[int] = set()
    described, fresh = [], 0
    for output in outputs:
        if not isinstance(output, torch.Tensor):
            return f"a stage output of type {type(output).__name__}"
        key = _storage_key(output)
        alias = inputs.get(key)
        if alias is None:
            if key in seen:
                return "stage outputs that share storage"
            if output.storage_offset() or output.untyped_storage().nbytes() != _strided_bytes(output):
                return "a stage output that is a view into a larger tensor"
            seen.add(key)
            fresh += block_bytes(output.untyped_storage().nbytes())
        described.append(_Output(shape=tuple(output.shape), stride=tuple(output.stride()), dtype=output.dtype,
                                 requires_grad=output.requires_grad, alias=alias))
    kept = end - fresh
    if kept < 0:
        return "stage outputs that are views of what the stage held before"
    return _Forward(high=high, kept=kept, outputs=tuple(described))


def _strided_bytes(tensor: torch.Tensor) -> int:
    """The storage bytes torch.empty_strided makes for this tensor's shape, stride and dtype."""
    if tensor.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * step for size, step in zip(tensor.shape, tensor.stride(), strict=True))
    return span * tensor.element_size()


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _watch_backward(echoing: Echoing, outputs: Sequence[torch.Tensor]) -> None:
    """Measure the module's backward: from the first output gradient's arrival to the end of the pass."""
    count = echoing.count
    state: dict[str, int] = {}

    def arrived(grad: torch.Tensor) -> None:
        if state:
            return
        state["start"], state["high_before"] = count.live_bytes, count.peak_bytes
        count.peak_bytes = count.live_bytes
        at_backward_end(ended)

    def ended() -> None:
        start = state["start"]
        echoing.saw_backward(_Backward(high=count.peak_bytes - start, change=count.live_bytes - start))
        count.peak_bytes = max(state["high_before"], count.peak_bytes)

    for output in outputs:
        output.register_hook(arrived)


class _Echo(torch.autograd.Function):
    """A micro-batch's pass through a stage's module, in live bytes only (see the module's text)."""

    @staticmethod
    def forward(ctx: Any, echoing: Echoing, anchor: torch.Tensor | None,
                *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seen = echoing.forward_seen
        assert seen is not None
        count = echoing.count
        start = count.live_bytes
        _rise(seen.high)
        ctx.kept = torch.empty(seen.kept, dtype=torch.uint8)
        outputs = tuple(args[o.alias] if o.alias is not None else
                        torch.empty_strided(o.shape, o.stride, dtype=o.dtype) for o in seen.outputs)
        ctx.set_materialize_grads(False)  # no zeros made up for outputs without a gradient
        ctx.mark_non_differentiable(*(t for t, o in zip(outputs, seen.outputs, strict=True) if not o.requires_grad))
        ctx.echoing = echoing
        ctx.inputs = tuple((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) and a.requires_grad
                           else None for a in args)
        fresh = sum(block_bytes(t.untyped_storage().nbytes()) for t, o in zip(outputs, seen.outputs, strict=True)
                    if o.alias is None)
        if count.live_bytes - start != seen.kept + fresh:
            echoing.failed = echoing.failed or "a forward's echo ended elsewhere than the forward"
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        echoing: Echoing = ctx.echoing
        seen, count = echoing.backward_seen, echoing.count
        start = count.live_bytes
        if seen is None:
            echoing.failed = echoing.failed or "a backward echoed before one was seen"
        else:
            _rise(seen.high)
        ctx.kept = None
        given = tuple(torch.empty_strided(*meta[:2], dtype=meta[2]) if meta is not None else None
                      for meta in ctx.inputs)
        if seen is not None:
            def ended() -> None:
                if count.live_bytes - start != seen.change:
                    echoing.failed = echoing.failed or "a backward's echo ended elsewhere than the backward"

            at_backward_end(ended)
        return (None, None, *given)


def _rise(high: int) -> None:
    """The live bytes up by `high` for one moment (a module's working memory, allocated and let go)."""
    torch.empty(high, dtype=torch.uint8)


def echo_stages(stages: Sequence[Any], count: TensorBytes,
                real: dict[int, frozenset[int]]) -> list[Echoing]:
    """Each stage's module echoing the micro-batches outside real[stage index]; the echoing modules."""
    echoing = []
    for stage in stages:
        module = Echoing(stage.submod, count, real[stage.stage_index])
        stage.submod = module
        on_forward_chunk(stage, module.computing)
        echoing.append(module)
    return echoing


def real_microbatches(order: Sequence[tuple[int, str, int]]) -> dict[int, frozenset[int]]:
    """Per stage in one rank's action order (stage, kind, micro-batch), the micro-batches computed for real:
    the first NUM_REAL of its forwards and the first NUM_REAL of its backwards."""
    firsts: dict[tuple[int, str], list[int]] = {}
    for stage, kind, microbatch in order:
        if kind in (FORWARD, BACKWARD):
            taken = firsts.setdefault((stage, kind), [])
            if len(taken) < NUM_REAL and microbatch not in taken:
                taken.append(microbatch)
    stages = {stage for stage, _ in firsts}
    return {stage: frozenset(firsts.get((stage, FORWARD), []) + firsts.get((stage, BACKWARD), []))
            for stage in stages}
