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

from pathlib import Path
from typing import Any

from mbtune.probing.config import ProbeConfig
from mbtune.probing.records import ProbeResult
from mbtune.saving.profiles import Profile
from mbtune.serving.records import ServeReport
from mbtune.settings import build
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.records import SweepReport


def probe(*, save_to: str | Path | None = None, resume: bool = False, progress: Any = None,
          **settings: Any) -> ProbeResult:
    """Find the memory ceiling and the verified safe batch (see `mbtune probe --help` for the settings)."""
    from mbtune.saving.session import run_probe

    config = build(ProbeConfig, settings, what="probe")
    found = run_probe(config, progress, profiles_dir=_folder(save_to), resume=resume).probe
    assert found is not None, "a probe run that returns holds its probe"
    return found


def sweep(*, save_to: str | Path | None = None, resume: bool = False, progress: Any = None,
          from_profile: str | Path | None = None, **settings: Any) -> SweepReport:
    """Run real pipelined training steps over the grid and rank them (see `mbtune sweep --help`). The
    micro-batch size is bounded by the probe in `from_profile=` (a saved profile), else by this device's
    saved probe of the workload in `save_to`, if there is one."""
    from mbtune.saving.session import run_sweep

    config = build(SweepConfig, settings, what="sweep")
    report = run_sweep(config, progress, profiles_dir=_folder(save_to), resume=resume, from_profile=from_profile).sweep
    assert report is not None, "a sweep run that returns holds its sweep"
    return report


def tune(*, save_to: str | Path | None = None, resume: bool = False, progress: Any = None, check: bool = True,
         **settings: Any) -> tuple[ProbeResult, SweepReport]:
    """Probe, then sweep around the probed safe batch, then (with `check`) check the best row's update
    against the plain model's (the report's `check`). Settings of both, by name; the probe's own trial
    steps are `probe_steps` (`steps` are the sweep's measured steps)."""
    from mbtune.saving.session import run_tune
    from mbtune.sweeping.tune import tune_configs

    outcome = run_tune(*tune_configs(settings), progress, profiles_dir=_folder(save_to), resume=resume, check=check)
    assert outcome.probe is not None and outcome.sweep is not None
    return outcome.probe, outcome.sweep


def serve(*, save_to: str | Path | None = None, resume: bool = False, progress: Any = None,
          **settings: Any) -> ServeReport:
    """Find the dynamic-batching configuration that sustains the highest Poisson rate with its p99 within
    the budget (`p99="50ms"`, or seconds: `p99=0.05`; see `mbtune serve --help` for the settings)."""
    from mbtune.saving.session import run_serve
    from mbtune.serving.config import ServeConfig

    config = build(ServeConfig, settings, what="serve")
    report = run_serve(config, progress, profiles_dir=_folder(save_to), resume=resume).serve
    assert report is not None, "a serve run that returns holds its report"
    return report


def plan(profile: str | Path | Profile, **settings: Any) -> Any:
    """Calibrate the simulator on a profile's sweep (a path or a loaded Profile) and predict the grid the
    settings describe (see `mbtune plan --help`); returns the PlanReport."""
    from mbtune.planning.api import plan_from_profile
    from mbtune.planning.config import PlanConfig

    loaded = profile if isinstance(profile, Profile) else load_profile(profile)
    return plan_from_profile(loaded, build(PlanConfig, settings, what="plan"))


def load_profile(path: str | Path) -> Profile:
    """A saved profile, validated (ProfileError names the file and field when it is damaged)."""
    from mbtune.saving.profiles import load_profile as load

    return load(Path(path))


def _folder(save_to: str | Path | None) -> Path | None:
    return Path(save_to) if save_to is not None else None
