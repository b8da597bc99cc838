"""A workload's model in inference mode, on its device, at its precision: what the inference probe's trials
and the serving processes run batches through."""

from __future__ import annotations

import time
from typing import Any

import torch

from mbtune.device import get_backend
from mbtune.workloads import Workload


class InferenceModel:
    """A workload's model ready to serve: eval mode, on its device, with a pool of request samples."""

    def __init__(self, workload: Workload, *, device: str, precision: str, seed: int, pool_size: int = 0) -> None:
        from mbtune.training import autocast_for

        self.backend = get_backend(device)
        self.device = torch.device(self.backend.torch_device)
        self.model = workload.build(seed=seed).to(self.device).eval()
        self._autocast = lambda: autocast_for(precision, self.device)
        self._workload = workload
        self._generator = torch.Generator().manual_seed(seed)
        self.pool = self.inputs(pool_size) if pool_size else None

    def inputs(self, batch_size: int) -> Any:
        """A synthetic batch of inputs (the workload's own), on the device."""
        inputs, _ = self._workload.make_batch(batch_size, self._generator)
        return _to(inputs, self.device)

    def gather(self, indices: list[int]) -> Any:
        """The pool samples that these requests carry, as one batch (the server's collation)."""
        return _take(self.pool, torch.tensor(indices, device=self.device))

    def run(self, inputs: Any) -> float:
        """One forward pass; its wall seconds, the device synchronised after it."""
        self.backend.synchronize()
        start = time.perf_counter()
        with torch.inference_mode(), self._autocast():
            outputs = self.model(inputs)
        _first_tensor(outputs).sum().item()  # the answer leaves the device, as a server's response does
        return time.perf_counter() - start

    def signature(self) -> tuple[list[tuple[str, tuple[int, ...]]], list[tuple[str, tuple[int, ...]]]]:
        """The model's inputs and outputs as (dtype, dimensions after the batch's), from one sample."""
        inputs = self.inputs(1)
        with torch.inference_mode(), self._autocast():
            outputs = self.model(inputs)
        return _signature(inputs), _signature(outputs)


def _signature(value: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor in a tensor, tuple, list or dict, in order, as (dtype, shape without the batch)."""
    if isinstance(value, torch.Tensor):
        return [(str(value.dtype).removeprefix("torch."), tuple(value.shape[1:]))]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple | list) else ()
    return [s for item in items for s in _signature(item)]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return type(value)(_to(v, device) for v in value)


def _take(value: Any, indices: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value.index_select(0, indices)
    if isinstance(value, dict):
        return {k: _take(v, indices) for k, v in value.items()}
    return type(value)(_take(v, indices) for v in value)


def _first_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value
    return _first_tensor(next(iter(items)))
