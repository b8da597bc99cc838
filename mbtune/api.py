"""The public Python API: `mbtune.probe`, `mbtune.sweep`, `mbtune.tune`, `mbtune.plan`, `mbtune.serve`,
`mbtune.load_profile`.

Each takes the same settings as its command, by keyword, under the flag's name with underscores
(`trial_timeout=60`, `accum=(1, 2)`, `stages=2`), the one name each setting has, and returns the typed
record. Saving is an argument: `save_to="profiles"` journals every finished trial
and writes the profile there, as the command does; without it nothing is written. Ctrl-C
(KeyboardInterrupt) starts nothing new and keeps what finished, as on the command line.

    import mbtune

    if __name__ == "__main__":  # trials run in worker processes that re-import this script
        probe = mbtune.probe(workload="mlp", device="cpu", memory_budget="256MiB")
        probe.safe_batch  # the verified safe batch
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mbtune.errors import ConfigError
from mbtune.probing.config import ProbeConfig
from mbtune.probing.records import ProbeResult
from mbtune.saving.profiles import Profile
from mbtune.serving.records import ServeReport
from mbtune.settings import field_for, param_for
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.records import SweepReport
from mbtune.units import parse_bytes


def probe(*, save_to: str | Path | None = None, resume: bool = False, progress: Any = None,
          **settings: Any) -> ProbeResult:
    """Find the memory ceiling and the verified safe batch (see `mbtune probe --help` for the settings)."""
    from mbtune.saving.session import run_probe

    config = _config(ProbeConfig, settings)
    found = run_probe(config, progress, profiles_dir=_folder(save_to), resume=resume).probe
    assert found is not None, "a probe run that returns holds its probe"
    return found


def sweep(*, save_to: str | Path | None = None, resume: bool = False, progress: Any = None,
          **settings: Any) -> SweepReport:
    """Run real pipelined training steps over the grid and rank them (see `mbtune sweep --help`). The
    micro-batch size is bounded by the probe in `from_profile=` (a saved profile), else by this device's
    saved probe of the workload in `save_to`, if there is one."""
    from mbtune.saving.session import run_sweep, with_saved_limits

    from_profile = settings.pop("from_profile", None)
    config = with_saved_limits(_config(SweepConfig, settings), from_profile=from_profile, profiles_dir=_folder(save_to))
    report = run_sweep(config, progress, profiles_dir=_folder(save_to), resume=resume).sweep
    assert report is not None, "a sweep run that returns holds its sweep"
    return report


def tune(*, save_to: str | Path | None = None, resume: bool = False, progress: Any = None, check: bool = True,
         **settings: Any) -> tuple[ProbeResult, SweepReport]:
    """Probe, then sweep around the probed safe batch, then (with `check`) check the best row's update
    against the plain model's (the report's `check`). Settings of both, by name; the probe's own trial
    steps are `probe_steps` (`steps` are the sweep's measured steps)."""
    from mbtune.saving.session import run_tune

    probe_fields = {f.name for f in dataclasses.fields(ProbeConfig)}
    sweep_fields = {f.name for f in dataclasses.fields(SweepConfig)}
    probe_steps = settings.get("probe_steps")
    named = _field_names({k: v for k, v in settings.items() if k != "probe_steps"}, probe_fields | sweep_fields, "tune")
    probe_settings = {k: v for k, v in named.items() if k in probe_fields and k != "steps"}
    if probe_steps is not None:
        probe_settings["steps"] = probe_steps
    sweep_settings = {k: v for k, v in named.items() if k in sweep_fields}
    outcome = run_tune(ProbeConfig(**probe_settings), SweepConfig(**sweep_settings), progress,
                       profiles_dir=_folder(save_to), resume=resume, check=check)
    assert outcome.probe is not None and outcome.sweep is not None
    return outcome.probe, outcome.sweep


def serve(*, save_to: str | Path | None = None, resume: bool = False, progress: Any = None,
          **settings: Any) -> ServeReport:
    """Find the dynamic-batching configuration that sustains the highest Poisson rate with its p99 within
    the budget (`p99="50ms"`, or seconds: `p99=0.05`; see `mbtune serve --help` for the settings)."""
    from mbtune.saving.session import run_serve
    from mbtune.serving.config import DURATIONS, ServeConfig, with_durations

    fields = {f.name for f in dataclasses.fields(ServeConfig)} - set(DURATIONS.values())
    durations = with_durations({k: v for k, v in settings.items() if k in DURATIONS})
    config = ServeConfig(**_field_names({k: v for k, v in settings.items() if k not in DURATIONS}, fields, "serve"),
                         **durations)
    report = run_serve(config, progress, profiles_dir=_folder(save_to), resume=resume).serve
    assert report is not None, "a serve run that returns holds its report"
    return report


def plan(profile: str | Path | Profile, **settings: Any) -> Any:
    """Calibrate the simulator on a profile's sweep (a path or a loaded Profile) and predict the grid the
    settings describe (see `mbtune plan --help`); returns the PlanReport."""
    from mbtune.planning.api import plan_from_profile
    from mbtune.planning.config import PlanConfig

    loaded = profile if isinstance(profile, Profile) else load_profile(profile)
    return plan_from_profile(loaded, _config(PlanConfig, settings))


def load_profile(path: str | Path) -> Profile:
    """A saved profile, validated (ProfileError names the file and field when it is damaged)."""
    from mbtune.saving.profiles import load_profile as load

    return load(Path(path))


def _config(kind: type, settings: Mapping[str, Any]) -> Any:
    """A validated config from keyword settings, each named as its flag is (with underscores)."""
    return kind(**_field_names(settings, {f.name for f in dataclasses.fields(kind)}, kind.__name__))


# Config fields that no setting names: filled in by mbtune itself.
_NOT_SETTINGS = {"command_line", "extra_warnings", "points"}


def _field_names(settings: Mapping[str, Any], fields: set[str], what: str) -> dict[str, Any]:
    """Settings keyed by config field (of `fields`), each setting named by its flag with underscores
    (`accum`, `memory_budget`); sizes parsed, lists and option dicts made tuples. Any other name is refused."""
    fields = fields - _NOT_SETTINGS
    named: dict[str, Any] = {}
    for key, value in settings.items():
        name = field_for(key, fields)
        if name not in fields or param_for(name) != key.replace("-", "_"):
            raise ConfigError(f"unknown setting {key!r} for {what}",
                              hint=f"Settings are the flags' names with underscores: "
                                   f"{', '.join(sorted(param_for(f) for f in fields))}.")
        if name == "memory_budget_bytes" and isinstance(value, str):
            value = parse_bytes(value, name="memory_budget")
        elif name == "workload_options" and isinstance(value, Mapping):
            value = tuple(sorted(value.items()))
        elif isinstance(value, list):
            value = tuple(value)
        named[name] = value
    return named


def _folder(save_to: str | Path | None) -> Path | None:
    return Path(save_to) if save_to is not None else None
