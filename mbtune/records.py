"""Typed, frozen result records: the handshake between modules. No torch import here."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mbtune.recordio import (  # noqa: F401 - the loader's names are part of this module's interface
    MAX_DEPTH,
    Record,
    RecordFieldError,
    load_value,
    short_repr,
    shorten,
)

OK, OOM, ERROR, TIMEOUT, KILLED = "ok", "oom", "error", "timeout", "killed"
NONFINITE = "nonfinite"  # the loss was NaN or infinite: the run stopped at that step
STATUSES = (OK, OOM, ERROR, TIMEOUT, KILLED, NONFINITE)

# Whose fault a failed trial or point is (error_kind): the workload's (it ran and failed: an error, OOM, a
# non-finite loss, a hang, a kill), or the harness's (the process died before it ran the trial, e.g. a main
# script without a main guard). Empty when it did not fail.
WORKLOAD_FAULT, HARNESS_FAULT = "workload", "harness"
ERROR_KINDS = ("", WORKLOAD_FAULT, HARNESS_FAULT)
ERROR_TAIL_LINES = 20  # how much of a failure's traceback and stderr a record keeps


class Outcome(Record):
    """How a run of something ended (a probe's trial, a sweep's point): its status and, when it failed, whose
    fault. The choices are read when a file is loaded, not when this module is imported."""

    __repr__ = Record.__repr__  # short: the dataclass one prints every trial and action

    @classmethod
    def field_choices(cls, name: str) -> tuple[str, ...] | None:
        return {"status": STATUSES, "error_kind": ERROR_KINDS}.get(name)


@dataclass(frozen=True, kw_only=True)
class DeviceInfo(Record):
    """What a trial ran on, as reported from inside a trial process."""

    backend: str
    name: str
    index: int | None = None
    total_memory_bytes: int = 0
    uuid: str | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    torch_version: str = ""
    num_cpus: int = 0

    @property
    def label(self) -> str:
        return f"{self.backend}:{self.index}" if self.index is not None else self.backend


@dataclass(frozen=True, kw_only=True)
class GpuUsage(Record):
    """What NVML saw on one GPU while a trial ran. kernel_active_pct is NVML's "utilization": the share of
    time any kernel was running, not SM occupancy."""

    uuid: str
    name: str
    num_samples: int
    kernel_active_pct_median: float | None = None
    kernel_active_pct_max: float | None = None
    memory_used_bytes_max: int | None = None
    power_w_median: float | None = None
    sm_clock_mhz_median: float | None = None


@dataclass(frozen=True, kw_only=True)
class IdleShares(Record):
    """The measured bubble split by what each idle moment on a rank was waiting for, as shares of
    ranks x pipeline time (they add up to the measured bubble)."""

    schedule: float  # an input not yet computed upstream, or nothing left this step: fill, drain, imbalance
    transfer: float  # an input already computed on another rank but not yet here: communication
    overhead: float  # no input to wait for: the rank's own time between actions (Python, posting sends)


@dataclass(frozen=True, kw_only=True)
class MachineLoad(Record):
    """How busy the machine was with work other than the point's own while the point ran."""

    load_avg_1m: float | None = None  # os.getloadavg() at the end of the point
    other_cpu_share: float | None = None  # CPU time other processes took, as a share of all cores x wall time
    num_cpus: int = 0
    other_gpu_processes: tuple[str, ...] = ()  # NVML: processes on the point's GPUs that are not the point's
    busy: bool = False
    reason: str = ""  # why it counts as busy


