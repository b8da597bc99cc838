"""NVML sampler: a background thread in the parent reads utilisation, memory, power, clocks and the compute
processes of the point's GPUs a few times a second while trials run, and degrades to "n/a" where NVML is
absent or refuses (MIG, containers).

NVML's utilisation is the share of the sample period in which any kernel was running on the GPU, not SM
occupancy; records and reports label it so. NVML's device order is not CUDA's, so devices are matched
by UUID, and CUDA device numbers are read through CUDA_VISIBLE_DEVICES. Every sample carries its
time.time(), so a summary can keep only those taken while the measured steps ran.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from mbtune.records import GpuUsage, NvmlSummary

DEFAULT_INTERVAL_S = 0.25

# One sample of one GPU: (time.time(), kernel active %, memory used bytes, power W, SM clock MHz).
Sample = tuple[float, float | None, float | None, float | None, float | None]
Window = tuple[float, float]


def _load_pynvml() -> Any:
    import pynvml

    return pynvml


def cuda_visible_uuids(nvml_uuids: Sequence[str], visible_devices: str | None) -> list[str]:
    """The NVML UUIDs of CUDA devices 0, 1, ... in order, given every GPU's UUID in NVML's order and the
    value of CUDA_VISIBLE_DEVICES (None: unset, every GPU visible).

    As CUDA does, entries are indices or UUIDs (a unique prefix is enough, "GPU-" optional), and the list
    stops at the first entry that names no device. An index is taken as NVML's (PCI bus) order, which is
    CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID or on identical GPUs; the ranks' own UUIDs, where they
    report them, settle the rest.
    """
    if visible_devices is None:
        return list(nvml_uuids)
    chosen: list[str] = []
    for entry in (e.strip() for e in visible_devices.split(",")):
        if entry.lstrip("-").isdigit():
            index = int(entry)
            if not 0 <= index < len(nvml_uuids):
                break
            chosen.append(nvml_uuids[index])
            continue
        wanted = entry if entry.startswith("GPU-") else f"GPU-{entry}"
        matches = [uuid for uuid in nvml_uuids if entry and uuid.startswith(wanted)]
        if len(matches) != 1:
            break
        chosen.append(matches[0])
    return chosen


def device_handles(nvml: Any) -> list[tuple[str, Any]]:
    """Every GPU's (UUID, handle), in NVML's order."""
    devices = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        devices.append((_text(nvml.nvmlDeviceGetUUID(handle)), handle))
    return devices


def samples_in_window(samples: Sequence[Sample], window_unix_s: Window | None) -> list[Sample]:
    """The samples taken inside [start, end] (time.time() seconds); all of them without a window."""
    if window_unix_s is None:
        return list(samples)
    start, end = window_unix_s
    return [s for s in samples if start <= s[0] <= end]


class NvmlSampler:
    """Context manager: samples GPUs until it exits; `summary()` and `compute_pids()` after.

    Which GPUs: those with the given UUIDs, or CUDA devices `cuda_indices` (numbered as CUDA numbers them
    in this process tree, honouring CUDA_VISIBLE_DEVICES), or all of them. An empty `cuda_indices` (a CPU
    point) samples nothing.
    """

    def __init__(self, uuids: Sequence[str] | None = None, *, cuda_indices: Sequence[int] | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S, nvml: Any = None,
                 visible_devices: str | None = None) -> None:
        self._uuids = list(uuids) if uuids else None
        self._cuda_indices = list(cuda_indices) if cuda_indices is not None else None
        self._visible = visible_devices if visible_devices is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
        self._interval_s = interval_s
        self._nvml = nvml
        self._handles: list[tuple[str, str, Any]] = []  # (uuid, name, handle)
        self._samples: dict[str, list[Sample]] = {}
        self._pids: dict[str, list[tuple[float, frozenset[int] | None]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unavailable = ""
        self._initialised = False

    def __enter__(self) -> NvmlSampler:
        if self._cuda_indices is not None and not self._cuda_indices:
            self._unavailable = "the point used no GPU"
            return self
        try:
            self._nvml = self._nvml or _load_pynvml()
            self._nvml.nvmlInit()
            self._initialised = True
            self._handles = self._select_handles()
        except Exception as exc:  # absent library, no driver, container: record why and carry on
            self._unavailable = f"NVML unavailable: {type(exc).__name__}: {exc}".strip()
            return self
        if not self._handles:
            self._unavailable = "NVML found no matching GPU"
            return self
        self._thread = threading.Thread(target=self._run, name="mbtune-nvml", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5 * self._interval_s + 1)
        if self._initialised:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def _select_handles(self) -> list[tuple[str, str, Any]]:
        nvml = self._nvml
        devices = device_handles(nvml)
        if self._cuda_indices is not None:
            by_cuda = cuda_visible_uuids([uuid for uuid, _ in devices], self._visible)
            wanted = {by_cuda[i] for i in self._cuda_indices if 0 <= i < len(by_cuda)}
        else:
            wanted = set(self._uuids) if self._uuids is not None else {uuid for uuid, _ in devices}
        return [(uuid, _text(nvml.nvmlDeviceGetName(handle)), handle) for uuid, handle in devices if uuid in wanted]

    def _run(self) -> None:
        while not self._stop.is_set():
            for uuid, _, handle in self._handles:
                self._samples.setdefault(uuid, []).append(self._read(handle))
                self._pids.setdefault(uuid, []).append((time.time(), self._compute_pids(handle)))
            self._stop.wait(self._interval_s)

    def _read(self, handle: Any) -> Sample:
        nvml = self._nvml
        return (
            time.time(),
            _try(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            _try(lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used),
            _try(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            _try(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        )

    def _compute_pids(self, handle: Any) -> frozenset[int] | None:
        try:
            return frozenset(int(p.pid) for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        except Exception:  # refused (MIG, containers) or absent from this NVML: unknown, not "none"
            return None

    def summary(self, uuids: Sequence[str] | None = None, window_unix_s: Window | None = None) -> NvmlSummary:
        """Per-GPU medians and maxima of what was sampled, or why nothing was: only of the GPUs named by
        `uuids` (the ranks' own) where given, and only of samples inside `window_unix_s` where given."""
        if self._unavailable:
            return NvmlSummary(available=False, reason=self._unavailable)
        handles = [h for h in self._handles if _named(h[0], uuids)]
        if not handles:
            return NvmlSummary(available=False, reason="NVML sampled none of the point's GPUs "
                                                       f"({', '.join(uuids or ())})")
        return NvmlSummary(available=True, gpus=tuple(
            _usage(uuid, name, samples_in_window(self._samples.get(uuid, []), window_unix_s))
            for uuid, name, _ in handles))

    def gpus_running(self, pids: Sequence[int], window_unix_s: Window | None = None) -> list[str]:
        """The sampled GPUs on which NVML saw any of these processes compute (inside the window where given)."""
        return [uuid for uuid, _, _ in self._handles
                if (seen := self.compute_pids([uuid], window_unix_s)) is not None and seen & set(pids)]

    def compute_pids(self, uuids: Sequence[str] | None = None,
                     window_unix_s: Window | None = None) -> frozenset[int] | None:
        """Every pid NVML saw computing on these GPUs (all sampled ones without `uuids`) inside the window;
        None where NVML could not list processes."""
        if self._unavailable:
            return None
        seen: set[int] = set()
        answered = False
        for uuid, _, _ in self._handles:
            if not _named(uuid, uuids):
                continue
            for stamp, pids in self._pids.get(uuid, []):
                if pids is not None and (window_unix_s is None or window_unix_s[0] <= stamp <= window_unix_s[1]):
                    seen |= pids
                    answered = True
        return frozenset(seen) if answered else None


def _usage(uuid: str, name: str, rows: Sequence[Sample]) -> GpuUsage:
    columns = list(zip(*rows)) if rows else [()] * 5
    util, memory, power, clock = ([v for v in column if v is not None] for column in columns[1:])
    return GpuUsage(
        uuid=uuid, name=name, num_samples=len(rows),
        kernel_active_pct_median=_median(util), kernel_active_pct_max=max(util, default=None),
        memory_used_bytes_max=int(max(memory)) if memory else None,
        power_w_median=_median(power), sm_clock_mhz_median=_median(clock),
    )


def _named(uuid: str, uuids: Sequence[str] | None) -> bool:
    """Whether uuid is among uuids (every one is, without any); torch and NVML may differ in case."""
    return not uuids or uuid.lower() in {u.lower() for u in uuids}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(read: Any) -> float | None:
    try:
        return float(read())
    except Exception:  # MIG devices and some containers refuse single queries
        return None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def sample_for(seconds: float, uuids: Sequence[str] | None = None) -> NvmlSummary:
    """Sample for a fixed time (used by tests and diagnostics)."""
    with NvmlSampler(uuids) as sampler:
        time.sleep(seconds)
    return sampler.summary()
