"""Runs that save what they measure: probe, sweep and tune wrapped in a RunStore (lock, journal, save).

The CLI calls one of these per command. Without a profiles folder nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbtune.config import ProbeConfig, QualifySpec, SweepConfig
from mbtune.errors import (
    EXIT_COULD_NOT_RUN,
    BudgetTooSmallError,
    ConfigError,
    DeviceError,
    MbtuneError,
    WorkloadBrokenError,
)
from mbtune.jobs import TrialProgress, describe, limits_from_profile, probe_workload, sweep_workload, tune_workload
from mbtune.records import ProbeResult, Profile, SweepReport
from mbtune.verdicts import Verdict

# Errors that are bad input for probe and sweep but, for a qualification, mean this machine could not run
# what it is held to (no such device here, a budget or workload that fails here): an ERROR check.
_RUN_FAILURES = (DeviceError, BudgetTooSmallError, WorkloadBrokenError)

# Fields that say where and how to write, not what to measure: a resumed run may change them.
_NOT_MEASUREMENT = {"command_line", "profiles_dir", "extra_warnings", "trial_timeout_s", "point_timeout_s",
                    "load_timeout_s"}


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """What a saved run produced."""

    probe: ProbeResult | None = None
    sweep: SweepReport | None = None
    saved_to: Path | None = None
    notes: tuple[str, ...] = ()

    @property
    def interrupted(self) -> bool:
        return self.sweep is not None and self.sweep.interrupted


def run_probe(config: ProbeConfig, progress: TrialProgress | None = None, *, profiles_dir: Path | None,
              resume: bool = False) -> RunOutcome:
    """probe_workload, journaled and saved to its profile."""
    return _saved_run("probe", {"probe": config}, config.workload, config.device, profiles_dir, resume,
                      config.command_line, lambda store: (probe_workload(config, progress, store), None))


def run_sweep(config: SweepConfig, progress: TrialProgress | None = None, *, profiles_dir: Path | None,
              resume: bool = False) -> RunOutcome:
    """sweep_workload, journaled and saved to its profile (next to the probe already there)."""
    if config.from_profile is not None:
        limits_from_profile(config.from_profile, config)  # a wrong profile is bad input, before any file
    return _saved_run("sweep", {"sweep": config}, config.workload, config.device, profiles_dir, resume,
                      config.command_line, lambda store: (None, sweep_workload(config, progress, store)))


def run_tune(probe_config: ProbeConfig, sweep_config: SweepConfig, progress: TrialProgress | None = None, *,
             profiles_dir: Path | None, resume: bool = False) -> RunOutcome:
    """tune_workload, journaled and saved: the probe and the sweep into one profile."""
    return _saved_run("tune", {"probe": probe_config, "sweep": sweep_config}, probe_config.workload,
                      probe_config.device, profiles_dir, resume, probe_config.command_line,
                      lambda store: tune_workload(probe_config, sweep_config, progress, store))


def _saved_run(kind: str, configs: dict[str, Any], workload: str, device: str, profiles_dir: Path | None,
               resume: bool, command_line: str, body: Any) -> RunOutcome:
    from mbtune.device import resolve_device
    from mbtune.store import RunStore
    from mbtune.workloads.facts import workload_facts

    if profiles_dir is None:
        probe, sweep = body(None)
        return RunOutcome(probe=probe, sweep=sweep)
    first = next(iter(configs.values()))
    workload_facts(workload, first.workload_options, timeout_s=first.load_timeout_s)  # bad input fails before any file
    resolved = resolve_device(device)
    if "probe" in configs:  # settings the resolved device cannot run (fp16 on CPU) fail before any file
        configs["probe"].trial(batch_size=configs["probe"].granularity, device=resolved)
    info = describe(resolved)
    with RunStore(profiles_dir, info, workload, kind=kind, config=_comparable(configs), resume=resume) as store:
        probe, sweep = body(store)
        saved = store.save(command_line=command_line, probe=probe, sweep=sweep)
        if sweep is None or not sweep.interrupted:
            store.finish()
        return RunOutcome(probe=probe, sweep=sweep, saved_to=saved, notes=tuple(store.notes))


def _comparable(configs: dict[str, Any]) -> dict[str, Any]:
    """The measurement settings of each config, as JSON would return them."""
    plain = {name: {k: v for k, v in dataclasses.asdict(c).items() if k not in _NOT_MEASUREMENT}
             for name, c in configs.items()}
    return json.loads(json.dumps(plain))


def run_qualify(spec: QualifySpec, progress: TrialProgress | None = None, *,
                profiles_dir: Path | None, repeats: int | None = None) -> Verdict:
    """Re-run a baseline's (or a spec's) probe and sweep here and judge them: PASS, FAIL, INCONCLUSIVE or
    ERROR per check (see mbtune.qualify). Each sweep point runs `repeats` times (default 3), each in fresh
    processes.

    Bad input (an unreadable baseline, another device model) raises; a run that cannot complete (no
    device, a crash, a trial killed) becomes an ERROR check, so CI gets a verdict either way."""
    from mbtune import qualify
    from mbtune.device import resolve_device
    from mbtune.profiles import load_profile

    repeats = qualify.DEFAULT_REPEATS if repeats is None else repeats
    if repeats < 1:
        raise ConfigError(f"repeats={repeats} is out of range", hint="Use --repeats 1 or more (default 3).")
    baseline = load_profile(Path(spec.baseline)) if spec.baseline else None
    probe_config, sweep_config = _qualify_configs(spec, baseline, repeats)
    probe = sweep = info = None
    probe_error = None
    try:
        info = describe(resolve_device(probe_config.device))
        qualify.check_same_device(qualify.device_model(baseline) if baseline else None,
                                  f"{info.backend}: {info.name}", allow=spec.allow_different_device,
                                  what="the baseline and this machine")
        if sweep_config is None:
            probe = run_probe(probe_config, progress, profiles_dir=profiles_dir).probe
        else:
            outcome = run_tune(probe_config, sweep_config, progress, profiles_dir=profiles_dir)
            probe, sweep = outcome.probe, outcome.sweep
    except MbtuneError as exc:
        if not (isinstance(exc, _RUN_FAILURES) or exc.exit_code == EXIT_COULD_NOT_RUN):
            raise
        probe_error = exc.one_line()
    checks = qualify.run_errors(probe_error, sweep)
    if baseline is not None:
        checks += qualify.against_baseline(baseline.probe, baseline.sweep, probe, sweep, tolerance=spec.tolerance)
    checks += qualify.against_thresholds(dict(spec.thresholds), probe, sweep)
    return Verdict(checks=tuple(checks), device=info, baseline=spec.baseline,
                   baseline_device=qualify.device_model(baseline) if baseline else None, tolerance=spec.tolerance,
                   repeats=repeats if sweep_config is not None else None, probe=probe, sweep=sweep)


def _qualify_configs(spec: QualifySpec, baseline: Profile | None,
                     repeats: int) -> tuple[ProbeConfig, SweepConfig | None]:
    """The spec's own configs, or the ones that reproduce what the baseline measured; sweeps run each
    point `repeats` times."""
    from mbtune.errors import ProfileError

    if spec.probe is not None:
        return spec.probe, dataclasses.replace(spec.sweep, repeats=repeats) if spec.sweep else None
    if baseline is None or baseline.probe is None:
        raise ProfileError(f"baseline {spec.baseline} holds no probe to re-run",
                           hint="Qualify against a profile written by mbtune probe or tune.")
    was = baseline.probe
    probe = ProbeConfig(workload=was.workload, workload_options=tuple(sorted(was.workload_options.items())),
                        device=was.device.label if was.device.backend == "cuda" else "cpu",
                        memory_budget_bytes=was.memory_budget_bytes, margin=was.margin, granularity=was.granularity,
                        precision=was.precision, optimizer=was.optimizer, max_batch=was.max_batch,
                        confirm=was.confirm, resolution=was.resolution, steps=was.steps,
                        command_line=baseline.metadata.command_line)
    if baseline.sweep is None:
        return probe, None
    points = tuple(r.point for r in baseline.sweep.results if r.ok)
    sweep = SweepConfig(workload=was.workload, workload_options=probe.workload_options, device=probe.device,
                        num_stages=max(p.num_stages for p in points) if points else 1, points=points,
                        objective=baseline.sweep.objective, warmup_steps=baseline.sweep.warmup_steps,
                        measured_steps=baseline.sweep.measured_steps, repeats=repeats)
    return probe, sweep
