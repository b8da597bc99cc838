"""A plain nn.Module as a workload, split by mbtune (`Workload.from_module`).

The trunk is found from the model's structure (trunk.py): the longest run of same-class modules. The
model is built on the meta device and traced once per process with torch.distributed.pipelining's tracing
frontend (`pipeline()`), with a split point before each trunk member and after the last: what runs before
the trunk becomes the first block, each trunk member a block, what runs after it the last block. The trunk
members stay the user's own modules (eager code); only the code around them is a traced graph.

The traced pipe may hand a value to a stage further down (a rotary table, a mask, the batch itself); the
blocks carry such values along, so each block takes the previous block's tuple and returns the next's, as
the workload contract says. Where the model computes its own loss from targets (`GPT(idx, targets)`, a
transformers model's `labels=`), the last block stops where the targets come in, and the rest of the graph
is the workload's loss: the targets are never handed from stage to stage.

Weights: block i is a copy of the traced piece whose parameters and buffers are taken, by name, from the
model built on the CPU under the run's seed, once per process, so every stage builds exactly the weights
the whole model has (the user's own initialisation, buffers included). Parameters one tensor in several
places (an embedding tied to the head) are found from the model and become the workload's ties.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from mbtune.errors import WorkloadError
from mbtune.workloads import Workload
from mbtune.workloads.trunk import find_trunk, split_at

CONTRACT_HINT = ("Write the model as blocks instead: a factory returning Workload(blocks=[...], make_batch=..., "
                 "loss=...) (see the workload contract, docs/guides/workloads.md).")
TRACE_BATCH = 2  # the batch size the model is traced at (1 would let the tracer treat the batch as a constant 1)


@dataclass
class Piece:
    """One block of the traced chain: `module` takes the values named `takes` and gives those named `gives`;
    the block takes the values named `carried_in` and returns those named `carried_out`."""

    module: nn.Module
    takes: tuple[str, ...]
    gives: tuple[str, ...]
    carried_in: tuple[str, ...] = ()
    carried_out: tuple[str, ...] = ()


class TracedBlock(nn.Module):
    """A piece of the traced model as a block of the chain (see the module docstring)."""

    def __init__(self, piece: Piece) -> None:
        super().__init__()
        self.piece = piece.module
        self.takes, self.gives = piece.takes, piece.gives
        self.carried_in, self.carried_out = piece.carried_in, piece.carried_out

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


@dataclass
class Traced:
    """The model traced and split: its pieces in order, the names of its parameters and buffers by piece,
    and the loss part when the model computes its own loss."""

    pieces: list[Piece]
    loss: TracedLoss | None
    aliases: dict[int, str]  # id of each meta tensor of the pieces -> the model's (first) name for it
    trunk: tuple[str, ...]


def trace(build: Callable[[], nn.Module], example: tuple[Any, ...], targets: torch.Tensor | None,
          *, name: str) -> Traced:
    """Build the model on the meta device, trace it with split points around its trunk and turn the pipe
    into a chain of pieces. `example` are the inputs at TRACE_BATCH; `targets` are passed after them when
    the model computes its own loss."""
    with torch.device("meta"):
        model = built_module(build, name)
    model.train()
    trunk = find_trunk(model)
    if len(trunk) < 2:
        raise WorkloadError(f"workload {name!r}: found no trunk to split at (no run of two or more modules of one "
                            "class in the model)", hint=CONTRACT_HINT)
    meta = tuple(t.to("meta") for t in example)
    args = (*meta, targets.to("meta")) if targets is not None else meta
    try:
        graph, modules = split_at(model, args, trunk)
    except Exception as exc:  # noqa: BLE001 - the tracer refuses the model: say why, in one line
        cause = exc.__cause__ or exc
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise WorkloadError(f"workload {name!r}: cannot trace the model to split it: {type(cause).__name__}: {first}",
                            hint=CONTRACT_HINT) from exc
    pieces, outputs, target_name = _pieces(graph, modules, len(example), targets is not None)
    for index, piece in enumerate(pieces):
        _localise_sizes(piece, target_name, index == len(pieces) - 1)
    loss = None
    if target_name is not None:
        pieces[-1], loss = _split_loss(pieces[-1], target_name, outputs, name)
        outputs = loss.model_outputs
    _carry(pieces, outputs)
    for piece in pieces:
        for sub in piece.module.modules():
            if isinstance(getattr(sub, "graph", None), fx.Graph):  # GraphModules and export's InterpreterModules
                _device_from_inputs(sub)
    aliases = _aliases(model, pieces)
    for piece in pieces:
        _one_tensor_per_name(piece.module, aliases)
    return Traced(pieces=pieces, loss=loss, aliases=aliases, trunk=tuple(trunk))


def built_module(build: Callable[[], nn.Module], name: str) -> nn.Module:
    try:
        model = build()
    except WorkloadError:
        raise
    except Exception as exc:
        raise WorkloadError(f"workload {name!r}: building the model failed: {type(exc).__name__}: {exc}",
                            hint="Fix the build function (it takes no arguments and returns an nn.Module).") from exc
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"workload {name!r}: build() returned {type(model).__name__}, not an nn.Module",
                            hint="Return the model (an nn.Module) from the build function.")
    return model


def _pieces(graph: fx.Graph, modules: dict[str, nn.Module], num_inputs: int,
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


def _localise_sizes(piece: Piece, target_name: str | None, last: bool) -> None:
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


def _carry(pieces: list[Piece], outputs: Sequence[str]) -> None:
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


def _split_loss(piece: Piece, target_name: str, outputs: tuple[str, ...], name: str) -> tuple[Piece, TracedLoss]:
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
    model_pieces, final, _ = _pieces(split.graph, dict(split.named_children()), len(placeholders), False)
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
    del outputs
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


def _device_from_inputs(gm: nn.Module) -> None:
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


def _aliases(model: nn.Module, pieces: list[Piece]) -> dict[int, str]:
    """id of each tensor of the pieces -> the model's name for it (its first name): the pipe and the loss
    cut keep the model's tensors, under names of their own."""
    first: dict[int, str] = {}
    by_name: dict[str, str] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_name[name] = first.setdefault(id(tensor), name)
    found: dict[int, str] = {}
    for piece in pieces:
        for name, tensor in [*piece.module.named_parameters(remove_duplicate=False),
                             *piece.module.named_buffers(remove_duplicate=False)]:
            known = first.get(id(tensor)) or by_name.get(name)  # the pipe copies a tensor used in two pieces
            if known is None:
                raise WorkloadError(f"the traced model holds a tensor {name!r} the model does not", hint=CONTRACT_HINT)
            found[id(tensor)] = known
    return found


