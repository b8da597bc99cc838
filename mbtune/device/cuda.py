"""CUDA backend: the per-process memory fraction as the budget; caching-allocator peaks."""

from __future__ import annotations

import os
import re

from mbtune.records import DeviceInfo

# The caching allocator reserves more than it hands out (blocks rounded and split): at the ceiling of a
# 406M-parameter GPT on an H200 it held 145.0 GB for 136.5 GB allocated (6.2%), and the next size up, predicted
# at 99.6% of the device, ran out. A predicted ceiling leaves this share of the budget to the allocator.
ALLOCATOR_SLACK = 0.05
# Threads that run matrix products in a training step, each with its own cuBLAS handle and so its own
# workspace: the step's own thread (forward, optimizer) and autograd's thread for the device (backward).
TRAINING_BLAS_THREADS = 2


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

    def limit_memory(self, memory_budget_bytes: int | None) -> None:
        """Lower the allocator's ceiling to the budget; never RLIMIT_AS (CUDA reserves huge virtual ranges)."""
        cuda = self._torch.cuda
        if memory_budget_bytes is not None:
            total = cuda.get_device_properties(self.index).total_memory
            cuda.set_per_process_memory_fraction(min(1.0, memory_budget_bytes / total), self.index)
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


def training_workspace_bytes(device: str) -> int:
    """What a training step on `device` allocates that fake tensors do not see: on CUDA, its cuBLAS
    workspaces (0 on the CPU, or where this process sees no CUDA device)."""
    if not device.startswith("cuda"):
        return 0
    return TRAINING_BLAS_THREADS * cublas_workspace_bytes(int(device.partition(":")[2] or 0))


def cublas_workspace_bytes(index: int = 0) -> int:
    """The bytes of one cuBLAS workspace on CUDA device `index`, as torch sizes it: CUBLAS_WORKSPACE_CONFIG's
    `:SIZE_KIB:COUNT` pairs where set, else torch's default (`:4096:8`, 32 MiB, from compute capability 9,
    `:4096:2:16:8` before). torch takes it from the caching allocator, once per thread and stream that runs
    a matrix product, so it counts in the allocated peak; fake tensors never see it. 0 without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0
    major, _ = torch.cuda.get_device_capability(index)
    return parse_workspace_config(os.environ.get("CUBLAS_WORKSPACE_CONFIG"), major)


def parse_workspace_config(value: str | None, major: int) -> int:
    """CUBLAS_WORKSPACE_CONFIG (`:SIZE_KIB:COUNT`, repeated) in bytes; torch's default for this compute
    capability where unset or unreadable."""
    pairs = re.findall(r":(\d+):(\d+)", value or "")
    if not pairs:
        pairs = [("4096", "8")] if major >= 9 else [("4096", "2"), ("16", "8")]
    return sum(int(size) * int(count) for size, count in pairs) * 1024


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
