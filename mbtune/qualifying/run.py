"""The qualification run: re-run a baseline's (or a spec's) probe, sweep and serve here, and judge them."""

from __future__ import annotations

import dataclasses
import time
from datetime import UTC, datetime
from pathlib import Path

from mbtune.device.describe import describe
from mbtune.device.machine_state import StateSampler, run_versions
from mbtune.errors import (
    EXIT_COULD_NOT_RUN,
    BudgetTooSmallError,
    ConfigError,
    DeviceError,
    MbtuneError,
    WorkloadBrokenError,
)
from mbtune.pipeline.nodes import Nodes
from mbtune.probing.config import ProbeConfig
from mbtune.progress import TrialProgress
from mbtune.qualifying.history import add_run, history_path, latest_changes, read_history
from mbtune.qualifying.records import FAIL, INCONCLUSIVE, PASS, Check, Verdict
from mbtune.qualifying.spec import QualifySpec
from mbtune.qualifying.state import state_check, throttle_check
from mbtune.saving.profiles import Profile
from mbtune.saving.session import run_probe, run_sweep, run_tune
from mbtune.serving.records import ServeReport
from mbtune.settings import build, settings_of
from mbtune.sweeping.config import SweepConfig

# Errors that are bad input for probe and sweep but, for a qualification, mean this machine could not run
# what it is held to (no such device here, a budget or workload that fails here): an ERROR check.
_RUN_FAILURES = (DeviceError, BudgetTooSmallError, WorkloadBrokenError)


def run_qualify(spec: QualifySpec, progress: TrialProgress | None = None, *,
                profiles_dir: Path | None, repeats: int | None = None,
                launch: Nodes | None = None, resume: bool = False, history_dir: Path | None = None,
                against: str = "", until_decided_s: float | None = None) -> Verdict:
    """Re-run a baseline's (or a spec's) probe and sweep here and judge them: PASS, FAIL, INCONCLUSIVE or
    ERROR per check (see mbtune.qualifying.judge). Each sweep point runs `repeats` times, each in fresh
    processes, or by default until the 95% interval of its throughput is a quarter of the tolerance wide
    (or its time cap passes: sweeping/stopping.py).

    Bad input (an unreadable baseline, another device model) raises; a run that cannot complete (no
    device, a crash, a trial killed) becomes an ERROR check, so CI gets a verdict either way. `launch`:
    the nodes a torchrun launch spans (SweepConfig.launch), for the sweep; `resume`: continue
    an interrupted qualification from its runs' journals. With `history_dir`, the run is added to the
    history of this machine against `against` (the baseline's or spec's path; qualifying/history.py), read
    before anything is measured, and the latest step of each gating check's series is named.
    `until_decided_s`: while the verdict is INCONCLUSIVE and four times the last round's time is left of
    these seconds, measure again twice as precisely (half the interval, up to twice the time a point; or
    twice the repeats); the last round's verdict is the answer, and only it is kept."""
    from mbtune.saving.profiles import load_profile
    from mbtune.sweeping.stopping import default_repeats

    started = time.monotonic()
    repeats = default_repeats() if repeats is None else repeats
    if repeats is not None and repeats < 1:
        raise ConfigError(f"repeats={repeats} is out of range",
                          hint="Use --repeats 1 or more, or leave it out to measure each point until known.")
    baseline = load_profile(Path(spec.baseline)) if spec.baseline else None
    kept = history_path(history_dir, baseline, against) if history_dir is not None else None
    if kept is not None:
        read_history(kept)  # a damaged or newer history is refused before anything is measured
    rounds = 1
    while True:
        round_started = time.monotonic()
        verdict = _measure(spec, baseline, _round_configs(spec, baseline, repeats, launch, rounds), progress,
                           profiles_dir=profiles_dir, resume=resume and rounds == 1, repeats=repeats, rounds=rounds)
        spent, left = time.monotonic() - round_started, (until_decided_s or 0) - (time.monotonic() - started)
        if verdict.status != INCONCLUSIVE or until_decided_s is None or left < 2 * 2 * spent:
            break
        rounds += 1
        repeats = 2 * repeats if repeats is not None else None
    verdict = dataclasses.replace(verdict, wall_s=time.monotonic() - started, rounds=rounds,
                                  until_decided_s=until_decided_s, checks=_with_time_to_decide(verdict))
    return verdict if kept is None else with_history(verdict, kept, against)


