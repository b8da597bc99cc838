"""The CPU's memory budget: the bytes of live tensors, counted as CUDA's caching allocator counts them.

A GPU's budget is what its allocator hands out to tensors; an address-space cap on the CPU is not (malloc
arenas, thread stacks and start-up mappings move it from one process to the next). So on the CPU mbtune
counts what a training step holds: every tensor storage an operator creates, rounded up to CUDA's 512-byte
blocks, from the moment it is created until the last reference to it goes. When a new storage takes the
count past the budget, the operator raises `torch.OutOfMemoryError`, as CUDA's allocator does.

The count is a `TorchDispatchMode`: it sees every operator of the threads it is entered in (and autograd's
backward, which runs them for the CPU), forward, backward and optimizer alike. It does not see buffers an
operator allocates for itself and frees before returning (CUDA's count would), nor tensors created outside
the operators (`torch.from_numpy`, storages loaded from files). The same program counts the same bytes in
every process, so a size fits or fails the same way every time.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

BLOCK_BYTES = 512  # CUDA's caching allocator rounds every allocation up to a multiple of this
_DEVICE = torch.ops.prim.device.default  # a tensor subclass asked for its device: nothing is allocated


def block_bytes(nbytes: int) -> int:
    """An allocation of `nbytes` as CUDA's allocator counts it."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def _mib(size: int) -> str:
    return f"{size / 2**20:,.2f} MiB"


class TensorBytes(TorchDispatchMode):
    """Counts the live tensor storages of one device type (None: every device, fake tensors included).

    `live_bytes` and `peak_bytes` are the counts now and at most; with `memory_budget_bytes`, a storage that would
    take the count past it raises torch.OutOfMemoryError (`over_budget` keeps the first such message; the bytes
    the operator asked for and those live before it, `over_budget_requested_bytes` and `over_budget_live_bytes`,
    its figures: their sum is a lower bound of the step's peak). With
    `timeline`, the live count after every operator is kept in `timeline` (one program counted at two batch
    sizes gives each moment's bytes as a line in the batch size)."""

    def __init__(self, *, memory_budget_bytes: int | None = None, device_type: str | None = "cpu",
                 timeline: bool = False) -> None:
        super().__init__()
        self.memory_budget_bytes, self.device_type = memory_budget_bytes, device_type
        self.timeline: list[int] | None = [] if timeline else None
        self.live_bytes = 0
        self.peak_bytes = 0
        self.over_budget = ""
        self.over_budget_requested_bytes: int | None = None
        self.over_budget_live_bytes: int | None = None
        self.counting = False
        self._sizes: dict[int, tuple[int, weakref.ref]] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> TensorBytes:
        self.counting = True
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.counting = False
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE:  # autograd asks a fake tensor this for every gradient (two thirds of a fake step's
            return _device_of(args[0])  # operators): answered as the fake tensor does, and not a moment
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            grown = self._track(out)
        else:
            grown = sum(self._track(leaf) for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor))
        if grown and self.memory_budget_bytes is not None and self.live_bytes > self.memory_budget_bytes:
            # Worded as the CPU allocator's own message, which training tools already recognise; its figures
            # exact, as device/oom_figures.py reads them.
            live = self.live_bytes - grown
            self.over_budget_requested_bytes, self.over_budget_live_bytes = grown, live
            self.over_budget = (f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {grown} bytes "
                                f"({func}) with {live} bytes ({_mib(live)}) of the {_mib(self.memory_budget_bytes)} "
                                "memory budget in live tensors")
            raise torch.OutOfMemoryError(self.over_budget)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if self.timeline is not None:
            self.timeline.append(self.live_bytes)
        return out

    def _track(self, tensor: torch.Tensor) -> int:
        """Count this tensor's storage if it is new (or has grown); the bytes added."""
        if self.device_type is not None and tensor.device.type != self.device_type:
            return 0
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return 0  # sparse, nested and other storage-less layouts
        key = storage._cdata
        size = block_bytes(storage.nbytes())
        known = self._sizes.get(key)
        if known is not None and known[0] == size:
            return 0  # a view, or an operator that wrote in place: nothing new
        with self._lock:
            if known is not None:
                grown = size - known[0]
                if grown:
                    self._sizes[key] = (size, known[1])
                    self.live_bytes += grown
                return max(grown, 0)
            # The storage's Python object lives exactly as long as the storage (torch keeps it alive with
            # its C++ object), so its weak reference dies when the memory goes back.
            self._sizes[key] = (size, weakref.ref(storage, functools.partial(self._free, key)))
            self.live_bytes += size
        return size

    def _free(self, key: int, _ref: weakref.ref) -> None:
        with self._lock:
            size, _ = self._sizes.pop(key, (0, None))
            self.live_bytes -= size

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


def _device_of(tensor: torch.Tensor) -> torch.device:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(tensor, FakeTensor) and not tensor.fake_mode.in_kernel_invocation:
        return tensor.fake_device
    return _DEVICE(tensor)


def fake_tensors() -> Any:
    """A mode in which tensors are fake: real shapes, dtypes and storages, no memory, no arithmetic; the
    operators of the device type they claim (what memory predictions run under)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def paused(count: TensorBytes | None) -> Iterator[None]:
    """Tensors created inside are not counted (those counted before still count until they go)."""
    if count is None or not count.counting:
        yield
        return
    count.__exit__(None, None, None)
    try:
        yield
    finally:
        count.__enter__()
