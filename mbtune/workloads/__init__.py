"""Workloads: plain models described by the workload contract, with no knowledge of pipelines or timing.

A workload factory takes keyword options and returns a `Workload`:

- ``blocks``: ordered builders, one per block, each returning an ``nn.Module``; block i's output is block
  i+1's input: a tensor, a tuple of tensors (passed positionally) or a dict of tensors (passed by
  keyword), see chain.py. Pipeline stages own contiguous runs of blocks and build only their own.
- ``ties`` (optional): parameters that are one tensor in several blocks (a tied embedding and head), each
  tie a tuple of (block index, parameter name). Within a stage they are one parameter; across stages each
  holder keeps a copy and their gradients are summed before the update.
- ``make_batch(batch_size, generator)``: a synthetic (inputs, targets) pair on the CPU.
- ``loss(outputs, targets)``: a scalar loss, mean-reduced over the batch.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mbtune.errors import WorkloadError

if TYPE_CHECKING:
    import torch
    from torch import nn

def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


BUILTINS = {"gpt": "mbtune.workloads.gpt:gpt", "mlp": "mbtune.workloads.mlp:mlp"}


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The workload contract (see the module docstring)."""

    name: str
    blocks: Sequence[Callable[[], nn.Module]]
    make_batch: Callable[[int, torch.Generator | None], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    flops_per_sample: float | None = None  # training FLOPs (forward + backward) per sample
    tokens_per_sample: int | None = None
    description: str = ""
    ties: tuple[tuple[tuple[int, str], ...], ...] = ()
    # Whether the loop users train this model with keeps a step's outputs until the next forward returns
    # (`logits, loss = model(x, y)`, `out = model(x)`): a probe trial holds them so. transformers' Trainer,
    # Lightning and `loss = model(**batch).loss` drop them when the step's loss is taken (hf: workloads).
    holds_outputs: bool = True

    def __post_init__(self) -> None:
        if not self.blocks:
            raise WorkloadError(f"workload {self.name!r} has no blocks", hint="Return at least one block builder.")
        fix = "Fix the workload factory's return value."
        if not all(callable(b) for b in self.blocks):
            raise WorkloadError(f"workload {self.name!r}: every block must be a callable that builds a module",
                                hint=fix)
        for name in ("make_batch", "loss"):
            if not callable(getattr(self, name)):
                raise WorkloadError(f"workload {self.name!r}: {name} must be callable", hint=fix)
        flops = self.flops_per_sample
        if flops is not None and (isinstance(flops, bool) or not isinstance(flops, int | float)
                                  or not math.isfinite(flops) or flops <= 0):
            raise WorkloadError(f"workload {self.name!r}: flops_per_sample is {_short(flops)}, expected a "
                                "positive number or None", hint=fix)
        tokens = self.tokens_per_sample
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise WorkloadError(f"workload {self.name!r}: tokens_per_sample is {_short(tokens)}, expected an "
                                "integer >= 1 or None", hint=fix)
        for tie in self.ties:
            ok = (isinstance(tie, tuple | list) and len(tie) >= 2
                  and all(isinstance(m, tuple | list) and len(m) == 2 and isinstance(m[0], int)
                          and not isinstance(m[0], bool) and 0 <= m[0] < len(self.blocks) and isinstance(m[1], str)
                          for m in tie) and len({m[0] for m in tie}) == len(tie))
            if not ok:
                raise WorkloadError(f"workload {self.name!r}: tie {_short(tie)} must name (block, parameter) "
                                    "pairs of two or more different blocks", hint=fix)
        # Members in block order: the first is the one the whole model names the tensor by (and its value).
        object.__setattr__(self, "ties", tuple(tuple(sorted((int(b), str(n)) for b, n in tie)) for tie in self.ties))
        # Their failures name them, and a batch of the wrong form is refused saying what the form is.
        object.__setattr__(self, "make_batch", _checked_batch_maker(self.name, self.make_batch))
        object.__setattr__(self, "loss", _named_part(self.loss, "loss"))

    @classmethod
    def from_module(cls, build: Callable[[], nn.Module], *, make_batch: Callable[..., Any],
                    loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None, name: str | None = None,
                    description: str = "", tokens_per_sample: int | None = None,
                    holds_outputs: bool = True, whole: Callable[[], nn.Module] | None = None) -> Workload:
        """A plain nn.Module as a workload, split by mbtune (traced.py).

        `build()` returns the model (called with no arguments, on the meta device to trace it and on the CPU
        for its weights); `make_batch(batch_size, generator)` returns (inputs, targets), inputs a tensor or
        a tuple of tensors passed positionally. With `loss=fn(outputs, targets)` the model returns its
        outputs; without it the model takes the targets after its inputs and computes its own loss (its
        scalar output that reads the targets), as `GPT(idx, targets) -> (logits, loss)` does.
        `holds_outputs=False` where your loop drops a step's outputs once it has the loss (`loss =
        model(**batch).loss`, a Trainer's): a probe trial then does too (Workload.holds_outputs). `whole`: the
        model as your loop calls it, where that differs from what `build` gives to be traced (a probe trial
        on one device trains it; Workload.whole_model)."""
        from mbtune.workloads.traced import from_module

        return from_module(build, make_batch=make_batch, loss=loss, name=name, description=description,
                           tokens_per_sample=tokens_per_sample, holds_outputs=holds_outputs, whole=whole)

    def whole_model(self, *, seed: int = 0) -> nn.Module | None:
        """The model as the user wrote it, for one device: `forward(inputs, targets)` -> (outputs, loss).
        None where the blocks are the model (a workload written as blocks): the chain of them is then what
        trains. A probe trial trains this where there is one, so its peak is the user's loop's, with no
        hand-over between blocks held (from_module and hf: workloads)."""
        return None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def build(self, indices: Sequence[int] | None = None, *, seed: int = 0, recompute: str = "none") -> nn.Sequential:
        """Build the given blocks (all by default) with weights that depend only on (seed, block index),
        so a pipeline stage builds exactly the weights the whole model would have. The blocks form a Chain
        (chain.py); with recompute "full" every block is an activation checkpoint (recompute.py): same
        parameters, same names. A tie's members among the blocks built are one parameter, with the value
        the tie's first block gives it."""
        from mbtune.workloads.chain import Chain
        from mbtune.workloads.recompute import Recomputed, check_recompute

        check_recompute(recompute)
        chosen = list(range(self.num_blocks) if indices is None else indices)
        built = {i: self._block(i, seed) for i in chosen}
        for tie in self.ties:
            held = [(b, name) for b, name in tie if b in built]
            if not held:
                continue
            first_block, first_name = tie[0]
            source = built[first_block] if first_block in built else self._block(first_block, seed)
            shared = source.get_parameter(first_name)
            for b, name in held:
                _set_parameter(built[b], name, shared)
        modules = [built[i] for i in chosen]
        chain = Recomputed(*modules) if recompute == "full" else Chain(*modules)
        chain.first = chosen[0] if chosen else 0
        return chain

    def _block(self, index: int, seed: int) -> nn.Module:
        import torch

        torch.manual_seed(seed * 100_003 + index)
        return self.blocks[index]()

    def tied_copies(self) -> set[tuple[int, str]]:
        """The (block, parameter) of every tie member after its first: the same tensor as the first, so
        counted, reported and compared once."""
        return {member for tie in self.ties for member in tie[1:]}

    def compute_weights(self) -> list[int]:
        """Per block, the parameters that do arithmetic on every sample (meta device, no allocation): what
        pipeline stages are balanced by. Embedding tables are left out: a lookup costs next to nothing, so
        counting a large vocabulary would pile the real work onto the other stages."""
        import torch
        from torch import nn

        with torch.device("meta"):
            return [sum(p.numel() for m in build().modules() if not isinstance(m, nn.Embedding)
                        for p in m.parameters(recurse=False)) for build in self.blocks]

    def num_parameters(self) -> int:
        """Parameter count, computed on the meta device without allocating weights; a tied tensor once."""
        import torch

        copies = self.tied_copies()
        with torch.device("meta"):
            return sum(p.numel() for index, build in enumerate(self.blocks)
                       for name, p in build().named_parameters() if (index, name) not in copies)


BATCH_FORM = "not (inputs, targets) of tensors (inputs may be a tuple or dict of them)"


BATCH_FIX = "Fix the workload's make_batch."


def failed_part(exc: BaseException) -> str | None:
    """The part of the workload an exception came from ("block 3 (given block 2 output (4, 8) float32)",
    "loss", "batch maker"), or None."""
    block = getattr(exc, "mbtune_block", None)
    if block is None:
        return getattr(exc, "mbtune_part", None)
    given = getattr(exc, "mbtune_given", "")
    return f"block {block} (given {given})" if given else f"block {block}"


def _named_part(function: Callable[..., Any], part: str) -> Callable[..., Any]:
    """`function`, whose exceptions are marked as raised in `part` of the workload (their type unchanged:
    an out-of-memory error stays one)."""
    if getattr(function, "mbtune_part", None) == part:
        return function

    def named(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            if failed_part(exc) is None:
                exc.mbtune_part = part  # type: ignore[attr-defined]
            raise

    named.mbtune_part = part  # type: ignore[attr-defined]
    return named


def _checked_batch_maker(name: str, make_batch: Callable[..., Any]) -> Callable[..., Any]:
    """The batch maker, refusing a batch that is not (inputs, targets) with one line that says the form."""
    if getattr(make_batch, "mbtune_part", None) == "batch maker":
        return make_batch
    made = _named_part(make_batch, "batch maker")

    def checked(batch_size: int, generator: Any) -> Any:
        import torch

        batch = made(batch_size, generator)
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            got = f"{len(batch)} values" if isinstance(batch, tuple | list) else f"a {type(batch).__name__}"
            raise WorkloadError(f"make_batch of {name!r} gave {got}, {BATCH_FORM}", hint=BATCH_FIX)
        inputs, targets = batch
        tensors = (list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
                   if isinstance(inputs, tuple | list) else [inputs])
        if not isinstance(targets, torch.Tensor) or not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            kinds = ", ".join(sorted({type(t).__name__ for t in [*tensors, targets]}))
            raise WorkloadError(f"make_batch of {name!r} gave {kinds}, {BATCH_FORM}",
                                hint=BATCH_FIX)
        return batch

    checked.mbtune_part = "batch maker"  # type: ignore[attr-defined]
    return checked


def _set_parameter(module: nn.Module, name: str, parameter: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, parameter)


def load_workload(name: str, options: Sequence[tuple[str, Any]] = ()) -> Workload:
    """Resolve a built-in name, ``hf:<family or config.json>`` (workloads/hf.py) or ``package.module:factory``
    and call the factory with the options. The option `slowdown` (a share, e.g. 0.15) belongs to every
    workload: each block's throughput then falls by that share (workloads/slowdown.py)."""
    from mbtune.workloads.slowdown import slowed, split_slowdown

    share, options = split_slowdown(options)
    if share:
        workload = load_workload(name, options)
        return replace(workload, blocks=tuple(slowed(b, share) for b in workload.blocks))
    if name.startswith("hf:"):
        from mbtune.workloads.hf import hf_workload

        return hf_workload(name[3:], dict(options))
    target = BUILTINS.get(name, name)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise WorkloadError(f"unknown workload {name!r}")
    if name not in BUILTINS and os.getcwd() not in sys.path:
        # A user's workload module next to where they run mbtune imports from there, after everything
        # installed: the folder never shadows an installed package (a checkout of mbtune itself, say).
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure of user code is bad input
        raise WorkloadError(f"cannot import workload module {module_name!r}: {type(exc).__name__}: {exc}",
                            hint=_shadowed_hint(module_name)) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise WorkloadError(f"module {module_name!r} has no callable {attr!r}")
    from mbtune.workloads.options import convert_options

    kwargs = dict(options)
    _check_options(name, factory, kwargs)
    kwargs = convert_options(name, factory, kwargs)  # bias=false is False where the factory says bias: bool
    try:
        workload = factory(**kwargs)
    except WorkloadError:
        raise
    except Exception as exc:
        raise WorkloadError(f"workload factory {target!r} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(f"workload factory {target!r} returned {type(workload).__name__}, not a Workload",
                            hint="Return mbtune.workloads.Workload(blocks=..., make_batch=..., loss=...).")
    return workload


def _shadowed_hint(module_name: str) -> str | None:
    """Where an installed package has the name of the user's module in this folder, say so."""
    top = module_name.split(".")[0]
    here = os.path.join(os.getcwd(), top)
    spec = importlib.util.find_spec(top) if top not in sys.builtin_module_names else None
    origin = (spec.origin or "") if spec is not None else ""
    if (os.path.isdir(here) or os.path.isfile(here + ".py")) and origin and not origin.startswith(os.getcwd()):
        return (f"An installed {top!r} ({origin}) comes before ./{top} on the import path: rename your module, or "
                f"run from its parent folder with the package name.")
    return None


def _check_options(name: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    params = inspect.signature(factory).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        accepted = ", ".join(params) or "none"
        raise WorkloadError(f"workload {name!r} has no option {', '.join(unknown)}",
                            hint=f"Options it accepts: {accepted}.")
