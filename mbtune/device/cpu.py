"""CPU backend: the budget counts live tensor bytes (device/tensor_bytes.py); facts from /proc."""

from __future__ import annotations

import os
import platform
import resource
from typing import TYPE_CHECKING

from mbtune.records import DeviceInfo

if TYPE_CHECKING:
    from mbtune.device.tensor_bytes import TensorBytes


def read_status_bytes(*keys: str) -> dict[str, int]:
    """Values of /proc/self/status memory lines (VmSize, VmPeak, VmHWM, VmRSS...) in bytes."""
    found: dict[str, int] = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in keys:
                found[key] = int(rest.split()[0]) * 1024
    return found


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (falls back to total memory)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return total_memory_bytes()


def address_space_room_bytes() -> int | None:
    """What this process's address-space limit (ulimit -v, RLIMIT_AS, which trial processes inherit) leaves
    above what is mapped now; None when there is no limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(0, soft - read_status_bytes("VmSize")["VmSize"])


def check_budget_fits_limit(memory_budget_bytes: int | None) -> None:
    """Refuse a memory budget that this process's own address-space limit cannot hold: the trials' tensors
    need that much address space on top of what is mapped now, so they would stop at the limit instead of
    at the budget, for no stated reason."""
    room = address_space_room_bytes()
    if memory_budget_bytes is None or room is None or memory_budget_bytes <= room:
        return
    from mbtune.errors import ConfigError

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    raise ConfigError(f"memory_budget_bytes={_gib(memory_budget_bytes)} does not fit this process's address-space limit "
                      f"(ulimit -v / RLIMIT_AS: {_gib(soft)}, {_gib(room)} of it free): trials would stop at the "
                      "limit, not at the budget", field="memory_budget_bytes",
                      hint=f"Raise the limit (ulimit -v unlimited) or give a budget of at most {_gib(room)}.")


def _gib(size_bytes: int) -> str:
    return f"{size_bytes / 2**30:.3g}GiB"


class CpuBackend:
    """The trial process's own view of the CPU as a training device."""

    name = "cpu"

    def __init__(self) -> None:
        self._count: TensorBytes | None = None

    @property
    def torch_device(self) -> str:
        return "cpu"

    def limit_memory(self, memory_budget_bytes: int | None) -> None:
        """Count this thread's live tensor bytes from now on; past the budget an operator raises
        torch.OutOfMemoryError."""
        from mbtune.device.tensor_bytes import TensorBytes

        self._count = TensorBytes(memory_budget_bytes=memory_budget_bytes)
        self._count.__enter__()

    def synchronize(self) -> None:
        """Nothing to wait for: CPU kernels finish before they return."""

    def peaks(self) -> dict[str, int | None]:
        """Live tensor bytes at most (what the budget caps) and the process's resident high-water mark."""
        counted = self._count.peak_bytes if self._count is not None else None
        return {
            "peak_memory_bytes": counted,
            "peak_reserved_bytes": read_status_bytes("VmHWM")["VmHWM"],
            "budget_used_bytes": counted,
        }

    def info(self) -> DeviceInfo:
        import torch

        return DeviceInfo(backend="cpu", name=cpu_name(), total_memory_bytes=total_memory_bytes(),
                          torch_version=torch.__version__, num_cpus=os.cpu_count() or 1)
