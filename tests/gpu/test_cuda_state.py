"""The machine state a qualification records, read through this machine's real NVML (marked gpu; skipped with
a reason where no CUDA device is visible)."""

from __future__ import annotations

import time

import pytest

from mbtune.device.machine_state import CLOCK_EVENT_REASONS, StateSampler, run_versions
from mbtune.qualifying.state import THROTTLE_CHECK, state_check, throttle_check

pytestmark = pytest.mark.gpu


def test_every_visible_gpu_reports_clocks_reasons_temperature_power_and_its_link() -> None:
    import torch

    with StateSampler(gpus=True, interval_s=0.1, versions=run_versions()) as sampler:
        x = torch.randn(4096, 4096, device="cuda")
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # a load, so the clocks and power are the working ones
            x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize()
    state = sampler.state()
    assert len(state.gpus) == torch.cuda.device_count()
    assert state.versions["driver"] and state.versions["cuda"] == torch.version.cuda
    for gpu in state.gpus:
        assert gpu.uuid.startswith(("GPU-", "MIG-")) and gpu.num_samples >= 10
        assert gpu.sm_clock_mhz_median and 0 < gpu.sm_clock_mhz_median <= (gpu.sm_clock_mhz_max or 10_000)
        assert gpu.temperature_c_max and 0 < gpu.temperature_c_max < 120
        assert gpu.power_w_median and gpu.power_limit_w and 0 < gpu.power_w_median <= 1.2 * gpu.power_limit_w
        assert gpu.pcie_generation is None or 1 <= gpu.pcie_generation <= (gpu.pcie_max_generation or 6)
        assert set(gpu.throttle_shares) <= set(CLOCK_EVENT_REASONS.values())
        assert all(0 < share <= 1 for share in gpu.throttle_shares.values())
    check = throttle_check(state)
    assert check is not None and check.name == THROTTLE_CHECK and check.status in ("PASS", "FAIL")
    assert state_check(state, state).status == "PASS"  # a state names no difference from itself
