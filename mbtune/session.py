"""A saved run: the RunStore's lock and journal around a command's body, resume, and the profile written
at the end (without a profiles folder, nothing is written)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mbtune.device.describe import describe
from mbtune.probing.records import ProbeResult
from mbtune.serving.records import ServeReport
from mbtune.sweeping.records import SweepReport

if TYPE_CHECKING:
    pass


PROBE_TRIAL, SWEEP_POINT, BALANCE = "probe_trial", "sweep_point", "balance"


REPLAYED = "replayed from the journal"


# Fields that say where and how to write, not what to measure: a resumed run may change them.
# Settings that change where or how patiently a run happens, not what it measures: a resumed run may change
# them (a rescheduled multi-node job gets a new endpoint and node numbers).
_NOT_MEASUREMENT = {"command_line", "extra_warnings", "trial_timeout_s", "point_timeout_s", "reference_batch",
                    "load_timeout_s", "rdzv_endpoint", "node_rank", "join_timeout_s"}


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """What a saved run produced."""

    probe: ProbeResult | None = None
    sweep: SweepReport | None = None
    serve: ServeReport | None = None
    saved_to: Path | None = None
    notes: tuple[str, ...] = ()

    @property
    def interrupted(self) -> bool:
        return any(part is not None and part.interrupted for part in (self.sweep, self.serve))


def saved_run(kind: str, configs: dict[str, Any], workload: str, device: str, profiles_dir: Path | None,
               resume: bool, command_line: str, body: Any) -> RunOutcome:
    """Run `body(store)` -> (probe, sweep) or (probe, sweep, serve) under a RunStore, and save what it
    returns into the profile (without a profiles folder: no store, nothing written)."""
    from mbtune.device import resolve_device
    from mbtune.store import RunStore
    from mbtune.workloads.facts import workload_facts

    if profiles_dir is None:
        return RunOutcome(**_sections(body(None)))
    first = next(iter(configs.values()))
    workload_facts(workload, first.workload_options, timeout_s=first.load_timeout_s)  # bad input fails before any file
    resolved = resolve_device(device)
    if "probe" in configs:  # settings the resolved device cannot run (fp16 on CPU) fail before any file
        configs["probe"].trial(batch_size=configs["probe"].granularity, device=resolved)
    info = describe(resolved)
    with RunStore(profiles_dir, info, workload, kind=kind, config=_comparable(configs), resume=resume) as store:
        sections = _sections(body(store))
        saved = store.save(command_line=command_line, **sections)
        outcome = RunOutcome(**sections, saved_to=saved, notes=tuple(store.notes))
        if not outcome.interrupted:
            store.finish()
        return outcome


def _sections(parts: tuple) -> dict[str, Any]:
    return dict(zip(("probe", "sweep", "serve"), parts, strict=False))


def _comparable(configs: dict[str, Any]) -> dict[str, Any]:
    """The measurement settings of each config, as JSON would return them."""
    plain = {name: {k: v for k, v in dataclasses.asdict(c).items() if k not in _NOT_MEASUREMENT}
             for name, c in configs.items()}
    return json.loads(json.dumps(plain))
