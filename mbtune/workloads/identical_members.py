"""A trunk of identical members traced once: the model is traced with its first three members only, and
the third member's piece is copied for every later one (traced.py).

Tracing costs time in proportion to the model's operators (an 8B Llama's 32 layers: about 6 s of torch.export
and splitting; its first three: under 1 s), and a transformer's layers run the same code on tensors of the
same shapes. The shortcut is taken only where it cannot change what the blocks compute:

- every trunk member is a child of one container that holds nothing else (a transformers model's `layers`),
  so the model, traced with that container shortened, runs its trunk exactly as it runs the whole of it;
- the members are alike: the same classes at the same places, parameters and buffers of the same shapes and
  dtypes, and the same settings (every attribute but the layer's own index: plain values equal, objects such
  as the config the same one; so a sliding-window layer amid global ones, or an MoE layer amid dense ones,
  is told apart), and no hooks;
- in the trace, the third member takes from the second what the second takes from the first, the same other
  values (the rotary table, the mask), and nothing from the first, and runs the same operations as the
  second (a number the model hands each member, its position say, is a constant that tells them apart);
  nothing after the trunk reads a member but the last.

Otherwise, or where the shortened model does not trace, the whole model is traced. A copy holds the model's
own tensors of its member (the weights built are the whole model's), shares the third member's graphs and
gives values of its own names.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from mbtune.workloads.pieces import Piece, copy_module, holds

TRACED_MEMBERS = 3  # members traced: the third shows what every later member takes from the one before it
MIN_MEMBERS = TRACED_MEMBERS + 1  # fewer: nothing to copy, the whole trunk is traced
_OWN_INDEX = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx", "index"})
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_load_state_dict_pre_hooks")


def container_of(model: nn.Module, trunk: Sequence[str]) -> nn.Module | None:
    """The container whose children are exactly the trunk's members, all alike; None where the trunk may not
    be traced shortened (too short, spread over containers, members that differ)."""
    if len(trunk) < MIN_MEMBERS:
        return None
    parents = {name.rpartition(".")[0] for name in trunk}
    if len(parents) != 1:
        return None
    parent = model.get_submodule(next(iter(parents)))
    if not isinstance(parent, nn.ModuleList | nn.Sequential):
        return None
    if [name.rpartition(".")[2] for name in trunk] != list(parent._modules):
        return None
    first = signature(model.get_submodule(trunk[0]))
    if first is None or any(signature(model.get_submodule(name)) != first for name in trunk[1:]):
        return None
    return parent


def signature(module: nn.Module) -> tuple[Any, ...] | None:
    """What makes two trunk members compute alike: per submodule, its place, class, settings (plain values by
    value, objects such as the model's config by identity) and its tensors' shapes and dtypes. None where a
    member has hooks."""
    parts: list[Any] = []
    for place, sub in module.named_modules():
        if any(getattr(sub, hooks, None) for hooks in _HOOKS):
            return None
        settings = []
        for key, value in sorted(sub.__dict__.items()):
            if key.startswith("_") or key == "training" or key in _OWN_INDEX:
                continue
            settings.append((key, _setting(value)))
        tensors = tuple((name, None if t is None else (tuple(t.shape), t.dtype, t.requires_grad))
                        for store in (sub._parameters, sub._buffers) for name, t in store.items())
        parts.append((place, type(sub), tuple(settings), tensors))
    return tuple(parts)


def _setting(value: Any) -> Any:
    """A setting as compared: plain values and functions as they are, a partial function by what it calls
    with, and any other object (the model's config) by identity (alike only where every member holds the
    same one)."""
    if value is None or isinstance(value, bool | int | float | str | torch.dtype | torch.device):
        return value
    if isinstance(value, tuple | list):
        return tuple(_setting(v) for v in value)
    if isinstance(value, functools.partial):
        return ("partial", value.func, _setting(value.args), tuple(sorted((k, _setting(v))
                                                                          for k, v in value.keywords.items())))
    if callable(value) and not isinstance(value, nn.Module) and hasattr(value, "__qualname__"):
        return value  # a function (an activation chosen by name)
    return ("object", id(value))


@contextmanager
def shortened(container: nn.Module, keep: int = TRACED_MEMBERS) -> Iterator[None]:
    """The container holding only its first `keep` children while the block runs."""
    children = container._modules
    container._modules = type(children)(list(children.items())[:keep])
    try:
        yield
    finally:
        container._modules = children


def extend(pieces: list[Piece], outputs: tuple[str, ...], model: nn.Module, trunk: Sequence[str],
           names: dict[int, str]) -> tuple[list[Piece], tuple[str, ...]] | None:
    """The pieces of the model traced with its first TRACED_MEMBERS members, with a copy of the last
    member's piece for every later member (and the values after the trunk read from the last copy); None
    where the trace does not show each member taking what the one before it gives (the whole trunk must be
    traced then). `names`: id of each tensor of the pieces -> the model's name for it."""
    found = [[i for i, p in enumerate(pieces) if holds(p.module, name)] for name in trunk[:TRACED_MEMBERS]]
    if any(len(at) != 1 for at in found):
        return None
    first, second, third = (at[0] for at in found)
    if (second, third) != (first + 1, first + 2) or third == len(pieces) - 1:
        return None
    members = pieces[first:third + 1]
    if len({len(p.gives) for p in members}) != 1 or not _alike(*members) \
            or _operations(members[1], trunk[1]) != _operations(members[2], trunk[2]):
        return None
    before, last = pieces[:third + 1], members[-1]
    after = pieces[third + 1:]
    earlier = {*members[0].gives, *members[1].gives}
    if any(t in earlier for p in after for t in p.takes) or any(o in earlier for o in outputs):
        return None
    copies, previous = [], last
    for index in range(TRACED_MEMBERS, len(trunk)):
        copy = _member_copy(last, trunk[TRACED_MEMBERS - 1], trunk[index], model, names)
        handed = dict(zip(members[1].gives, previous.gives))  # what the last traced member takes from the one before
        copy.takes = tuple(handed.get(t, t) for t in last.takes)
        copy.gives = tuple(f"{g}.{trunk[index]}" for g in last.gives)
        copy.label = trunk[index]
        copies.append(copy)
        previous = copy
    final = dict(zip(last.gives, previous.gives))
    for piece in after:
        piece.takes = tuple(final.get(t, t) for t in piece.takes)
    return [*before, *copies, *after], tuple(final.get(o, o) for o in outputs)


def _alike(first: Piece, second: Piece, third: Piece) -> bool:
    """Whether the third member's piece takes from the second what the second takes from the first, and the
    same other values, and nothing from the first."""
    def shape(piece: Piece, previous: Piece) -> list[Any]:
        return [("handed", previous.gives.index(t)) if t in previous.gives else t for t in piece.takes]

    return shape(third, second) == shape(second, first) and not set(third.takes) & set(first.gives)


def _operations(piece: Piece, member: str) -> list[Any]:
    """The operations of a member's piece, graph by graph, with values as positions and the member's own name
    left out: equal for two members that run the same code (a number the model hands each member, its
    position say, is a constant in the graph and tells them apart)."""
    found = []
    for place, sub in piece.module.named_modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        position = {node: i for i, node in enumerate(graph.nodes)}
        here = member[len(place) + 1:] if place and member.startswith(f"{place}.") else member  # as named here
        rows = [(node.op, _target(node, here), fx.node.map_arg((node.args, node.kwargs), functools.partial(_value, position)))
                for node in graph.nodes]
        found.append((place.replace(member, ""), rows))
    return found


def _value(position: dict[fx.Node, int], node: fx.Node) -> tuple[str, int]:
    return ("value", position[node])


def _target(node: fx.Node, member: str) -> Any:
    if node.op == "placeholder":
        return None  # an input's name is the trace's own
    target = node.target
    if isinstance(target, str) and (target == member or target.startswith(f"{member}.")):
        return target[len(member):]
    return target


def _member_copy(piece: Piece, traced_member: str, member: str, model: nn.Module, names: dict[int, str]) -> Piece:
    """The traced member's piece holding `member`'s own tensors (the model's), sharing its graphs."""
    prefix = f"{traced_member}."

    def counterpart(tensor: torch.Tensor) -> torch.Tensor:
        name = names[id(tensor)]
        if not name.startswith(prefix):
            return tensor  # not the member's own (a table every member reads): shared, as in the model
        own = f"{member}.{name[len(prefix):]}"
        try:
            return model.get_parameter(own)
        except AttributeError:
            return model.get_buffer(own)

    memo: dict[int, Any] = {id(p): counterpart(p) for _, p in piece.module.named_parameters(remove_duplicate=False)}
    originals = list(piece.module.modules())
    module = copy_module(piece.module, memo)
    for original in originals:
        copied = memo[id(original)]
        for leaf, value in original._buffers.items():
            if value is not None:
                copied._buffers[leaf] = counterpart(value)
    return Piece(module, piece.takes, piece.gives)
