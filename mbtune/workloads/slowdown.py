"""The slowdown knob: `-O slowdown=0.15` on any workload cuts every block's throughput by 15% (each block
takes 1 / 0.85 as long, 17.6% longer), in proportion to its own time, so a qualification can be shown a
known regression (bench/qualify.py). The step's throughput falls by a little less: what is not a block
(the optimizer's update, hand-overs between stages) runs as fast as before.

Each block's forward is timed (the device synchronized first on CUDA) and followed by real arithmetic for
S / (1 - S) of it; its backward likewise, timed from the gradient arriving at its output to the gradient
leaving at its input (a block whose input carries no gradient, an embedding say, is given twice its
forward's extra time instead: a backward costs about two forwards). Hooks, not a wrapper module: the
block's parameter names, and so its ties, stay as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mbtune.errors import WorkloadError

OPTION = "slowdown"
MAX_SLOWDOWN = 0.9  # a tenth of the block's throughput left: beyond it the knob measures the knob


def split_slowdown(options: Sequence[tuple[str, Any]]) -> tuple[float | None, list[tuple[str, Any]]]:
    """(the slowdown share asked for, or None; the workload's own options), refusing a share out of range."""
    rest = [(k, v) for k, v in options if k != OPTION]
    raw = dict(options).get(OPTION)
    if raw is None:
        return None, rest
    try:
        share = float(raw)
    except (TypeError, ValueError):
        share = -1.0
    if not 0 <= share <= MAX_SLOWDOWN:
        raise WorkloadError(f"-O {OPTION}={raw} is out of range",
                            hint=f"Give the share of each block's throughput to take away, from 0 to {MAX_SLOWDOWN:g} "
                                 "(0.15: 15% fewer samples a second).")
    return share, rest


def spin(seconds: float, like: torch.Tensor) -> None:
    """Real arithmetic for `seconds` on the tensor's device (small products, so memory does not move)."""
    if seconds <= 0:
        return
    end = time.perf_counter() + seconds
    with torch.no_grad():
        a = torch.full((32, 32), 0.5, device=like.device)
        while time.perf_counter() < end:
            a = torch.tanh(a @ a)
            if a.is_cuda:
                torch.cuda.synchronize(a.device)


def _now(like: torch.Tensor) -> float:
    if like.is_cuda:
        torch.cuda.synchronize(like.device)
    return time.perf_counter()


class _Clock:
    def __init__(self) -> None:
        self.forward_s = 0.0
        self.started = 0.0
        self.backward_from = 0.0
        self.input_has_grad = False


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: _Clock, share: float) -> torch.Tensor:  # noqa: D102
        ctx.clock, ctx.share = clock, share
        clock.started, clock.input_has_grad = _now(x), x.requires_grad
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: D102
        spin(ctx.share * (_now(grad) - ctx.clock.backward_from), grad)
        return grad, None, None


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, clock: _Clock, share: float) -> torch.Tensor:  # noqa: D102
        clock.forward_s = _now(y) - clock.started
        spin(share * clock.forward_s, y)
        ctx.clock, ctx.share = clock, share
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: D102
        if not ctx.clock.input_has_grad:
            spin(2 * ctx.share * ctx.clock.forward_s, grad)
        ctx.clock.backward_from = _now(grad)
        return grad, None, None


def _first_float(values: Any) -> int | None:
    items = values if isinstance(values, tuple | list) else (values,)
    return next((i for i, v in enumerate(items) if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def _through(values: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`values` with fn applied to its first floating-point tensor (a tensor, or one in a tuple or list)."""
    index = _first_float(values)
    if index is None:
        return values
    if isinstance(values, torch.Tensor):
        return fn(values)
    items = list(values)
    items[index] = fn(items[index])
    return type(values)(items) if isinstance(values, tuple) else items


def slowed(build: Callable[[], nn.Module], share: float) -> Callable[[], nn.Module]:
    """A block builder whose blocks' throughput falls by `share`, forward and backward (module docstring)."""
    share = share / (1 - share)  # the extra time, as a share of the block's own

    def build_slowed() -> nn.Module:
        block = build()
        clocks: list[_Clock] = []

        def enter(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            clocks.append(_Clock())
            clock = clocks[-1]
            if _first_float(args) is None:  # integer inputs (token ids): the clock starts all the same
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                clock.started = _now(first) if first is not None else time.perf_counter()
                return args
            return _through(args, lambda x: _Enter.apply(x, clock, share))

        def leave(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
            clock = clocks.pop()
            return _through(output, lambda y: _Leave.apply(y, clock, share))

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
        return block

    return build_slowed
