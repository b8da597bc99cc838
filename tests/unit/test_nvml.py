"""The NVML sampler against a fake NVML (pure logic) and against this machine's real one."""

from __future__ import annotations

import time
from types import SimpleNamespace

from mbtune.device.nvml import NvmlSampler, sample_for


class FakeNvml:
    NVML_CLOCK_SM = 1

    def __init__(self, *, refuse_power: bool = False, fail_init: bool = False) -> None:
        self.refuse_power, self.fail_init = refuse_power, fail_init
        self.shutdown = False

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

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
    import pytest

    from mbtune.errors import Interrupted

    class CtrlCDuringInit(FakeNvml):
        def nvmlInit(self):
            raise Interrupted("interrupted")

    with pytest.raises(Interrupted):
        with NvmlSampler(nvml=CtrlCDuringInit()):
            pass
    assert not issubclass(Interrupted, Exception)
