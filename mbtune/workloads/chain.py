"""How one block's output becomes the next block's input: the hand-over contract, in one process and across
pipeline stages.

A block returns a tensor, a tuple (or list) of tensors, or a dict of tensors. The next block receives a
tuple as positional arguments, a dict as keyword arguments, a tensor as its one argument. Tensors that need
no gradient (masks, rotary tables) hand over as they are and carry none back.

torch.distributed.pipelining hands a stage only a flat tuple of tensors, so at a stage boundary a dict is
sent as its values in key order and rebuilt by the receiving stage from the keys (`StageModule`). The keys
come from one forward of the whole chain at batch size 1, on the meta device where it runs (no memory, no
arithmetic), else on the CPU (`handover_keys`). A sent tensor must be contiguous and not a view (the
zero-bubble schedules detach it in place after the backward, which a view refuses): such tensors are
copied. Coming back, a received tensor's gradient is made contiguous too (a block that transposes what it
received would otherwise send a transposed gradient). Every dtype crosses (int64 targets and position ids,
bool masks, bfloat16 and float16): torch's shape inference runs each stage on buffers of zeros, not on
uninitialised ones (pipeline/schedules.py). What the contract cannot carry: values
that are not tensors, and shapes that change from micro-batch to micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mbtune.errors import WorkloadError

if TYPE_CHECKING:
    from mbtune.workloads import Workload


HANDOVER_HINT = ("A tuple is passed positionally, a dict by keyword: match the block's forward to what the block "
                 "before it returns.")


def call_block(block: nn.Module, value: Any) -> Any:
    """The block applied to the previous block's output, as the contract says."""
    if isinstance(value, dict):
        return block(**value)
    if isinstance(value, tuple | list):
        return block(*value)
    return block(value)


def tensors_of(value: Any) -> list[Any]:
    """The tensors of a hand-over, in order (a dict's in its own order)."""
    return list(value.values()) if isinstance(value, dict) else list(value) if isinstance(value, tuple | list) else [value]


