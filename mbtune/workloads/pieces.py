"""The traced pipe as a chain of pieces: which values each piece takes and gives, what each block carries
on (values a later piece reads), sizes made local to each piece, the model's own loss cut from its last
piece, and the meta device the trace wrote into the graphs replaced by the inputs' device (traced.py)."""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from mbtune.errors import WorkloadError

CONTRACT_HINT = ("Write the model as blocks instead: a factory returning Workload(blocks=[...], make_batch=..., "
                 "loss=...) (see the workload contract, docs/guides/workloads.md).")


@dataclass
class Piece:
    """One block of the traced chain: `module` takes the values named `takes` and gives those named `gives`;
    the block takes the values named `carried_in` and returns those named `carried_out`."""

    module: nn.Module
    takes: tuple[str, ...]
    gives: tuple[str, ...]
    carried_in: tuple[str, ...] = ()
    carried_out: tuple[str, ...] = ()
    label: str = ""  # the trunk member it runs, or what runs before or after the trunk


class TracedBlock(nn.Module):
    """A piece of the traced model as a block of the chain (see the module docstring)."""

    def __init__(self, piece: Piece) -> None:
        super().__init__()
        self.piece = piece.module
        self.takes, self.gives = piece.takes, piece.gives
        self.carried_in, self.carried_out = piece.carried_in, piece.carried_out
        self.label = piece.label

    def forward(self, *values: Any) -> Any:
        env = dict(zip(self.carried_in, values))
        out = self.piece(*(env[name] for name in self.takes))
        env.update(zip(self.gives, out if len(self.gives) > 1 else (out,)))
        result = tuple(env[name] for name in self.carried_out)
        return result[0] if len(result) == 1 else result


