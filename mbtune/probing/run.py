"""The probe run: the ceiling search wired to real, isolated trials, each journaled where a journal is given
(session.run_probe keeps one and saves the result)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from mbtune.device.describe import describe
from mbtune.device.machine_state import StateSampler, run_versions
from mbtune.errors import (
    ConfigError,
)
from mbtune.journal import REPLAYED
from mbtune.probing.config import ProbeConfig
from mbtune.probing.records import CeilingPrediction, ProbeResult, RecomputeCeiling, TrialOutcome
from mbtune.probing.trial import run_classified_trial
from mbtune.progress import TrialProgress
from mbtune.records import ERROR, OK, OOM, DeviceInfo
from mbtune.settings import TRAIN

if TYPE_CHECKING:
    from mbtune.journal import Journal
    from mbtune.probing.confirm import ConfirmResult
    from mbtune.probing.search import SearchResult

log = logging.getLogger(__name__)
PROBE_TRIAL = "probe_trial"  # the journal kind of a probe's trials


# Without a budget on CPU the real ceiling would be the machine's RAM and the kernel's OOM killer; cap
# trials below what is available instead.
DEFAULT_CPU_BUDGET_FRACTION = 0.8


def probe_workload(config: ProbeConfig, progress: TrialProgress | None = None,
                   store: Journal | None = None, *,
                   on_trial: Callable[[TrialOutcome], None] | None = None) -> ProbeResult:
    """Find the memory ceiling and safe batch of a workload on a device with real, isolated trials.

    With a store, every finished trial is journaled, and trials journaled by an interrupted run are
    replayed in order instead of run again (the search is deterministic given its outcomes). `on_trial`
    sees each outcome as it comes (and may end the probe by raising)."""
    from mbtune.device import resolve_device
    from mbtune.workloads.facts import workload_facts

    # Bad names and options fail here, before any trial; user code runs in a child under a deadline (which
    # also counts its FLOPs per sample). A command is the user's own: nothing of it is loaded here.
    workload = (None if config.command else
                workload_facts(config.workload, config.workload_options, timeout_s=config.load_timeout_s))
    device = resolve_device(config.device)
    warnings = list(config.warnings())
    memory_budget_bytes = _memory_budget_bytes(config, device, warnings)
    # What the search fits trials into: the budget, else (on CUDA) the whole device.
    fits_in_bytes = (memory_budget_bytes if memory_budget_bytes is not None
                     else describe(device, config.trial_timeout_s).total_memory_bytes)
    confirm = config.confirm if config.confirm is not None else 1 if device == "cpu" else 2
    config = replace(config, memory_budget_bytes=memory_budget_bytes, confirm=confirm)
    trials = _Trials(config, device, progress, store, on_trial, fits_in_bytes)
    with StateSampler(gpus=device.startswith("cuda"), versions=run_versions()) as sampler:
        predicted = {mode: _predicted(config, device, mode, fits_in_bytes, warnings, progress)
                     for mode in config.recompute}
        found, *others = [trials.search(mode, fits_in_bytes, predicted[mode]) for mode in config.recompute]
    confirmed = (_confirm_safe_batch(config, device, found.safe_batch, fits_in_bytes, progress, warnings)
                 if config.confirm_duration_s is not None else None)
    for mode, other in zip(config.recompute[1:], others):
        warnings += [f"recompute {mode}: {w}" for w in other.warnings]
    return ProbeResult(
        workload=config.workload, workload_options=dict(config.workload_options),
        device=_device_info(found.trials, device, config.trial_timeout_s), trials=found.trials,
        ceiling=found.ceiling, first_failing=found.first_failing, margin=config.margin,
        granularity=config.granularity, safe_batch=found.safe_batch,
        safe_batch_verified=found.safe_batch_verified, memory_budget_bytes=memory_budget_bytes,
        memory_model=found.memory_model, precision=config.precision, optimizer=config.optimizer,
        num_parameters=workload.num_parameters if workload else None,
        flops_per_sample=workload.flops_per_sample if workload else None,
        max_batch=config.max_batch, confirm=confirm, steps=config.steps, resolution=found.resolution,
        safe_batch_first=found.safe_batch_first,
        warnings=(*warnings, *(workload.warnings if workload else ()), *found.warnings),
        recompute=config.recompute[0], mode=config.mode, predicted=predicted[config.recompute[0]],
        command=config.command, steps_from_output=config.steps_from_output,
        recompute_ceilings=tuple(_recompute_ceiling(mode, other) for mode, other in zip(config.recompute[1:], others)),
        machine_state=sampler.state(), confirmed=confirmed,
    )


def _confirm_safe_batch(config: ProbeConfig, device: str, safe_batch: int, budget: int,
                        progress: TrialProgress | None, warnings: list[str]) -> ConfirmResult | None:
    """The command run at the safe batch for --confirm-duration (mbtune confirm --duration), its high-water
    mark compared with the one after the probe's steps; a warning where it did not fit."""
    from mbtune.probing.command import command_at
    from mbtune.probing.confirm import FITS, OUT_OF_MEMORY, ConfirmConfig, confirm_command

    duration = config.confirm_duration_s
    assert duration is not None
    if safe_batch < 1:
        warnings.append("--confirm-duration: no safe batch to confirm")
        return None
    if progress:
        progress.start_trial(f"confirming batch {safe_batch} for {duration:g} s")
    result = confirm_command(ConfirmConfig(command=tuple(command_at(config.command, safe_batch)),
                                           memory_budget_bytes=budget, runs=1, device=device, duration_s=duration),
                             settled_steps=config.steps)
    run = result.runs[0]
    if progress:
        progress.end_trial(OK if run.outcome == FITS else OOM if run.outcome == OUT_OF_MEMORY else ERROR,
                           run.cause or f"peak {(run.peak_bytes or 0) / 2**20:,.1f} MiB")
    if run.outcome != FITS:
        warnings.append(f"the safe batch {safe_batch} did not hold over the --confirm-duration run: {run.outcome} "
                        f"after {run.wall_s:.0f} s ({run.cause})")
    return result


