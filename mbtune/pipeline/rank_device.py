"""A rank's device: which one it runs on, its threads, its timing events, its UUID and its peak memory."""

from __future__ import annotations

import os

import torch

from mbtune.device.tensor_bytes import TensorBytes
from mbtune.errors import DeviceError
from mbtune.pipeline.point_spec import PipelineSpec


def own_cores(index: int, count: int, allowed: set[int] | None = None) -> tuple[int, ...]:
    """The cores process `index` of `count` on this host is pinned to: the allowed cores (this process's
    affinity) in order, split into `count` equal runs, the remainder left idle; () where there are fewer
    cores than processes (they would share; nothing is pinned)."""
    cores = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    share = len(cores) // count if count >= 1 else 0
    if share == 0 or not 0 <= index < count:
        return ()
    return tuple(cores[index * share:(index + 1) * share])


def pin_to_cores(index: int, count: int) -> tuple[int, ...]:
    """Pin this process to its own cores (own_cores) and return them; () where it was not pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return ()
    cores = own_cores(index, count)
    if cores:
        os.sched_setaffinity(0, cores)
    return cores


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


def count_memory(device: torch.device) -> TensorBytes | None:
    """On the CPU, start counting this rank's live tensor bytes, as a probe trial's budget counts them
    (None on CUDA, whose allocator keeps its own peak)."""
    if device.type == "cuda":
        return None
    count = TensorBytes()
    count.__enter__()
    return count


def stop_counting(count: TensorBytes | None) -> None:
    """Stop counting (the peak stays): the timed steps after it run without the count's per-operator cost."""
    if count is not None and count.counting:
        count.__exit__(None, None, None)


def peak_memory(device: torch.device, count: TensorBytes | None) -> tuple[int | None, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    return (count.peak_bytes if count is not None else None), "cpu_tensor_bytes"