def _one_tensor_per_name(piece: nn.Module, aliases: dict[int, str]) -> None:
    """Within a piece, every copy of one of the model's tensors made the same tensor (the pipe copies a
    tensor it finds used twice, such as a tied embedding), so it is counted and updated once."""
    chosen: dict[str, Any] = {}
    for module in piece.modules():
        for store in (module._parameters, module._buffers):
            for leaf, value in list(store.items()):
                if value is not None:
                    store[leaf] = chosen.setdefault(aliases[id(value)], value)


def materialise(piece: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[int, str]) -> nn.Module:
    """A copy of the (meta) piece holding the real tensors of the model, by name: one Parameter per tensor."""
    names = {}
    for module in piece.modules():
        for leaf, value in [*module._parameters.items(), *module._buffers.items()]:
            if value is not None:
                names[(id(module), leaf)] = aliases[id(value)]
    memo: dict[int, Any] = {}
    block = copy.deepcopy(piece, memo)
    made: dict[str, nn.Parameter] = {}
    for original in piece.modules():
        module = memo[id(original)]
        for leaf, value in list(module._parameters.items()):
            if value is not None:
                key = names[(id(original), leaf)]
                if key not in made:
                    made[key] = nn.Parameter(tensors[key], requires_grad=value.requires_grad)
                module._parameters[leaf] = made[key]
        for leaf, value in list(module._buffers.items()):
            if value is not None:
                module._buffers[leaf] = tensors[names[(id(original), leaf)]]
    return block


def _join(prefix: str, leaf: str) -> str:
    return f"{prefix}.{leaf}" if prefix else leaf


def tensor_names(piece: nn.Module, aliases: dict[int, str]) -> dict[str, str]:
    """Parameter name in the piece -> the model's name for its tensor."""
    return {name: aliases[id(p)] for name, p in piece.named_parameters(remove_duplicate=False)}