class _Trials:
    """The probe's trials, each run for real in a fresh process (and journaled), or replayed in order from
    an interrupted run's journal."""

    def __init__(self, config: ProbeConfig, device: str, progress: TrialProgress | None, store: Journal | None,
                 on_trial: Callable[[TrialOutcome], None] | None, fits_in_bytes: int) -> None:
        self.config, self.device, self.progress, self.store, self.on_trial = config, device, progress, store, on_trial
        self.fits_in_bytes = fits_in_bytes
        self.replay = deque(TrialOutcome.from_dict(r) for r in store.replayed(PROBE_TRIAL)) if store else deque()

    def search(self, recompute: str, memory_budget_bytes: int | None, predicted: CeilingPrediction | None) -> SearchResult:
        """The ceiling search with this recompute mode, from the predicted ceiling where there is one."""
        from mbtune.probing.search import search_ceiling

        c = self.config
        return search_ceiling(lambda size: self.run(size, recompute), granularity=c.granularity,
                              max_batch=c.max_batch, memory_budget_bytes=memory_budget_bytes, margin=c.margin, confirm=c.confirm or 1,
                              resolution=c.resolution, start=predicted.ceiling if predicted else None,
                              command=c.command)

    def run(self, batch_size: int, recompute: str) -> TrialOutcome:
        if self.progress:
            mode = f" (recompute {recompute})" if len(self.config.recompute) > 1 else ""
            self.progress.start_trial(f"batch {batch_size}{mode}")
        outcome, detail = self._replayed(batch_size), REPLAYED
        if outcome is None:
            log.debug("probe trial at batch %d on %s", batch_size, self.device)
            outcome = self._run(batch_size, recompute)
            log.info("batch %d: %s in %.1f s", batch_size, outcome.status, outcome.wall_s)
            detail = _trial_detail(outcome)
            if self.store:
                self.store.record(PROBE_TRIAL, outcome.to_dict())
        if self.progress:
            self.progress.end_trial(outcome.status, detail)
        if self.on_trial:
            self.on_trial(outcome)
        return outcome

    def _run(self, batch_size: int, recompute: str) -> TrialOutcome:
        c = self.config
        if c.command:
            from mbtune.probing.command import CommandTrial, run_command_trial

            return run_command_trial(CommandTrial(command=c.command, memory_budget_bytes=self.fits_in_bytes,
                                                  device="cpu" if self.device == "cpu" else "cuda", steps=c.steps,
                                                  timeout_s=c.trial_timeout_s,
                                                  steps_from_output=c.steps_from_output), batch_size)
        return run_classified_trial(c.trial(batch_size=batch_size, device=self.device, recompute=recompute),
                                    c.trial_timeout_s)

    def _replayed(self, batch_size: int) -> TrialOutcome | None:
        if not self.replay:
            return None
        outcome = self.replay.popleft()
        if outcome.batch_size != batch_size:
            raise ConfigError(f"the journal does not match this probe (it ran batch {outcome.batch_size} "
                              f"where this run asks for {batch_size})", hint="Run without --resume.")
        return outcome