@dataclass(frozen=True, kw_only=True)
class GpuState(Record):
    """One GPU's state over a run, from NVML: clocks, the clock-event (throttle) reasons and the share of
    samples each was active in, temperature, power, ECC error counts and the PCIe link."""

    uuid: str
    name: str = ""
    num_samples: int = 0
    sm_clock_mhz_median: float | None = None
    sm_clock_mhz_max: float | None = None  # the highest SM clock the GPU can run at
    memory_clock_mhz_median: float | None = None
    throttle_shares: dict[str, float] = field(default_factory=dict)  # reason -> share of samples it was active
    temperature_c_max: float | None = None
    power_w_median: float | None = None
    power_limit_w: float | None = None
    ecc_corrected: int | None = None  # volatile counts, since the driver last loaded
    ecc_uncorrected: int | None = None
    pcie_generation: int | None = None
    pcie_width: int | None = None
    pcie_max_generation: int | None = None
    pcie_max_width: int | None = None


@dataclass(frozen=True, kw_only=True)
class MachineState(Record):
    """The state a measurement ran in: the CPUs' load, steal time and frequency where the kernel gives them,
    each GPU's NVML state, and the versions of what ran it."""

    num_samples: int = 0
    load_avg_1m_median: float | None = None
    steal_pct: float | None = None  # CPU time a neighbouring virtual machine took, share of all CPU time
    cpu_mhz_median: float | None = None
    gpus: tuple[GpuState, ...] = ()
    versions: dict[str, str] = field(default_factory=dict)  # mbtune, torch, cuda, driver where known


@dataclass(frozen=True, kw_only=True)
class NvmlSummary(Record):
    """NVML samples of the GPUs a trial used, or why there are none ("n/a" in reports)."""

    available: bool
    reason: str = ""
    gpus: tuple[GpuUsage, ...] = ()


# Activation recompute per block (workloads/recompute.py): none keeps every activation, full keeps each
# block's input and runs its forward again in the backward.
RECOMPUTE_MODES = ("none", "full")


@dataclass(frozen=True, kw_only=True)
class TimelineAction(Record):
    """One compute action of a measured step: rank, stage, kind, micro-batch, start and end (s)."""

    rank: int
    stage: int
    kind: str  # forward | backward | backward_input | backward_weight
    microbatch: int
    accum: int
    start_s: float
    end_s: float


def pct(share: float | None) -> float | None:
    """A share (0-1) as a percentage (0-100)."""
    return None if share is None else 100.0 * share


def frame(rows: Iterable[dict[str, Any]]) -> Any:
    """The rows as a pandas DataFrame whose columns of numbers and Nones are float (None: NaN).

    Each record's `to_frame()` hands its rows here: one row per item of the record (a probe's trials, a
    sweep's points ranked as its table ranks them, a serve run's loads, a plan's predictions, ranked); plain
    columns with the unit in the name (`_s`, `_bytes`, `_per_s`, `_pct`); every share as a percentage, 0-100,
    named `_pct`; a per-stage list as one column per stage (`peak_memory_bytes_stage0`, ...); a figure that
    was not measured is NaN in a float column, never None in an object column. pandas is imported here only.
    """
    import pandas as pd

    out = pd.DataFrame(list(rows))
    for column in out.columns:
        if out[column].dtype != object:
            continue
        values = [v for v in out[column] if v is not None]
        if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
            out[column] = out[column].astype(float)
    return out


@dataclass(frozen=True, kw_only=True)
class Decision(Record):
    """How decided an answer is: `decided` (every other candidate told apart from the best), `equivalent` (the
    rest shown equal to it within the declared size) or `not decided` (sweeping/equivalence.py for a sweep's
    rows, serving/answers.py for serve's configurations)."""

    state: str
    size: float  # the declared size: a difference in throughput within it is equal
    group: tuple[int, ...] = ()  # shown equal to the best, cheapest first (indices: a sweep's results, serve's answers)
    open: tuple[int, ...] = ()  # not decided: neither told apart from the best nor shown equal to it
    more_repeats: int | None = None  # not decided: about how many more repeats each of those (and the best) needs
    more_time_s: float | None = None  # and about how long they would take, at each point's pace so far
    why: str = ""  # not decided: what stopped the measuring first
