"""The state a measurement ran in, sampled from the parent while it runs: on the CPU the load average, the
steal time (a neighbouring virtual machine's share of our CPUs) and the clock frequency, where the kernel
gives them; on CUDA, through NVML, each visible GPU's SM and memory clocks, its clock-event (throttle)
reasons, temperature, power draw and limit, ECC error counts and PCIe link. A figure the machine cannot
give is None; NVML's absence or refusal leaves the GPU list empty, never an error.

Pure helpers (`throttle_names`, `median`, the /proc parsers) are unit-tested on known values; `StateSampler`
takes an injected NVML module, so a fake one tests it on the CPU.
"""

from __future__ import annotations

import glob
import os
import statistics
import threading
from collections.abc import Callable, Sequence
from typing import Any

from mbtune.device.machine_load import PROC, parse_proc_stat
from mbtune.records import GpuState, MachineState

DEFAULT_INTERVAL_S = 1.0

# NVML's clock-event reasons (nvmlClocksEventReason*, formerly nvmlClocksThrottleReason*), bit by bit.
CLOCK_EVENT_REASONS = {
    0x1: "idle",
    0x2: "application clocks setting",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}
# The reasons that mean a GPU is throttled by its condition (heat, a failing supply) rather than by how it
# is set up or loaded: a qualification fails on these. The power cap is the GPU working at its limit as
# designed under a heavy load, and is named, not failed.
THROTTLING = ("hardware slowdown", "software thermal slowdown", "hardware thermal slowdown", "hardware power brake")


def throttle_names(mask: int) -> tuple[str, ...]:
    """The clock-event reasons set in an NVML bit mask, in bit order (an unknown bit is named by its value)."""
    names = []
    bit = 1
    while bit <= mask:
        if mask & bit:
            names.append(CLOCK_EVENT_REASONS.get(bit, f"reason 0x{bit:x}"))
        bit <<= 1
    return tuple(names)


def median(values: Sequence[float | None]) -> float | None:
    """The median of the known values, None when there are none."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def cpu_mhz(sys_root: str = "/sys", proc: str = PROC) -> float | None:
    """The mean current frequency of the CPUs in MHz: cpufreq's scaling_cur_freq where the kernel has it,
    else /proc/cpuinfo's "cpu MHz" lines (a virtual machine often has neither that moves)."""
    values = []
    for path in glob.glob(os.path.join(sys_root, "devices/system/cpu/cpu[0-9]*/cpufreq/scaling_cur_freq")):
        text = _read(path)
        if text and text.strip().isdigit():
            values.append(int(text) / 1000.0)
    if not values:
        for line in (_read(os.path.join(proc, "cpuinfo")) or "").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "cpu MHz":
                try:
                    values.append(float(value))
                except ValueError:
                    continue
    return statistics.fmean(values) if values else None


def steal_ticks(proc_stat: str) -> tuple[int, int] | None:
    """(steal, total) clock ticks of a /proc/stat text's aggregate line, or None."""
    ticks = parse_proc_stat(proc_stat)
    for line in proc_stat.splitlines():
        fields = line.split()
        if ticks is not None and fields and fields[0] == "cpu" and len(fields) > 8:
            return int(fields[8]), ticks.total
    return None


def steal_pct(first: tuple[int, int] | None, last: tuple[int, int] | None) -> float | None:
    """The steal time between two (steal, total) readings, as a percentage of all CPU time."""
    if first is None or last is None or last[1] <= first[1]:
        return None
    return 100.0 * (last[0] - first[0]) / (last[1] - first[1])


def run_versions() -> dict[str, str]:
    """The versions a run records: mbtune's, torch's and the CUDA torch was built with (NVML adds the
    driver's)."""
    import torch

    from mbtune.version import __version__

    return {"mbtune": __version__, "torch": torch.__version__, "cuda": torch.version.cuda or ""}


