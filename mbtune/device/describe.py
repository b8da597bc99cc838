"""A device's facts (DeviceInfo): the CPU read here, a GPU read in a fresh process."""

from __future__ import annotations

from typing import Any

from mbtune.device import get_backend
from mbtune.errors import (
    TrialFailedError,
)
from mbtune.records import OK, DeviceInfo


def describe(device: str, timeout_s: float = 120.0) -> DeviceInfo:
    """DeviceInfo of a resolved device. A GPU is read in a fresh process, so this process never
    initialises CUDA; the CPU is read here (nothing to initialise, and no trial process to wait for)."""
    from mbtune.worker import run_isolated

    if device == "cpu":
        from mbtune.device.cpu import CpuBackend

        return CpuBackend().info()
    result = run_isolated(describe_device, device, timeout_s=timeout_s)
    if result.status != OK:
        raise TrialFailedError(f"could not read the facts of device {device}: {result.error}")
    return result.value


def describe_device(device: str) -> Any:
    """DeviceInfo of a resolved device, read inside a child so the parent never initialises CUDA."""
    return get_backend(device).info()
