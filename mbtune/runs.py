"""Runs that save what they measure: probe, sweep and tune wrapped in a RunStore (lock, journal, save).

The CLI calls one of these per command. Without a profiles folder nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbtune.config import ProbeConfig, SweepConfig
from mbtune.jobs import TrialProgress, describe, probe_workload, sweep_workload, tune_workload
from mbtune.records import ProbeResult, SweepReport

# Fields that say where and how to write, not what to measure: a resumed run may change them.
_NOT_MEASUREMENT = {"command_line", "profiles_dir", "extra_warnings", "trial_timeout_s", "point_timeout_s"}


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

    if profiles_dir is None:
        probe, sweep = body(None)
        return RunOutcome(probe=probe, sweep=sweep)
    info = describe(resolve_device(device))
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