def _with_time_to_decide(verdict: Verdict) -> tuple[Check, ...]:
    """The checks, each INCONCLUSIVE gating one with the time more measurement would take at this run's pace
    (its round's wall time over again, as many times as its figures need, less the one already made)."""
    out = []
    for check in verdict.checks:
        if check.gating and check.status == INCONCLUSIVE and check.more_measurements and check.more_measurements > 1:
            more_s = (check.more_measurements - 1) * verdict.wall_s
            check = dataclasses.replace(check, detail=f"{check.detail}; about {_minutes(more_s)} more at this run's "
                                                      f"pace (qualify --until-decided --max-time)")
        out.append(check)
    return tuple(out)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _round_configs(spec: QualifySpec, baseline: Profile | None, repeats: int | None, launch: Nodes | None,
                   rounds: int) -> tuple[ProbeConfig | None, SweepConfig | None]:
    """The probe and sweep to run in a round: the qualification's precision (a quarter of the tolerance,
    QUALIFY_MAX_TIME_PER_POINT_S a point), twice as fine in each round after the first."""
    from mbtune.sweeping.stopping import QUALIFY_MAX_TIME_PER_POINT_S, qualify_target_ci

    probe_config, sweep_config = _qualify_configs(spec, baseline, repeats)
    finer = 2 ** (rounds - 1)
    if sweep_config is not None and repeats is None:
        # A qualification aims at a narrower interval than a sweep (a quarter of its tolerance) and runs
        # unattended: each point may take longer than a sweep's own cap, and no point is raced.
        sweep_config = dataclasses.replace(sweep_config, target_ci=qualify_target_ci(spec.tolerance) / finer,
                                           time_budget_s=None, race=False,
                                           max_time_per_point_s=finer * max(sweep_config.max_time_per_point_s,
                                                                            QUALIFY_MAX_TIME_PER_POINT_S))
    if sweep_config is not None and launch is not None:
        sweep_config = dataclasses.replace(sweep_config, launcher="torchrun", nnodes=launch.nnodes,
                                           node_rank=launch.node_rank, rdzv_endpoint=launch.endpoint,
                                           join_timeout_s=launch.join_timeout_s)
    return probe_config, sweep_config


def _measure(spec: QualifySpec, baseline: Profile | None,
             configs: tuple[ProbeConfig | None, SweepConfig | None], progress: TrialProgress | None, *,
             profiles_dir: Path | None, resume: bool, repeats: int | None, rounds: int) -> Verdict:
    """One round: the probe, sweep and serve run here, in the state sampled while they ran, and judged."""
    from mbtune.device import resolve_device
    from mbtune.qualifying import judge as qualify
    from mbtune.qualifying.compare import check_same_device, device_model

    started, started_at = time.monotonic(), datetime.now(UTC).replace(microsecond=0, tzinfo=None).isoformat()
    probe_config, sweep_config = configs
    probe = sweep = info = None
    probe_error = None
    sampler = StateSampler(gpus=_on_cuda(probe_config, sweep_config, spec), versions=run_versions())
    try:
        sampler.__enter__()
        info = describe(resolve_device(_device_setting(probe_config, sweep_config, spec)))
        check_same_device(device_model(baseline) if baseline else None,
                                  f"{info.backend}: {info.name}", allow=spec.allow_different_device,
                                  what="the baseline and this machine")
        if probe_config is None and sweep_config is not None:  # a sweep of the user's command alone
            sweep = run_sweep(sweep_config, progress, profiles_dir=profiles_dir, resume=resume).sweep
        elif probe_config is None:
            pass  # a serving spec alone
        elif sweep_config is None:
            probe = run_probe(probe_config, progress, profiles_dir=profiles_dir, resume=resume).probe
        else:
            outcome = run_tune(probe_config, sweep_config, progress, profiles_dir=profiles_dir, resume=resume)
            probe, sweep = outcome.probe, outcome.sweep
    except MbtuneError as exc:
        if not (isinstance(exc, _RUN_FAILURES) or exc.exit_code == EXIT_COULD_NOT_RUN):
            raise
        probe_error = exc.one_line()
    serve, serve_error = None, None
    try:
        if spec.serve is not None:
            serve, serve_error = _qualify_serve(spec, progress, profiles_dir, resume) if info else (None, probe_error)
    finally:
        sampler.__exit__(None, None, None)
    state = sampler.state()
    checks = qualify.run_errors(probe_error, sweep)
    if baseline is not None:
        checks += qualify.against_baseline(baseline.probe, baseline.sweep, probe, sweep, tolerance=spec.tolerance)
    checks += qualify.against_thresholds(dict(spec.thresholds), probe, sweep)
    checks += qualify.serve_thresholds(dict(spec.thresholds), serve, serve_error)
    compared = state_check(baseline.sweep.machine_state if baseline.sweep else None, state) if baseline else None
    checks += [c for c in (throttle_check(state), compared) if c is not None]
    return Verdict(checks=tuple(checks), device=info, baseline=spec.baseline,
                   baseline_device=device_model(baseline) if baseline else None, tolerance=spec.tolerance,
                   repeats=repeats if sweep_config is not None else None, probe=probe, sweep=sweep,
                   started_at=started_at, wall_s=time.monotonic() - started, state=state)


