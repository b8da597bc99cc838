"""The machine's state judged: a GPU that throttles fails a check of its own, and what differs from the
baseline's state is named (clocks, clock-event reasons, temperature, power limit, ECC, PCIe link, CPU
frequency and steal, versions). Pure: MachineState records in, checks out.
"""

from __future__ import annotations

from mbtune.device.machine_state import THROTTLING
from mbtune.qualifying.records import FAIL, INCONCLUSIVE, PASS, Check
from mbtune.records import GpuState, MachineState

THROTTLED_SHARE = 0.10  # a throttling reason active in this share of the samples fails the check
CLOCK_DIFFERENCE = 0.05  # clocks and CPU frequency this far apart are named
STEAL_PCT = 5.0  # steal time above this is named
THROTTLE_CHECK = "GPU throttling"
STATE_CHECK = "machine state against the baseline"


def throttle_check(now: MachineState | None) -> Check | None:
    """FAIL where a GPU ran throttled by heat or its supply in THROTTLED_SHARE of the samples or more (the
    reasons and shares named), PASS where GPUs were sampled and none was; None without GPU state."""
    if now is None or not now.gpus:
        return None
    found = [f"{_gpu(gpu, i)}: {reason} active in {share:.0%} of samples"
             for i, gpu in enumerate(now.gpus) for reason, share in sorted(gpu.throttle_shares.items())
             if reason in THROTTLING and share >= THROTTLED_SHARE]
    if found:
        return Check(name=THROTTLE_CHECK, status=FAIL, rule=f"no thermal or hardware slowdown in {THROTTLED_SHARE:.0%} "
                                                           "of samples", detail="; ".join(found))
    return Check(name=THROTTLE_CHECK, status=PASS, rule="no thermal or hardware slowdown",
                 detail=f"{len(now.gpus)} GPU(s), {now.gpus[0].num_samples} samples each")


def state_check(baseline: MachineState | None, now: MachineState | None) -> Check | None:
    """Shown, not gating, where there is a baseline: PASS where nothing named differs from its state,
    INCONCLUSIVE with the differences otherwise (a reason a figure may have moved); None where this run has
    no state."""
    if now is None:
        return None
    if baseline is None:
        return Check(name=STATE_CHECK, status=PASS, gating=False, detail="the baseline recorded no state; now: "
                     + "; ".join(describe(now)))
    differs = differences(baseline, now)
    return Check(name=STATE_CHECK, status=INCONCLUSIVE if differs else PASS, gating=False,
                 detail="; ".join(differs) if differs else "no difference named")


def differences(was: MachineState, now: MachineState) -> list[str]:
    """What differs between two states, in words: "SM clock 1,410 vs 1,980 MHz" (now vs the baseline)."""
    out = [f"{name} {now.versions.get(name) or 'none'} vs {was.versions.get(name) or 'none'}"
           for name in ("driver", "cuda", "torch", "mbtune")
           if name in was.versions and now.versions.get(name) != was.versions.get(name)]
    if _apart(now.cpu_mhz_median, was.cpu_mhz_median):
        out.append(f"CPU frequency {now.cpu_mhz_median:,.0f} vs {was.cpu_mhz_median:,.0f} MHz")
    if now.steal_pct is not None and now.steal_pct > STEAL_PCT:
        out.append(f"steal time {now.steal_pct:.1f}% (a neighbouring virtual machine took the CPUs)")
    for i, gpu in enumerate(now.gpus):
        before = next((g for g in was.gpus if g.uuid == gpu.uuid), was.gpus[i] if i < len(was.gpus) else None)
        out += [f"{_gpu(gpu, i)}: {words}" for words in _gpu_differences(before, gpu)]
    return out


def describe(state: MachineState) -> list[str]:
    """The state in a few words, for a run with nothing to compare it to."""
    words = []
    if state.load_avg_1m_median is not None:
        words.append(f"load {state.load_avg_1m_median:.2f}")
    if state.steal_pct is not None:
        words.append(f"steal {state.steal_pct:.1f}%")
    if state.cpu_mhz_median is not None:
        words.append(f"CPU {state.cpu_mhz_median:,.0f} MHz")
    for i, gpu in enumerate(state.gpus):
        clock = f"SM clock {gpu.sm_clock_mhz_median:,.0f} MHz" if gpu.sm_clock_mhz_median else "SM clock unknown"
        words.append(f"{_gpu(gpu, i)}: {clock}")
    return words


def _gpu_differences(was: GpuState | None, now: GpuState) -> list[str]:
    out = []
    if was is not None and _apart(now.sm_clock_mhz_median, was.sm_clock_mhz_median):
        out.append(f"SM clock {now.sm_clock_mhz_median:,.0f} vs {was.sm_clock_mhz_median:,.0f} MHz")
    if was is not None and _apart(now.memory_clock_mhz_median, was.memory_clock_mhz_median):
        out.append(f"memory clock {now.memory_clock_mhz_median:,.0f} vs {was.memory_clock_mhz_median:,.0f} MHz")
    for reason, share in sorted(now.throttle_shares.items()):
        before = was.throttle_shares.get(reason, 0.0) if was is not None else 0.0
        if reason != "idle" and share >= THROTTLED_SHARE and share - before >= THROTTLED_SHARE:
            out.append(f"{reason} active in {share:.0%} of samples (baseline {before:.0%})")
    if was is not None and now.power_limit_w and was.power_limit_w and now.power_limit_w != was.power_limit_w:
        out.append(f"power limit {now.power_limit_w:,.0f} vs {was.power_limit_w:,.0f} W")
    if now.ecc_uncorrected:
        out.append(f"{now.ecc_uncorrected} uncorrected ECC error(s)")
    if was is not None and (now.pcie_generation, now.pcie_width) != (was.pcie_generation, was.pcie_width) \
            and now.pcie_generation is not None:
        out.append(f"PCIe gen {now.pcie_generation} x{now.pcie_width} vs gen {was.pcie_generation} x{was.pcie_width}")
    if was is not None and now.temperature_c_max is not None and was.temperature_c_max is not None \
            and now.temperature_c_max - was.temperature_c_max >= 10:
        out.append(f"temperature up to {now.temperature_c_max:.0f} vs {was.temperature_c_max:.0f} C")
    return out


def _apart(now: float | None, was: float | None) -> bool:
    return bool(now and was and abs(now / was - 1) > CLOCK_DIFFERENCE)


def _gpu(gpu: GpuState, index: int) -> str:
    return f"GPU {index} ({gpu.name})" if gpu.name else f"GPU {index}"
