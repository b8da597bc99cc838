"""A plain nn.Module as a workload, split by mbtune (`Workload.from_module`).

The trunk is found from the model's structure (trunk.py): the longest run of same-class modules. The
model is built on the meta device and traced once per process with torch.distributed.pipelining's tracing
frontend, with a split point before each trunk member and after the last: what runs before the trunk
becomes the first block, each trunk member a block, what runs after it the last block. The batch dimension
stays symbolic in the trace, so the blocks run at any batch size (pieces.py makes each piece read its sizes
from its own inputs). Tracing costs about a second or two per process for the models in tests/ and
examples/; a trunk of alike members is traced by its first three, the third copied for the rest (identical_members.py).

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn

from mbtune.errors import WorkloadError
from mbtune.workloads import Workload, identical_members
from mbtune.workloads.pieces import (
    CONTRACT_HINT,
    Piece,
    TracedBlock,
    TracedLoss,
    carry,
    copy_meta,
    device_from_inputs,
    label_pieces,
    localise_sizes,
    pieces_of,
    split_loss,
)
from mbtune.workloads.trunk import find_trunk, split_at

TRACE_BATCH = 2  # the batch size the model is traced at (1 would let the tracer treat the batch as a constant 1)


@dataclass
class Traced:
    """The model traced and split: its pieces in order, the names of its parameters and buffers by piece,
    and the loss part when the model computes its own loss."""

    pieces: list[Piece]
    loss: TracedLoss | None
    aliases: dict[int, str]  # id of each meta tensor of the pieces -> the model's (first) name for it
    trunk: tuple[str, ...]
    num_copied: int = 0  # trunk members whose pieces are copies of a traced member's (identical_members.py)


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
    split = _split_alike(model, args, trunk, len(example), targets is not None)
    shortened = split is not None
    if split is None:
        try:
            split = _split(model, args, trunk, len(example), targets is not None)
        except WorkloadError:
            raise
        except Exception as exc:  # noqa: BLE001 - the tracer refuses the model: say why, in one line
            cause = exc.__cause__ or exc
            first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            raise WorkloadError(f"workload {name!r}: cannot trace the model to split it: {type(cause).__name__}: "
                                f"{first}", hint=CONTRACT_HINT) from exc
    pieces, outputs, target_name = split
    loss = None
    if target_name is not None:
        pieces[-1], loss = split_loss(pieces[-1], target_name, name)
        outputs = loss.model_outputs
    carry(pieces, outputs)
    label_pieces(pieces, trunk)
    graphs: dict[int, nn.Module] = {}  # each graph once, with the module that owns it (copies share graphs)
    for piece in pieces:
        for sub in piece.module.modules():
            if isinstance(getattr(sub, "graph", None), fx.Graph):  # GraphModules and export's InterpreterModules
                graphs.setdefault(id(sub.graph), sub)
    for sub in graphs.values():
        device_from_inputs(sub)
    aliases = _aliases(model, pieces)
    for piece in pieces:
        _one_tensor_per_name(piece.module, aliases)
    num_copied = len(trunk) - identical_members.TRACED_MEMBERS if shortened else 0
    return Traced(pieces=pieces, loss=loss, aliases=aliases, trunk=tuple(trunk), num_copied=num_copied)


Split = tuple[list[Piece], tuple[str, ...], str | None]  # the pieces, the model's outputs, its targets' name


def _split(model: nn.Module, args: tuple[Any, ...], trunk: Sequence[str], num_inputs: int, takes_targets: bool) -> Split:
    """The model traced with a split point around each trunk member, as pieces with local sizes."""
    graph, modules = split_at(model, args, list(trunk))
    pieces, outputs, target_name = pieces_of(graph, modules, num_inputs, takes_targets)
    for index, piece in enumerate(pieces):
        localise_sizes(piece, target_name, index == len(pieces) - 1)
    return pieces, outputs, target_name


def _split_alike(model: nn.Module, args: tuple[Any, ...], trunk: list[str], num_inputs: int,
                 takes_targets: bool) -> Split | None:
    """The pieces from the model traced with its first trunk members only, the last copied for the rest
    (identical_members.py); None where the members may differ or the shortened model does not trace alike."""
    container = identical_members.container_of(model, trunk)
    if container is None:
        return None
    try:
        with identical_members.shortened(container):
            pieces, outputs, target_name = _split(model, args, trunk[:identical_members.TRACED_MEMBERS], num_inputs,
                                                  takes_targets)
    except Exception:  # noqa: BLE001 - the whole model is traced instead (its error, if any, is the one said)
        return None
    extended = identical_members.extend(pieces, outputs, model, trunk, _aliases(model, pieces))
    return None if extended is None else (extended[0], extended[1], target_name)


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
    block = copy_meta(piece, memo)
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
                description: str = "", tokens_per_sample: int | None = None, holds_outputs: bool = True,
                whole: Callable[[], nn.Module] | None = None) -> Workload:
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
        tokens_per_sample=tokens_per_sample, ties=_ties(traced), holds_outputs=holds_outputs,
        description=description or f"{label}: {len(traced.trunk)} trunk blocks, split by tracing",
        traced=traced, weights=weights, whole_build=whole)


def _meta_or_seed0(piece: Piece, traced: Traced, weights: _Weights) -> Callable[[], nn.Module]:
    return lambda: _meta(piece) if _without_values() else _real(piece, traced, weights.at(0))


def _without_values() -> bool:
    """Whether blocks are being built where tensors hold no values: under torch.device("meta") (counting
    parameters or FLOPs) or on fake tensors (a memory prediction). Their meta weights serve; building the
    model's own (the whole model's initialisation, on fake tensors) would cost time and change nothing."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None or torch.empty(0).device.type == "meta"