class _Weights:
    """The model built on the CPU under a seed, kept while blocks are being built from it."""

    def __init__(self, build: Callable[[], nn.Module], name: str) -> None:
        self.build, self.name = build, name
        self.seed: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    def at(self, seed: int) -> dict[str, torch.Tensor]:
        if self.seed != seed:
            self.tensors = {}  # the previous seed's model goes first
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                with torch.device("cpu"):
                    model = built_module(self.build, self.name)
            model.train()
            self.tensors = {n: t.detach() for n, t in [*model.named_parameters(remove_duplicate=False),
                                                       *model.named_buffers(remove_duplicate=False)]}
            self.seed = seed
        return self.tensors

    def release(self) -> None:
        self.seed, self.tensors = None, {}


def from_module(build: Callable[[], nn.Module], *, make_batch: Callable[..., Any],
                loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None, name: str | None = None,
                description: str = "", tokens_per_sample: int | None = None) -> Workload:
    """See Workload.from_module."""
    if not callable(build):
        raise WorkloadError(f"from_module takes a function that builds the model, got {type(build).__name__}",
                            hint="Pass the class or a zero-argument function: from_module(lambda: MyModel(...), ...).")
    label = name or getattr(build, "__qualname__", None) or "model"
    if not callable(make_batch):
        raise WorkloadError(f"workload {label!r}: make_batch must be callable", hint="Pass make_batch=fn(batch_size, generator).")
    inputs, targets = make_batch(TRACE_BATCH, torch.Generator().manual_seed(0))
    example = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
    traced = trace(build, example, targets if loss is None else None, name=label)
    weights = _Weights(build, label)
    blocks = [_meta_or_seed0(piece, traced, weights) for piece in traced.pieces]
    return TracedWorkload(
        name=label, blocks=blocks, make_batch=make_batch, loss=loss if loss is not None else traced.loss,  # type: ignore[arg-type]
        tokens_per_sample=tokens_per_sample, ties=_ties(traced),
        description=description or f"{label}: {len(traced.trunk)} trunk blocks, split by tracing",
        traced=traced, weights=weights)


def _meta_or_seed0(piece: Piece, traced: Traced, weights: _Weights) -> Callable[[], nn.Module]:
    return lambda: _meta(piece) if _building_on_meta() else _real(piece, traced, weights.at(0))


def _building_on_meta() -> bool:
    """Whether blocks are being built under torch.device("meta") (counting parameters or FLOPs)."""
    return torch.empty(0).device.type == "meta"


def _meta(piece: Piece) -> nn.Module:
    return TracedBlock(Piece(copy.deepcopy(piece.module), piece.takes, piece.gives, piece.carried_in,
                             piece.carried_out))


def _real(piece: Piece, traced: Traced, tensors: dict[str, torch.Tensor]) -> nn.Module:
    module = materialise(piece.module, tensors, traced.aliases)
    return TracedBlock(Piece(module, piece.takes, piece.gives, piece.carried_in, piece.carried_out))


def _ties(traced: Traced) -> tuple[tuple[tuple[int, str], ...], ...]:
    holders: dict[str, list[tuple[int, str]]] = {}
    for index, piece in enumerate(traced.pieces):
        seen: set[str] = set()
        for local, tensor in tensor_names(piece.module, traced.aliases).items():
            if tensor not in seen:
                seen.add(tensor)
                holders.setdefault(tensor, []).append((index, f"piece.{local}"))
    return tuple(tuple(members) for members in holders.values() if len(members) > 1)


@dataclass(frozen=True, kw_only=True)
class TracedWorkload(Workload):
    """A workload from `from_module`: its blocks are the traced pieces, their weights the model's own."""

    traced: Traced
    weights: _Weights

    def _block(self, index: int, seed: int) -> nn.Module:
        piece = self.traced.pieces[index]
        return _meta(piece) if _building_on_meta() else _real(piece, self.traced, self.weights.at(seed))

    def build(self, indices: Sequence[int] | None = None, *, seed: int = 0, recompute: str = "none") -> nn.Sequential:
        try:
            return super().build(indices, seed=seed, recompute=recompute)
        finally:
            self.weights.release()  # what this process's blocks did not take is freed
