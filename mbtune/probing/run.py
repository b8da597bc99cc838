"""The probe run: the ceiling search wired to real, isolated trials, journaled and saved by a session."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mbtune.device.describe import describe
from mbtune.errors import (
    ConfigError,
)
from mbtune.probing.config import ProbeConfig
from mbtune.probing.records import ProbeResult, RecomputeCeiling, TrialOutcome
from mbtune.probing.trial import run_classified_trial
from mbtune.progress import TrialProgress
from mbtune.records import DeviceInfo
from mbtune.session import PROBE_TRIAL, REPLAYED, RunOutcome, saved_run
from mbtune.settings import TRAIN

if TYPE_CHECKING:
    from mbtune.probing.search import SearchResult
    from mbtune.store import RunStore

log = logging.getLogger(__name__)


# Without a budget on CPU the real ceiling would be the machine's RAM and the kernel's OOM killer; cap
# trials below what is available instead.
DEFAULT_CPU_BUDGET_FRACTION = 0.8


def probe_workload(config: ProbeConfig, progress: TrialProgress | None = None,
                   store: RunStore | None = None, *,
                   on_trial: Callable[[TrialOutcome], None] | None = None) -> ProbeResult:
    """Find the memory ceiling and safe batch of a workload on a device with real, isolated trials.

    With a store, every finished trial is journaled, and trials journaled by an interrupted run are
    replayed in order instead of run again (the search is deterministic given its outcomes). `on_trial`
    sees each outcome as it comes (and may end the probe by raising)."""
    from mbtune.device import resolve_device
    from mbtune.probing.search import search_ceiling
    from mbtune.workloads.facts import workload_facts

    # Bad names and options fail here, before any trial; user code runs in a child under a deadline.
    workload = workload_facts(config.workload, config.workload_options, timeout_s=config.load_timeout_s)
    device = resolve_device(config.device)
    warnings = list(config.warnings())
    budget = _budget(config, device, warnings)
    search_budget = budget if budget is not None else describe(device, config.trial_timeout_s).total_memory_bytes
    trial_config = replace(config, memory_budget_bytes=budget)

    replay = deque(TrialOutcome.from_dict(r) for r in store.replayed(PROBE_TRIAL)) if store else deque()
    recompute = config.recompute[0]

    def run(batch_size: int) -> TrialOutcome:
        if progress:
            progress.start_trial(f"batch {batch_size}" + (f" (recompute {recompute})" if len(config.recompute) > 1
                                                          else ""))
        nonlocal workload
        if replay:
            outcome = replay.popleft()
            if outcome.batch_size != batch_size:
                raise ConfigError(f"the journal does not match this probe (it ran batch {outcome.batch_size} "
                                  f"where this run asks for {batch_size})", hint="Run without --resume.")
            workload = workload.with_counted_flops(outcome.flops_counted, tried=outcome.ok)
            if progress:
                progress.end_trial(outcome.status, REPLAYED)
            if on_trial:
                on_trial(outcome)
            return outcome
        log.debug("probe trial at batch %d on %s", batch_size, device)
        outcome = run_classified_trial(trial_config.trial(batch_size=batch_size, device=device, recompute=recompute,
                                                          count_flops=workload.needs_flops_count
                                                          and config.mode == TRAIN),
                                       config.trial_timeout_s)
        log.info("batch %d: %s in %.1f s", batch_size, outcome.status, outcome.wall_s)
        workload = workload.with_counted_flops(outcome.flops_counted, tried=outcome.ok)
        if store:
            store.record(PROBE_TRIAL, outcome.to_dict())
        if progress:
            progress.end_trial(outcome.status, _trial_detail(outcome))
        if on_trial:
            on_trial(outcome)
        return outcome

    def search() -> SearchResult:
        return search_ceiling(run, granularity=config.granularity, max_batch=config.max_batch,
                              budget_bytes=search_budget, margin=config.margin, confirm=config.confirm,
                              resolution=config.resolution)

    found = search()
    others = []
    for recompute in config.recompute[1:]:  # the run above reads it: one search per mode, in order
        other = search()
        others.append(RecomputeCeiling(
            recompute=recompute, ceiling=other.ceiling, first_failing=other.first_failing,
            safe_batch=other.safe_batch, safe_batch_verified=other.safe_batch_verified, trials=len(other.trials),
            peak_memory_bytes=_peak_at(other.trials, other.ceiling)))
        warnings += [f"recompute {recompute}: {w}" for w in other.warnings]
    warnings += workload.warnings  # with the FLOPs count's, made in the first trial for a user's workload
    return ProbeResult(
        workload=config.workload, workload_options=dict(config.workload_options),
        device=_device_info(found.trials, device, config.trial_timeout_s), trials=found.trials,
        ceiling=found.ceiling, first_failing=found.first_failing, margin=config.margin,
        granularity=config.granularity, safe_batch=found.safe_batch,
        safe_batch_verified=found.safe_batch_verified, memory_budget_bytes=budget,
        memory_model=found.memory_model, precision=config.precision, optimizer=config.optimizer,
        num_parameters=workload.num_parameters, flops_per_sample=workload.flops_per_sample,
        max_batch=config.max_batch, confirm=config.confirm, steps=config.steps, resolution=found.resolution,
        safe_batch_first=found.safe_batch_first, warnings=tuple(warnings) + found.warnings,
        recompute=config.recompute[0], recompute_ceilings=tuple(others), mode=config.mode,
    )


def _peak_at(trials: Sequence[TrialOutcome], batch_size: int) -> int | None:
    """The highest peak memory of the trials that ran at this batch size."""
    peaks = [t.peak_memory_bytes for t in trials if t.ok and t.batch_size == batch_size and t.peak_memory_bytes]
    return max(peaks) if peaks else None


def _budget(config: ProbeConfig, device: str, warnings: list[str]) -> int | None:
    """The trial budget: as given; on CPU without one, a share of the memory available now."""
    from mbtune.device.cpu import available_memory_bytes

    if config.memory_budget_bytes is not None or device != "cpu":
        return config.memory_budget_bytes
    budget = int(available_memory_bytes() * DEFAULT_CPU_BUDGET_FRACTION)
    warnings.append(f"no --memory-budget on CPU: trials are capped at {budget / 2**30:.1f} GiB "
                    f"({DEFAULT_CPU_BUDGET_FRACTION:.0%} of available memory)")
    return budget


def _trial_detail(outcome: TrialOutcome) -> str:
    if outcome.ok and outcome.samples_per_s:
        return f"{outcome.samples_per_s:,.1f} samples/s"
    return (outcome.error.strip().splitlines() or [""])[-1][:80]


def _device_info(trials: tuple[TrialOutcome, ...], device: str, timeout_s: float) -> DeviceInfo:
    for trial in trials:
        if trial.device is not None:
            return trial.device
    return describe(device, timeout_s)


def run_probe(config: ProbeConfig, progress: TrialProgress | None = None, *, profiles_dir: Path | None,
              resume: bool = False) -> RunOutcome:
    """probe_workload, journaled and saved to its profile."""
    return saved_run("probe", {"probe": config}, config.workload, config.device, profiles_dir, resume,
                      config.command_line, lambda store: (probe_workload(config, progress, store), None))