def _predicted(config: ProbeConfig, device: str, recompute: str, budget: int, warnings: list[str],
               progress: TrialProgress | None) -> CeilingPrediction | None:
    """The ceiling the trial's own steps on fake tensors predict (probing/ceiling_prediction.py), in a child process
    (the workload is user code) under the load timeout; None, with a warning saying why, where they could
    not run (the search then starts from one granule)."""
    from mbtune.probing.ceiling_prediction import predict_ceiling
    from mbtune.worker import run_isolated

    if config.mode != TRAIN or not config.predict:
        return None
    if progress:
        progress.start_trial(f"predicting the ceiling (recompute {recompute})" if len(config.recompute) > 1
                             else "predicting the ceiling")
    trial = config.trial(batch_size=config.granularity, device=device, recompute=recompute)
    result = run_isolated(predict_ceiling, trial, budget, config.granularity, config.max_batch,
                          timeout_s=config.load_timeout_s + config.trial_timeout_s)
    if progress:
        progress.end_trial(result.status, f"batch {result.value.ceiling}" if result.status == OK and result.value
                           else "" if result.status == OK else result.cause)
    if result.status != OK:
        warnings.append(f"the ceiling could not be predicted before the trials ({result.cause}); the search started "
                        "from one granule")
        return None
    return result.value


def _recompute_ceiling(recompute: str, found: SearchResult) -> RecomputeCeiling:
    return RecomputeCeiling(recompute=recompute, ceiling=found.ceiling, first_failing=found.first_failing,
                            safe_batch=found.safe_batch, safe_batch_verified=found.safe_batch_verified,
                            trials=len(found.trials), peak_memory_bytes=_peak_at(found.trials, found.ceiling))


def _peak_at(trials: Sequence[TrialOutcome], batch_size: int) -> int | None:
    """The highest peak memory of the trials that ran at this batch size."""
    peaks = [t.peak_memory_bytes for t in trials if t.ok and t.batch_size == batch_size and t.peak_memory_bytes]
    return max(peaks) if peaks else None


def _memory_budget_bytes(config: ProbeConfig, device: str, warnings: list[str]) -> int | None:
    """The trial budget: as given (its fit under this process's limit checked where every run starts,
    session.saved_run); on CPU without one, a share of the memory available now."""
    from mbtune.device.cpu import address_space_room_bytes, available_memory_bytes

    if config.memory_budget_bytes is not None or device != "cpu":
        return config.memory_budget_bytes
    budget = int(available_memory_bytes() * DEFAULT_CPU_BUDGET_FRACTION)
    room = address_space_room_bytes()
    if room is not None and room < budget:
        budget = room
        warnings.append(f"no --memory-budget on CPU: trials are capped at {budget / 2**30:.1f} GiB, what this "
                        "process's address-space limit (ulimit -v) leaves free")
    else:
        warnings.append(f"no --memory-budget on CPU: trials are capped at {budget / 2**30:.1f} GiB "
                        f"({DEFAULT_CPU_BUDGET_FRACTION:.0%} of available memory)")
    return budget


def _trial_detail(outcome: TrialOutcome) -> str:
    if outcome.ok and outcome.samples_per_s:
        return f"{outcome.samples_per_s:,.1f} samples/s"
    return (outcome.error.strip().splitlines() or [""])[-1].strip()  # the cause, whole


def _device_info(trials: tuple[TrialOutcome, ...], device: str, timeout_s: float) -> DeviceInfo:
    for trial in trials:
        if trial.device is not None:
            return trial.device
    return describe(device, timeout_s)
