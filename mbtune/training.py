"""What trials and pipeline ranks share to train: the optimizer factory and autocast."""

from __future__ import annotations

import contextlib

import torch

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def create_optimizer_state(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state before the first step, leaving training exactly as it would have been.

    Optimizers create their state (AdamW's two moments, SGD's momentum) in their first step, so without
    this the first training step peaks lower than every later one, and a batch too large for training
    fails only in the second step, a whole step later. With the state in place every step, the first
    included, peaks as training does, and an out-of-memory comes in the first.

    The state comes from one step on zero gradients with weight decay off, so no weight moves; step counts
    are then set back to zero. What follows is bit for bit a fresh optimizer's training: AdamW's moments
    start at zero either way, and SGD's momentum buffer (zeros, without dampening) takes the first
    gradient as a fresh one would."""
    params = [p for p in params if p.requires_grad]
    decays = [group.get("weight_decay", 0) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["weight_decay"] = 0
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, decay in zip(optimizer.param_groups, decays):
        group["weight_decay"] = decay
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


def on_device(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The module on the device; as it is where it is there already. In a memory prediction
    (probing/ceiling_prediction.py, pipeline/rank_memory.py) its tensors (fake, or meta ones becoming fake) are moved tensor
    by tensor, ties kept: `.to` would try to swap fake tensors, which they refuse, and would give each holder
    of a tied meta tensor a parameter of its own."""
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.device == device for t in tensors):
        return module
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    if detect_fake_mode() is None and not any(isinstance(t, FakeTensor) for t in tensors):
        return module.to(device)
    moved: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                if id(param) not in moved:
                    moved[id(param)] = torch.nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
                sub._parameters[name] = moved[id(param)]  # type: ignore[assignment]
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = moved.setdefault(id(buffer), buffer.to(device))
    return module


def make_optimizer(name: str, params: list[torch.nn.Parameter], *, lr: float) -> torch.optim.Optimizer:
    """The optimizer a probe trial and every pipeline rank train with (the same state, so the same memory)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr)


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision in _AUTOCAST_DTYPES:
        return torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()
