"""Where a plain model splits: its trunk, found from its structure, and the traced split at the trunk's
boundaries (torch.distributed.pipelining's tracing frontend, with the batch dimension kept symbolic; the
one importer of torch.distributed.pipelining besides pipeline/schedules.py, which owns the schedules and
stages).

The trunk is the longest run of consecutive children of one class in a ModuleList or Sequential (the
layers of a transformer, the blocks of a Sequential), or of containers under any parent (a ResNet's
layer1..layer4, each a Sequential of residual blocks): containers count as their children, so each
residual block is a block. Where two runs are as long, the one holding the most parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

MIN_TRUNK = 2


def find_trunk(model: nn.Module) -> list[str]:
    """The qualified names of the trunk's members, in order ([] when the model has no run of two)."""
    best: tuple[int, int, list[str]] = (0, 0, [])
    for parent_name, parent in model.named_modules():
        children = list(parent.named_children())
        container = isinstance(parent, nn.ModuleList | nn.Sequential)
        start = 0
        while start < len(children):
            end = start + 1
            while end < len(children) and type(children[end][1]) is type(children[start][1]):
                end += 1
            run = children[start:end]
            # A run counts inside a ModuleList or Sequential, or where its members are such containers
            # (a ResNet's stages): not the projections of an attention module, say.
            if len(run) >= MIN_TRUNK and (container or isinstance(run[0][1], nn.ModuleList | nn.Sequential)):
                names = _expanded(model, [f"{parent_name}.{n}" if parent_name else n for n, _ in run])
                size = sum(p.numel() for _, m in run for p in m.parameters())
                best = max(best, (len(names), size, names), key=lambda b: (b[0], b[1]))
            start = end
    return best[2]


def _expanded(model: nn.Module, names: list[str]) -> list[str]:
    """Container members (Sequential, ModuleList) replaced by their children."""
    out: list[str] = []
    for name in names:
        member = model.get_submodule(name)
        if isinstance(member, nn.Sequential | nn.ModuleList) and len(member) > 0:
            out += [f"{name}.{child}" for child, _ in member.named_children()]
        else:
            out.append(name)
    return out


def split_at(model: nn.Module, args: tuple[Any, ...], trunk: list[str]) -> tuple[fx.Graph, dict[str, nn.Module]]:
    """Trace the model with a split point before each trunk member and after the last; return the pipe's
    top graph (one call per piece) and its pieces by name. The members' forwards are restored after."""
    from torch.distributed.pipelining import pipe_split

    wrapped = []
    for index, name in enumerate(trunk):
        member = model.get_submodule(name)
        wrapped.append(member)
        member.forward = _marked(member.forward, last=index == len(trunk) - 1, split=pipe_split)
    try:
        pipe = _traced_pipe(model, args)
    finally:
        for member in wrapped:
            del member.forward
    split = pipe.split_gm
    return split.graph, dict(split.named_children())


def _marked(forward: Any, *, last: bool, split: Any) -> Any:
    def marked(*args: Any, **kwargs: Any) -> Any:
        split()
        out = forward(*args, **kwargs)
        if last:
            split()
        return out

    return marked



def _traced_pipe(model: nn.Module, args: tuple[Any, ...]) -> Any:
    """pipeline(), with the batch dimension of every input left symbolic: the public call traces every
    size as a constant, which would tie the blocks to the batch size they were traced at."""
    from torch.distributed.pipelining._IR import MultiUseParameterConfig, Pipe
    from torch.export import Dim

    dynamic = tuple({0: Dim.DYNAMIC} if isinstance(a, torch.Tensor) else None for a in args)
    program = torch.export.export(model, args, dynamic_shapes=dynamic)
    return Pipe._from_traced(model, program, MultiUseParameterConfig.REPLICATE)