class TracedLoss:
    """The model's own loss: the part of its last graph that reads the targets, applied to the last block's
    outputs and the targets."""

    def __init__(self, module: nn.Module | None, takes: tuple[str, ...], gives: tuple[str, ...],
                 model_outputs: tuple[str, ...], targets: str, loss_name: str) -> None:
        self.module, self.takes, self.gives = module, takes, gives
        self.model_outputs, self.targets, self.loss_name = model_outputs, targets, loss_name

    def __call__(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        env = dict(zip(self.model_outputs, outputs if len(self.model_outputs) > 1 else (outputs,)))
        env[self.targets] = targets
        assert self.module is not None  # noqa: S101 - set whenever the model takes targets
        out = self.module(*(env[name] for name in self.takes))
        env.update(zip(self.gives, out if len(self.gives) > 1 else (out,)))
        return env[self.loss_name]


def pieces_of(graph: fx.Graph, modules: dict[str, nn.Module], num_inputs: int,
            takes_targets: bool) -> tuple[list[Piece], tuple[str, ...], str | None]:
    """The pieces of the pipe's top graph, the names of its outputs and the name of its targets input."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    target_name = placeholders[num_inputs].name if takes_targets else None
    pieces: list[Piece] = []
    outputs: tuple[str, ...] = ()
    for node in graph.nodes:
        if node.op == "call_module":
            if node.kwargs or not all(isinstance(a, fx.Node) for a in node.args):
                raise WorkloadError("the traced model passes constants between its parts", hint=CONTRACT_HINT)
            items = sorted((u.args[1], u.name) for u in node.users
                           if u.op == "call_function" and u.target is operator.getitem)
            if items:
                count = items[-1][0] + 1
                named = dict(items)
                gives = tuple(named.get(i, f"{node.name}_unused_{i}") for i in range(count))
            else:
                gives = (node.name,)
            pieces.append(Piece(modules[str(node.target)], tuple(a.name for a in node.args), gives))
        elif node.op == "output":
            value = node.args[0]
            values = value if isinstance(value, tuple | list) else (value,)
            outputs = tuple(v.name for v in values if isinstance(v, fx.Node))
    pieces[0].carried_in = tuple(p.name for p in placeholders[:num_inputs])
    return pieces, outputs, target_name


def localise_sizes(piece: Piece, target_name: str | None, last: bool) -> None:
    """Sizes (the symbolic batch) that the pipe hands from piece to piece as integers, and sizes read from
    the targets before the last piece, taken from the piece's own tensor inputs instead: only tensors can
    cross a stage boundary, and the targets reach only the loss."""
    gm = piece.module
    if not isinstance(gm, fx.GraphModule):
        return
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = dict(zip(placeholders, piece.takes))
    sources = [(n, n.meta["val"]) for n in placeholders
               if isinstance(n.meta.get("val"), torch.Tensor) and names[n] != target_name]

    def local_size(value: Any, where: str) -> fx.Node:
        expr = value.node.expr
        for node, tensor in sources:
            for dim, size in enumerate(tensor.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == expr:
                    with graph.inserting_after(placeholders[-1]):
                        found = graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
                    found.meta["val"] = value
                    return found
        raise WorkloadError(f"the traced model hands a size ({where}) to a part that has no input of that size",
                            hint=CONTRACT_HINT)

    for node in placeholders:
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt):
            node.replace_all_uses_with(local_size(value, names[node]))
            graph.erase_node(node)
        elif names[node] == target_name and not last:
            for user in list(node.users):
                if user.target is not torch.ops.aten.sym_size.int:
                    raise WorkloadError("the model reads its targets before its last trunk member",
                                        hint="Compute the loss from the outputs (pass loss=...), or " + CONTRACT_HINT)
                user.replace_all_uses_with(local_size(user.meta["val"], "the batch size"))
                graph.erase_node(user)
            graph.erase_node(node)
    piece.takes = tuple(names[n] for n in placeholders if n.graph is graph and n in graph.nodes)
    graph.lint()
    gm.recompile()


def carry(pieces: list[Piece], outputs: Sequence[str]) -> None:
    """Set what each block takes and returns: the values defined so far that a later piece or the end
    still reads."""
    needed_after: list[set[str]] = [set() for _ in pieces]
    later: set[str] = set(outputs)
    for index in range(len(pieces) - 1, -1, -1):
        needed_after[index] = set(later)
        later |= set(pieces[index].takes)
    defined = list(pieces[0].carried_in)
    for index, piece in enumerate(pieces):
        if index > 0:
            piece.carried_in = pieces[index - 1].carried_out
        defined += [g for g in piece.gives if g not in defined]
        keep = needed_after[index]
        piece.carried_out = tuple(v for v in defined if v in keep)
    pieces[-1].carried_out = tuple(outputs)


def split_loss(piece: Piece, target_name: str, name: str) -> tuple[Piece, TracedLoss]:
    """The last piece cut where the targets come in: the model part (a piece) and the loss part."""
    from torch.fx.passes.split_module import split_module

    gm = piece.module
    if not isinstance(gm, fx.GraphModule):
        raise WorkloadError(f"workload {name!r}: the model's last part is not traced", hint=CONTRACT_HINT)
    target_index = piece.takes.index(target_name)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tainted = {placeholders[target_index]}
    for node in gm.graph.nodes:
        if node.op != "placeholder" and any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
    split = split_module(gm, gm, lambda node: 1 if node in tainted else 0, keep_original_order=True)
    parts = {str(n.target): n for n in split.graph.nodes if n.op == "call_module"}
    if set(parts) != {"submod_0", "submod_1"}:
        raise WorkloadError(f"workload {name!r}: the model's loss cannot be told apart from the model",
                            hint="Pass loss=... and have the model return its outputs.")
    loss_module = split.get_submodule("submod_1")
    if any(True for _ in loss_module.parameters()):
        raise WorkloadError(f"workload {name!r}: the model's loss uses parameters", hint="Pass loss=... instead.")
    model_pieces, final, _ = pieces_of(split.graph, dict(split.named_children()), len(placeholders), False)
    model_part, loss_part = model_pieces
    # Names in the split graph: its placeholders are the piece's own; map them back to the pipe's names.
    rename = {n.name: f"loss_split.{n.name}" for n in split.graph.nodes if n.op != "placeholder"}
    rename.update(zip((n.name for n in split.graph.nodes if n.op == "placeholder"), piece.takes))
    final = tuple(rename.get(o, o) for o in final)
    model_part.gives = tuple(rename.get(g, g) for g in model_part.gives)
    loss_part.gives = tuple(rename.get(g, g) for g in loss_part.gives)
    model_part.takes = tuple(rename.get(t, t) for t in model_part.takes)
    loss_takes = tuple(rename.get(t, t) for t in loss_part.takes)
    from_loss = [o for o in final if o in loss_part.gives]
    scalar = _loss_output(loss_module, from_loss, loss_part.gives)
    if scalar is None:
        raise WorkloadError(f"workload {name!r}: found no loss among the model's outputs that read the targets",
                            hint="Pass loss=... and have the model return its outputs.")
    model_outputs = tuple(t for t in loss_takes if t != target_name)
    new_piece = Piece(model_part.module, model_part.takes, model_part.gives)
    return new_piece, TracedLoss(loss_module, loss_takes, loss_part.gives, model_outputs, target_name, scalar)


def _loss_output(module: nn.Module, candidates: list[str], gives: tuple[str, ...]) -> str | None:
    """The output of the loss part that is the loss: the one scalar (recorded shape ()) among them."""
    if not isinstance(module, fx.GraphModule):
        return None
    out = next(n for n in module.graph.nodes if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], tuple | list) else (out.args[0],)
    shapes = {g: getattr(v.meta.get("val"), "shape", None) if isinstance(v, fx.Node) else None
              for g, v in zip(gives, values)}
    scalars = [c for c in candidates if (shape := shapes.get(c)) is not None and len(shape) == 0]
    return scalars[0] if scalars else (candidates[0] if len(candidates) == 1 else None)


def _device_of(*values: Any) -> torch.device:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def device_from_inputs(gm: nn.Module) -> None:
    """The trace ran on the meta device, which the graph wrote into its constants (an arange's device, a
    copy's target): take the device from the graph's inputs (or its own weights) instead, and drop the
    tracer's metadata asserts."""
    graph: fx.Graph = gm.graph  # type: ignore[assignment]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    device_node: fx.Node | None = None

    def here() -> fx.Node:
        nonlocal device_node
        if device_node is None:
            first = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(first):
                weights = next(iter(n for n, _ in [*gm.named_parameters(), *gm.named_buffers()]), None)
                sources: list[Any] = list(placeholders)
                if weights is not None:
                    sources.append(graph.get_attr(weights))
                device_node = graph.call_function(_device_of, tuple(sources))
        return device_node

    def meta(value: Any) -> bool:
        return (isinstance(value, torch.device) and value.type == "meta") or value == "meta"

    for node in list(graph.nodes):
        if node.op == "call_function" and "assert_tensor_metadata" in str(node.target):
            graph.erase_node(node)
            continue
        if any(meta(a) for a in node.args) or any(meta(v) for v in node.kwargs.values()):
            node.args = tuple(here() if meta(a) else a for a in node.args)
            node.kwargs = {k: here() if meta(v) else v for k, v in node.kwargs.items()}
    graph.lint()
    if isinstance(gm, fx.GraphModule):
        gm.recompile()


def label_pieces(pieces: list[Piece], trunk: Sequence[str]) -> None:
    """Name each piece by the trunk member it runs, or as what runs before or after the trunk."""
    for index, piece in enumerate(pieces):
        if piece.label:  # a copied member's (identical_members.py): it holds the traced member's modules, under its names
            continue
        held = [name for name in trunk if holds(piece.module, name)]
        piece.label = (held[0] if len(held) == 1 else f"before {trunk[0]}" if index == 0 else f"after {trunk[-1]}")


def holds(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def copy_meta(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A copy of a traced (meta) piece that shares its graphs and generated code and holds its own modules,
    parameters and containers (`memo`: each original module's id -> its copy). A deep copy would regenerate
    and compile every graph's code (a second or more per block of a large model); the graphs are never
    changed after tracing. Where tensors are fake (a memory prediction), the meta tensors are copied as
    they are, not as fakes."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    memo = {} if memo is None else memo
    with unset_fake_temporarily():
        return copy_module(module, memo)


def copy_module(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    new = object.__new__(type(module))  # a GraphModule's class is its own, generated forward included
    memo[id(module)] = new
    for key, value in module.__dict__.items():
        new.__dict__[key] = copy.copy(value) if isinstance(value, dict | list | set) else value
    for name, value in new._parameters.items():
        if value is not None:
            if id(value) not in memo:
                memo[id(value)] = nn.Parameter(value.detach(), requires_grad=value.requires_grad)
            new._parameters[name] = memo[id(value)]
    for name, child in new._modules.items():
        if child is not None:
            new._modules[name] = copy_module(child, memo)
    return new
