"""The NVML sampler against a fake NVML (pure logic) and against this machine's real one."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from mbtune.device.nvml import NvmlSampler, cuda_visible_uuids, sample_for, samples_in_window


class FakeNvml:
    NVML_CLOCK_SM = 1

    def __init__(self, *, refuse_power: bool = False, fail_init: bool = False,
                 processes: dict[int, list[int]] | None = None) -> None:
        self.refuse_power, self.fail_init = refuse_power, fail_init
        self.processes = processes  # per handle, the pids computing there; None: refused
        self.shutdown = False
        self.initialised = False

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")
        self.initialised = True

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        if self.processes is None:
            raise RuntimeError("Not Supported")
        return [SimpleNamespace(pid=pid, usedGpuMemory=2**30) for pid in self.processes.get(handle, [])]

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUUID(self, handle):
        return f"GPU-{handle}".encode()

    def nvmlDeviceGetName(self, handle):
        return "Fake H200"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=40 + 10 * handle)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=2**30 * (handle + 1))

    def nvmlDeviceGetPowerUsage(self, handle):
        if self.refuse_power:
            raise RuntimeError("Not Supported")  # as MIG devices answer
        return 300_000

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return 1980


def test_samples_only_the_gpus_asked_for_by_uuid():
    nvml = FakeNvml()
    with NvmlSampler(["GPU-1"], interval_s=0.01, nvml=nvml) as sampler:
        time.sleep(0.1)
    summary = sampler.summary()
    assert summary.available and nvml.shutdown
    [gpu] = summary.gpus
    assert gpu.uuid == "GPU-1" and gpu.num_samples >= 2
    assert gpu.kernel_active_pct_median == 50 and gpu.memory_used_bytes_max == 2 * 2**30
    assert gpu.power_w_median == 300.0 and gpu.sm_clock_mhz_median == 1980


def test_refused_queries_become_none_not_failures():
    with NvmlSampler(interval_s=0.01, nvml=FakeNvml(refuse_power=True)) as sampler:
        time.sleep(0.05)
    summary = sampler.summary()
    assert summary.available and len(summary.gpus) == 2
    assert all(gpu.power_w_median is None and gpu.kernel_active_pct_median is not None for gpu in summary.gpus)


def test_missing_nvml_is_reported_not_raised():
    with NvmlSampler(nvml=FakeNvml(fail_init=True)) as sampler:
        pass
    summary = sampler.summary()
    assert not summary.available and "NVML Shared Library Not Found" in summary.reason


def test_real_nvml_on_this_machine_never_raises():
    summary = sample_for(0.2)
    assert summary.available or summary.reason.startswith("NVML")


def test_ctrl_c_while_nvml_is_probed_is_not_taken_for_a_missing_driver():
    """Ctrl-C raises Interrupted wherever the main thread is; NVML's probe turns any Exception into
    "unavailable", so Interrupted must not be one."""
    from mbtune.errors import Interrupted

    class CtrlCDuringInit(FakeNvml):
        def nvmlInit(self):
            raise Interrupted("interrupted")

    with pytest.raises(Interrupted):
        with NvmlSampler(nvml=CtrlCDuringInit()):
            pass
    assert not issubclass(Interrupted, Exception)


# --- only the point's GPUs, only the measured steps --------------------------------------------------------------

NVML_ORDER = ["GPU-aaaa-0", "GPU-bbbb-1", "GPU-cccc-2"]


@pytest.mark.parametrize(("visible", "expected"), [
    (None, NVML_ORDER),
    ("2,0", ["GPU-cccc-2", "GPU-aaaa-0"]),
    ("GPU-bbbb-1", ["GPU-bbbb-1"]),
    ("cccc, 1", ["GPU-cccc-2", "GPU-bbbb-1"]),  # a unique prefix, "GPU-" optional, spaces tolerated
    ("1,7,0", ["GPU-bbbb-1"]),  # as CUDA does: the list ends at the first entry that names no device
    ("0,-1,2", ["GPU-aaaa-0"]),
    ("GPU-", []),  # a prefix of every device names none
    ("", []),
])
def test_cuda_device_numbers_map_to_nvml_uuids_through_cuda_visible_devices(visible, expected):
    assert cuda_visible_uuids(NVML_ORDER, visible) == expected


def test_only_samples_inside_the_measured_window_count():
    samples = [(t, 10.0 * t, None, None, None) for t in (99.9, 100.0, 100.5, 101.0, 101.1)]
    assert [s[0] for s in samples_in_window(samples, (100.0, 101.0))] == [100.0, 100.5, 101.0]
    assert samples_in_window(samples, (200.0, 300.0)) == []
    assert samples_in_window(samples, None) == samples


def test_cuda_indices_sample_the_gpu_cuda_numbers_that_way():
    nvml = FakeNvml()
    with NvmlSampler(cuda_indices=[0], interval_s=0.01, nvml=nvml, visible_devices="1") as sampler:
        time.sleep(0.05)
    [gpu] = sampler.summary().gpus
    assert gpu.uuid == "GPU-1"


def test_a_point_without_gpus_samples_nothing():
    nvml = FakeNvml()
    with NvmlSampler(cuda_indices=(), nvml=nvml) as sampler:
        pass
    summary = sampler.summary()
    assert not summary.available and summary.reason == "the point used no GPU"
    assert not nvml.initialised and sampler.compute_pids() is None


def test_summary_keeps_the_ranks_gpus_and_the_window_only():
    with NvmlSampler(interval_s=0.01, nvml=FakeNvml()) as sampler:
        time.sleep(0.05)
    now = time.time()
    [gpu] = sampler.summary(["GPU-0"], (now - 3600, now + 3600)).gpus
    assert gpu.uuid == "GPU-0" and gpu.num_samples >= 2 and gpu.kernel_active_pct_median == 40
    [before] = sampler.summary(["GPU-0"], (0.0, 1.0)).gpus  # a window before any sample
    assert before.num_samples == 0 and before.kernel_active_pct_median is None
    missing = sampler.summary(["GPU-9"])
    assert not missing.available and "GPU-9" in missing.reason


def test_compute_pids_per_gpu_and_none_where_nvml_refuses():
    with NvmlSampler(interval_s=0.01, nvml=FakeNvml(processes={0: [11, 12], 1: [13]})) as sampler:
        time.sleep(0.05)
    assert sampler.compute_pids(["GPU-0"]) == {11, 12}
    assert sampler.compute_pids() == {11, 12, 13}
    assert sampler.compute_pids(["GPU-0"], (0.0, 1.0)) is None  # nothing sampled in that window: unknown
    with NvmlSampler(interval_s=0.01, nvml=FakeNvml()) as refused:
        time.sleep(0.03)
    assert refused.compute_pids() is None