def map_tensors(value: Any, change: Any) -> Any:
    """The hand-over with `change` applied to each of its tensors, its shape (tensor, tuple, dict) kept."""
    if isinstance(value, dict):
        return {k: change(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return tuple(change(v) for v in value)
    return change(value)


def batch_to(value: Any, device: torch.device | str) -> Any:
    """A batch's inputs (a tensor, or a tuple of tensors passed positionally) on the device."""
    return map_tensors(value, lambda t: t.to(device))


def batch_rows(value: Any, rows: slice) -> Any:
    """The given samples (rows) of every tensor of a batch's inputs."""
    return map_tensors(value, lambda t: t[rows])


def batch_cat(values: Sequence[Any]) -> Any:
    """Batches' inputs joined sample-wise, each tensor of the tuple with its own."""
    if isinstance(values[0], tuple | list):
        return tuple(torch.cat(parts) for parts in zip(*values))
    return torch.cat(list(values))


def batch_chunk(value: Any, chunks: int) -> list[Any]:
    """A batch's inputs cut into `chunks` parts sample-wise."""
    if isinstance(value, tuple | list):
        return [tuple(parts) for parts in zip(*(t.chunk(chunks) for t in value))]
    return list(value.chunk(chunks))


def as_received(value: Any) -> Any:
    """A hand-over as the next stage receives it: detached, needing a gradient where the sent tensor did
    (a mask or a rotary table crosses without one)."""
    return map_tensors(value, lambda t: t.detach().requires_grad_(t.requires_grad and t.is_floating_point()))


class Chain(nn.Sequential):
    """Blocks in order, each fed the previous one's output by the contract (call_block). Called with
    several arguments, the first block gets them all. `first` is the global index of the first block, so
    a block that cannot take what it is handed is named as the whole model numbers it."""

    first = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        value: Any = kwargs if kwargs else (args[0] if len(args) == 1 else args)
        for offset, block in enumerate(self):
            try:
                value = self.step(block, value)
            except TypeError as exc:
                if "argument" not in str(exc):
                    _mark_block(exc, self.first + offset)
                    raise
                index = self.first + offset
                source = "the batch" if index == 0 else f"block {index - 1}'s output"
                raise WorkloadError(f"block {index} cannot take {source} ({_shape(value)}): {exc}",
                                    hint=HANDOVER_HINT) from exc
            except Exception as exc:
                index = self.first + offset
                _mark_block(exc, index, given=f"{'the batch' if index == 0 else f'block {index - 1} output'} "
                                               f"{_described(value)}")
                raise
        return value

    def step(self, block: nn.Module, value: Any) -> Any:
        return call_block(block, value)


def _mark_block(exc: BaseException, index: int, given: str = "") -> None:
    """Remember the block an exception came from (the innermost chain's, where chains nest) and what it was
    given, so the error can say what the block must take."""
    if getattr(exc, "mbtune_block", None) is None:
        try:
            exc.mbtune_block = index  # type: ignore[attr-defined]
            exc.mbtune_given = given  # type: ignore[attr-defined]
        except AttributeError:  # an exception type without a __dict__
            pass


def _described(value: Any, limit: int = 48) -> str:
    """A hand-over's tensors' shapes and dtypes, short: "(4, 8) float32", "(4, 64) int64, (4, 64, 128) float32"."""
    text = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor)
                     else type(t).__name__ for t in tensors_of(value))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_output(value: Any, where: str) -> None:
    """Refuse an output the contract cannot hand over, naming the block."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple | list) else (value,)
    bad = [type(item).__name__ for item in items if not isinstance(item, torch.Tensor)]
    if bad or (isinstance(value, dict) and not all(isinstance(k, str) for k in value)):
        raise WorkloadError(f"{where} returns {type(value).__name__} holding {', '.join(bad) or 'non-string keys'}: "
                            "a block hands over a tensor, a tuple of tensors or a dict of tensors",
                            hint="Return only tensors; pass settings through the block's constructor.")


def output_keys(value: Any) -> tuple[str, ...] | None:
    """The keys of a dict output in the order it is sent (sorted), or None for a tensor or a tuple."""
    return tuple(sorted(value)) if isinstance(value, dict) else None


def handover_keys(workload: Workload, seed: int = 0) -> tuple[tuple[str, ...] | None, ...]:
    """Per block, the keys of its dict output (None: a tensor or a tuple), from one forward of the chain at
    batch size 1: on the meta device, else on the CPU. Each output is checked against the contract and a
    block that cannot take the previous one's gives one clear error naming it. A block that fails for
    another reason ends the trace there (None for the rest): the training step fails the same way, where
    failures are classified, or a stage that then hands over a dict the trace did not see says so."""
    try:
        return _trace_keys(workload, seed, torch.device("meta"))
    except WorkloadError:
        raise
    except Exception:  # noqa: BLE001 - user code that the meta device cannot run: run it for real, small
        return _trace_keys(workload, seed, torch.device("cpu"))


def _trace_keys(workload: Workload, seed: int, device: torch.device) -> tuple[tuple[str, ...] | None, ...]:
    inputs, _ = workload.make_batch(1, torch.Generator().manual_seed(seed))
    value: Any = batch_to(inputs, device)
    keys: list[tuple[str, ...] | None] = []
    with torch.no_grad(), torch.device(device):
        for index, build in enumerate(workload.blocks):
            block = build()
            try:
                value = call_block(block, value)
            except TypeError as exc:
                if device.type == "meta" or "argument" not in str(exc):
                    raise
                source = "the batch" if index == 0 else f"block {index - 1}'s output"
                raise WorkloadError(f"block {index} cannot take {source} ({_shape(value)}): {exc}",
                                    hint=HANDOVER_HINT) from exc
            except Exception:  # noqa: BLE001 - not the contract's business (see handover_keys)
                if device.type == "meta":
                    raise
                return (*keys, *([None] * (len(workload.blocks) - index)))
            check_output(value, f"block {index}")
            keys.append(output_keys(value))
    return tuple(keys)


def _shape(value: Any) -> str:
    if isinstance(value, dict):
        return "dict of " + ", ".join(value)
    if isinstance(value, tuple | list):
        return f"tuple of {len(value)}"
    return "a tensor"


class StageModule(nn.Module):
    """One pipeline stage's chain of blocks as torch pipelining runs it: a flat tuple of tensors in, a
    tensor or a flat tuple out. `in_keys` rebuilds the dict the previous stage sent (None: positional);
    outputs of a stage that is not the last are flattened (dict values in key order) and made safe to
    send (contiguous, no views)."""

    def __init__(self, chain: nn.Module, *, in_keys: tuple[str, ...] | None, last: bool,
                 out_keys: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.chain, self.in_keys, self.last, self.out_keys = chain, in_keys, last, out_keys

    def forward(self, *tensors: torch.Tensor) -> Any:
        tensors = tuple(_ContiguousGrad.apply(t) if t.requires_grad else t for t in tensors)
        out = self.chain(**dict(zip(self.in_keys, tensors))) if self.in_keys is not None else self.chain(*tensors)
        if self.last:
            if isinstance(out, dict):
                raise WorkloadError("the last block returns a dict: torch pipelining hands the last stage's output "
                                    "to the loss as a tensor or a tuple", hint="Return the logits (or a tuple).")
            return out
        if output_keys(out) != self.out_keys:  # the next stage rebuilds a dict from these keys only
            raise WorkloadError(f"a stage hands over {_shape(out)} where the trace at batch size 1 saw "
                                f"{'a dict of ' + ', '.join(self.out_keys) if self.out_keys else 'a tensor or a tuple'}",
                                hint="Hand over the same structure at every batch size.")
        items: Sequence[torch.Tensor] = ([out[k] for k in sorted(out)] if isinstance(out, dict)
                                         else list(out) if isinstance(out, tuple | list) else [out])
        sent = tuple(_sendable(t) for t in items)
        return sent[0] if len(sent) == 1 else sent


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient is made contiguous: a received tensor's gradient is sent back to the
    stage before, and a block that transposes what it received would otherwise send a transposed one."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _sendable(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone(memory_format=torch.contiguous_format) if tensor._is_view() or not tensor.is_contiguous() \
        else tensor
