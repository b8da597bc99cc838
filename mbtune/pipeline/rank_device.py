"""A rank's device: which one it runs on, its threads, its timing events, its UUID and its peak memory."""

from __future__ import annotations

import torch

from mbtune.errors import DeviceError
from mbtune.pipeline.spec import PipelineSpec


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        pass  # already fixed once parallel work has run; intra-op threads are what matter here


def rank_device(spec: PipelineSpec, index: int) -> torch.device:
    """cuda:index on CUDA (index: the rank on one host, LOCAL_RANK under torchrun)."""
    if spec.device == "cpu":
        return torch.device("cpu")
    available = torch.cuda.device_count()
    if index >= available:
        raise DeviceError(f"this rank needs cuda:{index} but {available} CUDA device(s) are visible",
                          hint="Use at most one rank per visible GPU.")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def device_uuid(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    from mbtune.device.cuda import device_uuid

    return device_uuid(device.index)


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    from mbtune.device.cpu import read_status_bytes

    return read_status_bytes("VmHWM").get("VmHWM"), "cpu_vmhwm"
