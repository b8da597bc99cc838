"""Library entry points: each turns a config into a typed record by wiring pure logic to real trials.

The CLI calls exactly one of these per command; tests call them directly.
"""

from __future__ import annotations

from typing import Protocol

from mbtune.config import ProbeConfig
from mbtune.errors import TrialFailedError
from mbtune.records import OK, DeviceInfo, ProbeResult, TrialOutcome

# Without a budget on CPU the real ceiling would be the machine's RAM and the kernel's OOM killer; cap
# trials below what is available instead.
DEFAULT_CPU_BUDGET_FRACTION = 0.8


class TrialProgress(Protocol):
    """What a long job reports while it runs (report/ implements it; None means silent)."""

    def start_trial(self, description: str) -> None: ...

    def end_trial(self, outcome: TrialOutcome) -> None: ...


def probe_workload(config: ProbeConfig, progress: TrialProgress | None = None) -> ProbeResult:
    """Find the memory ceiling and safe batch of a workload on a device with real, isolated trials."""
    from mbtune.device import resolve_device
    from mbtune.device.cpu import available_memory_bytes
    from mbtune.probe import search_ceiling
    from mbtune.workloads import load_workload
    from mbtune.worker import run_trial

    load_workload(config.workload, config.workload_options)  # bad names fail here, before any trial
    device = resolve_device(config.device)
    warnings = list(config.warnings())
    budget = config.memory_budget_bytes
    if budget is None and device == "cpu":
        budget = int(available_memory_bytes() * DEFAULT_CPU_BUDGET_FRACTION)
        warnings.append(f"no --memory-budget on CPU: trials are capped at {budget / 2**30:.1f} GiB "
                        f"({DEFAULT_CPU_BUDGET_FRACTION:.0%} of available memory)")
    search_budget = budget if budget is not None else _device_total_bytes(device, config.trial_timeout_s)
    trial_config = config if budget == config.memory_budget_bytes else _with_budget(config, budget)

    def run(batch_size: int) -> TrialOutcome:
        if progress:
            progress.start_trial(f"batch {batch_size}")
        outcome = run_trial(trial_config.trial(batch_size=batch_size, device=device),
                            timeout_s=config.trial_timeout_s)
        if progress:
            progress.end_trial(outcome)
        return outcome

    found = search_ceiling(run, granularity=config.granularity, max_batch=config.max_batch,
                           budget_bytes=search_budget, margin=config.margin, confirm=config.confirm)
    return ProbeResult(
        workload=config.workload, workload_options=dict(config.workload_options),
        device=_device_info(found.trials, device, config.trial_timeout_s), trials=found.trials,
        ceiling=found.ceiling, first_failing=found.first_failing, margin=config.margin,
        granularity=config.granularity, safe_batch=found.safe_batch,
        safe_batch_verified=found.safe_batch_verified, memory_budget_bytes=budget,
        memory_model=found.memory_model, precision=config.precision, optimizer=config.optimizer,
        warnings=tuple(warnings) + found.warnings,
    )


def _with_budget(config: ProbeConfig, budget: int | None) -> ProbeConfig:
    from dataclasses import replace

    return replace(config, memory_budget_bytes=budget)


def _device_info(trials: tuple[TrialOutcome, ...], device: str, timeout_s: float) -> DeviceInfo:
    for trial in trials:
        if trial.device is not None:
            return trial.device
    return describe(device, timeout_s)


def describe(device: str, timeout_s: float = 120.0) -> DeviceInfo:
    """DeviceInfo read in a fresh process, so this process never initialises a device."""
    from mbtune.trial import describe_device
    from mbtune.worker import run_isolated

    result = run_isolated(describe_device, device, timeout_s=timeout_s)
    if result.status != OK:
        raise TrialFailedError(f"could not read the facts of device {device}: {result.error}")
    return result.value


def _device_total_bytes(device: str, timeout_s: float) -> int:
    return describe(device, timeout_s).total_memory_bytes
