"""Device backends: memory limits and stats, synchronisation, OOM classification, device facts.

The functions that touch torch are meant to run inside trial processes; `resolve_device` may run in the
parent and only asks torch whether CUDA devices are visible.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mbtune.errors import DeviceError
from mbtune.records import ERROR, OOM

if TYPE_CHECKING:
    from mbtune.device.cpu import CpuBackend
    from mbtune.device.cuda import CudaBackend

# Allocator messages that mean "out of memory" when an allocator raises a plain RuntimeError.
OOM_MESSAGES = (
    "DefaultCPUAllocator: can't allocate memory",
    "CUDA out of memory",
    "CUDA error: out of memory",
    "std::bad_alloc",
)


def classify_error(exc: BaseException) -> str:
    """oom for a real out-of-memory error (by type first, then by known allocator message), else error."""
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return OOM
    if isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MESSAGES):
        return OOM
    return ERROR


def resolve_device(device: str) -> str:
    """Turn 'auto' into a concrete device and check that a requested CUDA device is visible."""
    import torch

    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.partition(":")[2] or 0)
        if count == 0:
            raise DeviceError(f"{device} was requested but no CUDA device is visible", hint="Use --device cpu or auto.")
        if index >= count:
            raise DeviceError(f"{device} was requested but only {count} CUDA device(s) are visible")
    return device


def get_backend(device: str) -> CpuBackend | CudaBackend:
    """The backend for a resolved device string."""
    if device.startswith("cuda"):
        from mbtune.device.cuda import CudaBackend

        return CudaBackend(int(device.partition(":")[2] or 0))
    from mbtune.device.cpu import CpuBackend

    return CpuBackend()