def _meta(piece: Piece) -> nn.Module:
    return TracedBlock(replace(piece, module=copy_meta(piece.module)))


def _real(piece: Piece, traced: Traced, tensors: dict[str, torch.Tensor]) -> nn.Module:
    return TracedBlock(replace(piece, module=materialise(piece.module, tensors, traced.aliases)))


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
    whole_build: Callable[[], nn.Module] | None = None  # the model as the user's loop calls it, where not `build`

    def _block(self, index: int, seed: int) -> nn.Module:
        piece = self.traced.pieces[index]
        return _meta(piece) if _without_values() else _real(piece, self.traced, self.weights.at(seed))

    def compute_weights(self) -> list[int]:
        """Per block, the parameters that do arithmetic on every sample: those the traced graphs use other
        than as an embedding table (a lookup; the same tensor as a tied head counts where it multiplies)."""
        return [_compute_parameters(piece.module) for piece in self.traced.pieces]

    def build(self, indices: Sequence[int] | None = None, *, seed: int = 0, recompute: str = "none") -> nn.Sequential:
        try:
            return super().build(indices, seed=seed, recompute=recompute)
        finally:
            self.weights.release()  # what this process's blocks did not take is freed


    def whole_model(self, *, seed: int = 0) -> WholeModel:
        """The user's own model, built whole under the seed, as the one device a probe trial trains it on:
        no block boundary holds a byte the model would not (see Workload.whole_model)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = built_module(self.whole_build or self.weights.build, self.name)
        return WholeModel(model, self.loss, own_loss=self.traced.loss is not None)


class WholeModel(nn.Module):
    """The user's model as their loop calls it: `forward(inputs, targets)` -> (outputs, loss), the loss the
    model's own where it computes one from the targets (`GPT(idx, targets) -> (logits, loss)`), else the
    workload's loss of its outputs."""

    def __init__(self, model: nn.Module, loss: Callable[[Any, torch.Tensor], torch.Tensor], *, own_loss: bool) -> None:
        super().__init__()
        self.model, self.own_loss = model, own_loss
        self.loss_fn = loss

    def forward(self, inputs: Any, targets: torch.Tensor) -> tuple[Any, torch.Tensor]:
        from torch.utils import _pytree

        args = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
        if self.own_loss:
            out = self.model(*args, targets)
            return out, next(t for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() == 0)
        out = self.model(*args)
        outputs = [t for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        value: Any = outputs[0] if len(outputs) == 1 else tuple(outputs)
        return out, self.loss_fn(value, targets)


def whole_model_loss(workload: TracedWorkload, seed: int, inputs: Any, targets: torch.Tensor) -> float:
    """The user's own model, built under the seed as the blocks' weights are, on the batch: its loss as the
    workload defines it (the model's own where it computes one)."""
    model = workload.whole_model(seed=seed)
    model.train()
    return float(model(inputs, targets)[1])


def _compute_parameters(piece: nn.Module) -> int:
    tables: set[int] = set()
    for module in piece.modules():
        graph = getattr(module, "graph", None)
        if isinstance(module, nn.Embedding):
            tables.add(id(module.weight))
        if not isinstance(graph, fx.Graph):
            continue
        for node in graph.nodes:
            source = node.args[0] if node.op == "call_function" and node.args else None
            if "embedding" in str(node.target) and isinstance(source, fx.Node) and source.op == "get_attr":
                tables.add(id(module.get_parameter(str(source.target))))
    unique = {id(p): p for p in piece.parameters()}
    return sum(p.numel() for key, p in unique.items() if key not in tables)
