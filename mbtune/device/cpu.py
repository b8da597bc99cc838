"""CPU backend: a real OOM by capping the trial process's address space; peaks from /proc."""

from __future__ import annotations

import ctypes
import os
import platform
import resource

from mbtune.records import DeviceInfo

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc mallopt parameters
_MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, held fixed


def share_one_malloc_arena() -> None:
    """Keep later threads on the existing malloc arenas. Each new glibc arena reserves 64 MiB of address
    space that is never touched, and when a helper thread makes its first allocation is a race; under an
    address-space cap that reservation would move the ceiling by whole batches from one run to the next."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass  # not glibc: no arenas to pin


def fix_the_mmap_threshold() -> None:
    """Hold glibc's mmap threshold at its starting 128 KiB, so every large tensor is its own mapping, returned
    to the system when freed. Left dynamic, glibc raises the threshold after the first large free and serves
    later tensors from a heap that keeps what was freed; how much it keeps depends on the cap itself, so
    under an address-space cap a larger batch could fit where a smaller one failed. Held fixed, the address
    space a step needs is its live memory, the same capped or not. A threshold the user set
    (MALLOC_MMAP_THRESHOLD_, or glibc.malloc.mmap_threshold in GLIBC_TUNABLES) is the one the run will use,
    and is kept."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass  # not glibc


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


class CpuBackend:
    """The trial process's own view of the CPU as a training device."""

    name = "cpu"

    def __init__(self) -> None:
        self._start_vm_bytes = 0

    @property
    def torch_device(self) -> str:
        return "cpu"

    def limit_memory(self, budget_bytes: int | None) -> None:
        """Cap the address space at its start-up size plus the budget, so the allocator raises a real OOM."""
        if budget_bytes is not None:
            share_one_malloc_arena()
            fix_the_mmap_threshold()
        self._start_vm_bytes = read_status_bytes("VmSize")["VmSize"]
        if budget_bytes is not None:
            limit = self._start_vm_bytes + budget_bytes
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def synchronize(self) -> None:
        """Nothing to wait for: CPU kernels finish before they return."""

    def peaks(self) -> dict[str, int | None]:
        status = read_status_bytes("VmHWM", "VmPeak")
        return {
            "peak_memory_bytes": status["VmHWM"],
            "peak_reserved_bytes": None,
            "budget_used_bytes": status["VmPeak"] - self._start_vm_bytes,
        }

    def info(self) -> DeviceInfo:
        import torch

        return DeviceInfo(backend="cpu", name=cpu_name(), total_memory_bytes=total_memory_bytes(),
                          torch_version=torch.__version__, num_cpus=os.cpu_count() or 1)
