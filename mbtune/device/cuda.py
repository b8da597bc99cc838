"""CUDA backend: the per-process memory fraction as the budget; caching-allocator peaks."""

from __future__ import annotations

import os

from mbtune.records import DeviceInfo


class CudaBackend:
    """The trial process's own view of one CUDA device."""

    name = "cuda"

    def __init__(self, index: int) -> None:
        import torch

        self.index = index
        self._torch = torch
        torch.cuda.set_device(index)

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.index}"

    def limit_memory(self, budget_bytes: int | None) -> None:
        """Lower the allocator's ceiling to the budget; never RLIMIT_AS (CUDA reserves huge virtual ranges)."""
        cuda = self._torch.cuda
        if budget_bytes is not None:
            total = cuda.get_device_properties(self.index).total_memory
            cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), self.index)
        cuda.reset_peak_memory_stats(self.index)

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.index)

    def peaks(self) -> dict[str, int | None]:
        cuda = self._torch.cuda
        reserved = cuda.max_memory_reserved(self.index)
        return {
            "peak_memory_bytes": cuda.max_memory_allocated(self.index),
            "peak_reserved_bytes": reserved,
            "budget_used_bytes": reserved,
        }

    def info(self) -> DeviceInfo:
        torch = self._torch
        props = torch.cuda.get_device_properties(self.index)
        return DeviceInfo(
            backend="cuda", name=props.name, index=self.index, total_memory_bytes=props.total_memory,
            uuid=device_uuid(self.index), driver_version=nvml_driver_version(), cuda_version=torch.version.cuda,
            torch_version=torch.__version__, num_cpus=os.cpu_count() or 1,
        )


def device_uuid(index: int) -> str | None:
    """The UUID of CUDA device `index` as NVML spells it ("GPU-..."), or None where torch does not say.

    CUDA's device order is not NVML's, and CUDA_VISIBLE_DEVICES renumbers devices; the UUID is what both
    agree on."""
    import torch

    raw = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if not raw:
        return None
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"


def nvml_driver_version() -> str | None:
    """The NVIDIA driver version via NVML, or None where NVML is missing or refuses."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else str(version)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML absent, no driver, container restrictions: report unknown
        return None