class StateSampler:
    """Context manager: samples the machine's state every `interval_s` until it exits; `state()` after.

    `gpus`: sample the visible GPUs through NVML (`nvml`: a module with pynvml's interface; pynvml itself by
    default). `versions`: recorded as they are (mbtune, torch, CUDA, the driver's is added from NVML)."""

    def __init__(self, *, gpus: bool, versions: dict[str, str] | None = None, nvml: Any = None,
                 interval_s: float = DEFAULT_INTERVAL_S, proc: str = PROC, sys_root: str = "/sys") -> None:
        self._want_gpus = gpus
        self._nvml = nvml
        self._interval_s = interval_s
        self._proc, self._sys = proc, sys_root
        self._versions = dict(versions or {})
        self._handles: list[tuple[str, str, Any]] = []
        self._gpu_samples: dict[str, list[dict[str, Any]]] = {}
        self._gpu_fixed: dict[str, dict[str, Any]] = {}
        self._loads: list[float | None] = []
        self._mhz: list[float | None] = []
        self._steal: list[tuple[int, int] | None] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._initialised = False

    def __enter__(self) -> StateSampler:
        if self._want_gpus:
            self._open_nvml()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="mbtune-state", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5 * self._interval_s + 1)
        self._sample()
        if self._initialised:
            _try(self._nvml.nvmlShutdown)

    def _open_nvml(self) -> None:
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            nvml = self._nvml
            nvml.nvmlInit()
            self._initialised = True
            from mbtune.device.nvml import cuda_visible_uuids, device_handles

            handles = dict(device_handles(nvml))
            visible = cuda_visible_uuids(list(handles), os.environ.get("CUDA_VISIBLE_DEVICES"))
            self._handles = [(uuid, _text(nvml.nvmlDeviceGetName(handles[uuid])), handles[uuid]) for uuid in visible]
            driver = _try(nvml.nvmlSystemGetDriverVersion)
            if driver is not None:
                self._versions.setdefault("driver", _text(driver))
            for uuid, _, handle in self._handles:
                self._gpu_fixed[uuid] = self._fixed(handle)
        except Exception:  # absent library, no driver, container: no GPU state, the CPU's still stands
            self._handles = []

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> None:
        try:
            self._loads.append(os.getloadavg()[0])
        except (OSError, AttributeError):
            self._loads.append(None)
        self._mhz.append(cpu_mhz(self._sys, self._proc))
        self._steal.append(steal_ticks(_read(os.path.join(self._proc, "stat")) or ""))
        for uuid, _, handle in self._handles:
            self._gpu_samples.setdefault(uuid, []).append(self._gpu_sample(handle))

    def _fixed(self, handle: Any) -> dict[str, Any]:
        """What does not move within a run: the clock it can reach and its power limit."""
        nvml = self._nvml
        return {
            "sm_clock_mhz_max": _try(lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)),
            "power_limit_w": _try(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0),
            "pcie_max_generation": _try(lambda: nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
            "pcie_max_width": _try(lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(handle)),
        }

    def _gpu_sample(self, handle: Any) -> dict[str, Any]:
        nvml = self._nvml
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        return {
            "sm": _try(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
            "mem": _try(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
            "reasons": _try(lambda: reasons(handle)) if reasons else None,
            "temperature": _try(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
            "power": _try(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            "ecc_corrected": _try(lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC)),
            "ecc_uncorrected": _try(lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)),
            "pcie_generation": _try(lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
            "pcie_width": _try(lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(handle)),
        }

    def state(self) -> MachineState:
        """What was sampled, summarised: medians of what moves, the last reading of what counts up."""
        steals = [s for s in self._steal if s is not None]
        return MachineState(
            num_samples=len(self._loads),
            load_avg_1m_median=median(self._loads),
            steal_pct=steal_pct(steals[0], steals[-1]) if len(steals) >= 2 else None,
            cpu_mhz_median=median(self._mhz),
            gpus=tuple(gpu_state(uuid, name, self._gpu_samples.get(uuid, []), self._gpu_fixed.get(uuid, {}))
                       for uuid, name, _ in self._handles),
            versions=self._versions)


def gpu_state(uuid: str, name: str, samples: Sequence[dict[str, Any]], fixed: dict[str, Any]) -> GpuState:
    """One GPU's samples summarised: each throttle reason's share of the samples that read the reasons."""
    masks = [int(s["reasons"]) for s in samples if s.get("reasons") is not None]
    shares: dict[str, float] = {}
    for mask in masks:
        for reason in throttle_names(mask):
            shares[reason] = shares.get(reason, 0.0) + 1.0 / len(masks)
    last = samples[-1] if samples else {}

    def column(key: str) -> list[Any]:
        return [s.get(key) for s in samples]

    return GpuState(
        uuid=uuid, name=name, num_samples=len(samples),
        sm_clock_mhz_median=median(column("sm")), memory_clock_mhz_median=median(column("mem")),
        throttle_shares={k: round(v, 4) for k, v in shares.items()},
        temperature_c_max=max((t for t in column("temperature") if t is not None), default=None),
        power_w_median=median(column("power")),
        ecc_corrected=_int(last.get("ecc_corrected")), ecc_uncorrected=_int(last.get("ecc_uncorrected")),
        pcie_generation=_int(last.get("pcie_generation")), pcie_width=_int(last.get("pcie_width")),
        **{k: (_int(v) if k.startswith("pcie") else v) for k, v in fixed.items()})


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _try(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception:  # a query this GPU or driver refuses (MIG, an old driver, no ECC): unknown
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None