# A step for the worse is shown as FAIL for this many runs after it, then as history (PASS).
RECENT_RUNS = 10


def with_history(verdict: Verdict, path: Path, against: str) -> Verdict:
    """The verdict added to its history, naming the latest step of each gating check's series as a check
    shown beside the verdict (a step for the worse within RECENT_RUNS runs is FAIL, else PASS; none gates)."""
    history = add_run(path, verdict, against=against)
    changes = latest_changes(history)
    last = history.runs[-1].run
    shown = tuple(Check(name=f"history: {c.check}", gating=False,
                        status=FAIL if c.change_pct < 0 and last - c.run < RECENT_RUNS else PASS,
                        detail=f"{c.words} (p {c.p_value:.1g}; {len(history.runs)} runs)") for c in changes)
    return dataclasses.replace(verdict, checks=verdict.checks + shown, changes=changes, history=str(path),
                               run=history.runs[-1].run)


def _on_cuda(probe: ProbeConfig | None, sweep: SweepConfig | None, spec: QualifySpec) -> bool:
    """Whether the run may measure a GPU (its NVML state is then sampled; on a machine without NVML, nothing
    is). Asked of the setting alone: the parent touches no device."""
    return _device_setting(probe, sweep, spec) != "cpu"


def _device_setting(probe: ProbeConfig | None, sweep: SweepConfig | None, spec: QualifySpec) -> str:
    """The device the run is set to: its probe's, else its sweep's (a command's sweep alone), else its serve's."""
    return probe.device if probe else sweep.device if sweep else _serve_device(spec)


def _serve_device(spec: QualifySpec) -> str:
    assert spec.serve is not None, "a spec with neither a probe nor a baseline has a serve section"
    return spec.serve.device


def _qualify_serve(spec: QualifySpec, progress: TrialProgress | None, profiles_dir: Path | None,
                   resume: bool) -> tuple[ServeReport | None, str | None]:
    """The spec's serving run, or why it could not complete (an ERROR check, as a probe's would be)."""
    from mbtune.saving.session import run_serve

    assert spec.serve is not None
    try:
        return run_serve(spec.serve, progress, profiles_dir=profiles_dir, resume=resume).serve, None
    except MbtuneError as exc:
        if not (isinstance(exc, _RUN_FAILURES) or exc.exit_code == EXIT_COULD_NOT_RUN):
            raise
        return None, exc.one_line()


def _qualify_configs(spec: QualifySpec, baseline: Profile | None,
                     repeats: int | None) -> tuple[ProbeConfig | None, SweepConfig | None]:
    """The spec's own configs, or the ones that reproduce what the baseline measured; sweeps run each
    point `repeats` times. A serving spec alone has neither."""
    from mbtune.errors import ProfileError

    if spec.probe is None and baseline is None:
        return None, None
    if spec.probe is not None:
        return spec.probe, dataclasses.replace(spec.sweep, repeats=repeats) if spec.sweep else None
    if baseline is None or (baseline.probe is None and (baseline.sweep is None or not baseline.sweep.command)):
        raise ProfileError(f"baseline {spec.baseline} holds no probe to re-run",
                           hint="Qualify against a profile written by mbtune probe or tune (or a sweep of your "
                                "command).")
    was = baseline.probe
    probe = None
    if was is not None:  # a sweep of the user's command may stand alone: its sweep checks are qualified
        device = was.device.label if was.device.backend == "cuda" else "cpu"
        probe = build(ProbeConfig, {**settings_of(ProbeConfig, was), "device": device,
                                    "name": was.workload if was.command else None,
                                    "recompute": (was.recompute, *(c.recompute for c in was.recompute_ceilings))},
                      command_line=baseline.metadata.command_line)
    if baseline.sweep is None:
        return probe, None
    if was is None:
        device = baseline.sweep.device.label if baseline.sweep.device.backend == "cuda" else "cpu"
    points = tuple(r.point for r in baseline.sweep.results if r.ok)
    # How the baseline searched (its limits, strategy, precision target and repeats) is decided afresh: the
    # re-run measures the baseline's own points.
    searched = ("ceiling", "ceiling_peak_memory_bytes", "safe_batch", "strategy", "target_ci", "repeats")
    sweep = build(SweepConfig, {**settings_of(SweepConfig, baseline.sweep, skip=searched), "device": device,
                                "balance": baseline.sweep.balance.by, "repeats": repeats,
                                "stages": max(p.num_ranks for p in points) if points else 1}, points=points)
    return probe, sweep
