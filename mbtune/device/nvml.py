"""NVML sampler: a background thread in the parent reads utilisation, memory, power and clocks a few
times a second while trials run, and degrades to "n/a" where NVML is absent or refuses (MIG, containers).

NVML's utilisation is the share of the sample period in which any kernel was running on the GPU, not SM
occupancy; records and reports label it so. NVML's device order is not CUDA's, so devices are matched
by UUID.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from mbtune.records import GpuUsage, NvmlSummary

DEFAULT_INTERVAL_S = 0.25


def _load_pynvml() -> Any:
    import pynvml

    return pynvml


class NvmlSampler:
    """Context manager: samples the GPUs with the given UUIDs (or all) until it exits; `summary()` after."""

    def __init__(self, uuids: Sequence[str] | None = None, *, interval_s: float = DEFAULT_INTERVAL_S,
                 nvml: Any = None) -> None:
        self._uuids = list(uuids) if uuids else None
        self._interval_s = interval_s
        self._nvml = nvml
        self._handles: list[tuple[str, str, Any]] = []  # (uuid, name, handle)
        self._samples: dict[str, list[tuple[float | None, ...]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unavailable = ""

    def __enter__(self) -> NvmlSampler:
        try:
            self._nvml = self._nvml or _load_pynvml()
            self._nvml.nvmlInit()
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
        if self._nvml is not None and not self._unavailable:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def _select_handles(self) -> list[tuple[str, str, Any]]:
        nvml = self._nvml
        chosen = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            if self._uuids is None or uuid in self._uuids:
                chosen.append((uuid, _text(nvml.nvmlDeviceGetName(handle)), handle))
        return chosen

    def _run(self) -> None:
        while not self._stop.is_set():
            for uuid, _, handle in self._handles:
                self._samples.setdefault(uuid, []).append(self._read(handle))
            self._stop.wait(self._interval_s)

    def _read(self, handle: Any) -> tuple[float | None, ...]:
        nvml = self._nvml
        return (
            _try(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            _try(lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used),
            _try(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            _try(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        )

    def summary(self) -> NvmlSummary:
        """Per-GPU medians and maxima of what was sampled, or why nothing was."""
        if self._unavailable:
            return NvmlSummary(available=False, reason=self._unavailable)
        gpus = []
        for uuid, name, _ in self._handles:
            rows = self._samples.get(uuid, [])
            columns = list(zip(*rows)) if rows else [(), (), (), ()]
            util, memory, power, clock = ([v for v in column if v is not None] for column in columns)
            gpus.append(GpuUsage(
                uuid=uuid, name=name, num_samples=len(rows),
                kernel_active_pct_median=_median(util), kernel_active_pct_max=max(util, default=None),
                memory_used_bytes_max=int(max(memory)) if memory else None,
                power_w_median=_median(power), sm_clock_mhz_median=_median(clock),
            ))
        return NvmlSummary(available=True, gpus=tuple(gpus))


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
