"""What trials and pipeline ranks share to train: the optimizer factory and autocast."""

from __future__ import annotations

import contextlib

import torch

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _create_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state before the first step, by one step on zero gradients.

    Optimizers create their state (AdamW's two moments, SGD's momentum) in their first step, so without
    this the first training step peaks lower than every later one, and a batch too large for training
    fails only in the second step, a whole step later. With the state in place every step, the first
    included, peaks as training does, and an out-of-memory comes in the first. Zero gradients leave
    SGD's weights as they were and move AdamW's only by its weight decay (1 - lr x decay)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_optimizer(name: str, params: list[torch.nn.Parameter], *, lr: float) -> torch.optim.Optimizer:
    """The optimizer a probe trial and every pipeline rank train with (the same state, so the same memory)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr)


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision in _AUTOCAST_DTYPES:
        return torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()
