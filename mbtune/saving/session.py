"""A saved run: the RunStore's lock and journal around a wing's run, resume, and the profile written at the
end (without a profiles folder, nothing is written): run_probe, run_sweep, run_tune and run_serve, each
command's one library call. And what a command takes from a saved profile, read here where the command
names the file: a sweep's limits (with_saved_limits) and a check's row (check_config_from_profile)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mbtune.checking.config import CheckConfig
from mbtune.device.describe import describe
from mbtune.errors import ConfigError, ProfileError
from mbtune.probing.config import ProbeConfig
from mbtune.probing.records import ProbeResult
from mbtune.probing.run import probe_workload
from mbtune.progress import TrialProgress
from mbtune.saving.profiles import load_profile, profile_path
from mbtune.serving.config import ServeConfig
from mbtune.serving.records import ServeReport
from mbtune.serving.run import serve_workload
from mbtune.settings import settings_of
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.limits import SweepLimits, sweep_limits
from mbtune.sweeping.records import SweepReport
from mbtune.sweeping.run import sweep_workload
from mbtune.sweeping.tune import tune_workload

if TYPE_CHECKING:
    from mbtune.pipeline.nodes import Nodes

log = logging.getLogger("mbtune")


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
    followed: int | None = None  # on a node other than node 0: node 0's exit code, after following its run

    @property
    def interrupted(self) -> bool:
        return any(part is not None and part.interrupted for part in (self.sweep, self.serve))


def saved_run(kind: str, configs: dict[str, Any], workload: str, device: str, profiles_dir: Path | None,
               resume: bool, command_line: str, body: Any) -> RunOutcome:
    """Run `body(store)` -> (probe, sweep) or (probe, sweep, serve) under a RunStore, and save what it
    returns into the profile (without a profiles folder: no store, nothing written)."""
    from mbtune.device import resolve_device
    from mbtune.saving.store import RunStore
    from mbtune.sweeping.feasible import refuse_unrunnable
    from mbtune.workloads.facts import workload_facts

    first = next(iter(configs.values()))
    # Bad input fails before any trial and any file: a workload that does not load, a sweep that cannot run.
    if not getattr(first, "command", None):  # a command is the user's own: nothing of it is loaded here
        facts = workload_facts(workload, first.workload_options, timeout_s=first.load_timeout_s)
        if "sweep" in configs:
            refuse_unrunnable(configs["sweep"], num_blocks=facts.num_blocks)
    resolved = resolve_device(device)
    memory_budget_bytes = getattr(first, "memory_budget_bytes", None)
    if resolved == "cpu" and memory_budget_bytes is not None:  # the one check that the budget fits, before anything
        from mbtune.device.cpu import check_budget_fits_limit

        check_budget_fits_limit(memory_budget_bytes)
    if profiles_dir is None:
        return RunOutcome(**_sections(body(None)))
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


def run_probe(config: ProbeConfig, progress: TrialProgress | None = None, *, profiles_dir: Path | None,
              resume: bool = False) -> RunOutcome:
    """probe_workload, journaled and saved to its profile."""
    return saved_run("probe", {"probe": config}, config.workload, config.device, profiles_dir, resume,
                     config.command_line, lambda store: (probe_workload(config, progress, store), None))


def run_sweep(config: SweepConfig, progress: TrialProgress | None = None, *, profiles_dir: Path | None,
              resume: bool = False, from_profile: str | Path | None = None, probes_dir: Path | None = None,
              say: Callable[[str], None] = log.info) -> RunOutcome:
    """sweep_workload (its quick strategy led by the planner's simulator), journaled and saved to its
    profile (next to the probe already there). The micro-batch size is bounded by the probe saved in
    `from_profile`, else by this device's saved probe of the workload in `probes_dir` (default:
    `profiles_dir`), if any (with_saved_limits). Across nodes, node 0 leads and any other node follows it
    (`followed`)."""
    from mbtune.planning.api import grid_predictor, quick_sweep

    config = with_saved_limits(config, from_profile=from_profile,
                               profiles_dir=probes_dir if probes_dir is not None else profiles_dir)
    if (code := lead_or_follow(config.launch, say)) is not None:
        return RunOutcome(followed=code)
    return saved_run("sweep", {"sweep": config}, config.workload, config.device, profiles_dir, resume,
                     config.command_line, lambda store: (None, sweep_workload(config, progress, store, quick=quick_sweep,
                                                                          predictor=grid_predictor)))


def run_tune(probe_config: ProbeConfig, sweep_config: SweepConfig, progress: TrialProgress | None = None, *,
             profiles_dir: Path | None, resume: bool = False, check: bool = True,
             say: Callable[[str], None] = log.info) -> RunOutcome:
    """tune_workload, journaled and saved: the probe and the sweep into one profile. Across nodes, node 0
    leads and any other node follows it (`followed`)."""
    from mbtune.planning.api import grid_predictor, quick_sweep

    if (code := lead_or_follow(sweep_config.launch, say)) is not None:
        return RunOutcome(followed=code)
    return saved_run("tune", {"probe": probe_config, "sweep": sweep_config}, probe_config.workload,
                     probe_config.device, profiles_dir, resume, probe_config.command_line,
                     lambda store: tune_workload(probe_config, sweep_config, progress, store, check=check,
                                                quick=quick_sweep, predictor=grid_predictor))


def lead_or_follow(nodes: Nodes | None, say: Callable[[str], None] = log.info) -> int | None:
    """Across nodes (`nodes`: a torchrun launch's, SweepConfig.launch): this node's session opened
    (pipeline/torchrun.py); None on node 0, which leads; on any other node, node 0's exit code once it has
    followed node 0's run. None on one host's own launcher (`nodes` None)."""
    import sys

    if nodes is None:
        return None
    from mbtune.pipeline.torchrun import lead_or_follow as opened

    return opened(nodes, sys.argv[1:], say)


def run_serve(config: ServeConfig, progress: TrialProgress | None = None, *, profiles_dir: Path | None,
              resume: bool = False) -> RunOutcome:
    """serve_workload, journaled and saved into the workload's profile (its `serve` section, beside the
    training probe and sweep)."""
    return saved_run("serve", {"serve": config}, config.workload, config.device, profiles_dir, resume,
                     config.command_line, lambda store: (None, None, serve_workload(config, progress, store)))


def limits_from_profile(path: str, config: SweepConfig) -> SweepLimits:
    """sweep_limits of the probe saved in a profile: an error when it holds no probe, or a probe of another
    workload, other workload options or another precision than this sweep's."""
    probe = load_profile(path).probe
    if probe is None:
        raise ProfileError(f"profile {path} holds no probe", hint="Run mbtune probe first, or use mbtune tune.")
    ours = (config.workload, dict(config.workload_options), config.precision)
    theirs = (probe.workload, dict(probe.workload_options), probe.precision)
    for what, mine, saved in zip(("workload", "workload options", "precision"), ours, theirs):
        if mine != saved:
            raise ProfileError(f"--from-profile {path} probed {what} {saved!r}, this sweep runs {mine!r}",
                              hint="Give the profile of the same workload, options and precision.")
    return sweep_limits(probe)


def with_saved_limits(config: SweepConfig, *, from_profile: str | Path | None = None,
                     profiles_dir: str | Path | None = None) -> SweepConfig:
    """The sweep's config bounded by a saved probe, read here, where the command line or the Python API
    names the file (the sweep itself reads no file): `from_profile`'s probe; else, without a safe batch,
    this device's saved probe of the same workload and options under `profiles_dir`, if there is one.
    A wrong `from_profile` is bad input; a damaged saved profile is skipped with a warning."""
    from mbtune.device import resolve_device

    if from_profile is not None:
        return replace(config, **limits_from_profile(str(from_profile), config))
    if config.safe_batch is not None or profiles_dir is None:
        return config
    path = profile_path(profiles_dir, describe(resolve_device(config.device)), config.workload)
    if not path.exists():
        return config
    try:
        probe = load_profile(path).probe
    except ProfileError as exc:
        return replace(config, extra_warnings=(*config.extra_warnings, f"ignored the saved probe: {exc.one_line()}"))
    if probe is None or dict(config.workload_options) != probe.workload_options:
        return config
    note = f"micro-batch sizes are bounded by the safe batch {probe.safe_batch} probed in {path}"
    return replace(config, **sweep_limits(probe), extra_warnings=(*config.extra_warnings, note))


def check_config_from_profile(path: Path, rank: int, **settings: Any) -> CheckConfig:
    """The CheckConfig of the rank-th row (1: the best) of a saved profile's sweep, on its workload, options,
    precision, optimizer and learning rate (unless `settings` give one); `settings` give the rest."""
    profile = load_profile(path)
    sweep = profile.sweep
    if sweep is None or not sweep.ranking:
        raise ConfigError(f"{path} holds no ranked sweep rows to check",
                         hint="Run mbtune sweep or tune first, or pass the configuration's flags instead of --from-profile.")
    if not 1 <= rank <= len(sweep.ranking):
        raise ConfigError(f"--rank {rank} is out of range: {path} ranks {len(sweep.ranking)} row(s)",
                         hint=f"Use --rank 1 to {len(sweep.ranking)}.")
    point = sweep.results[sweep.ranking[rank - 1]].point
    saved = settings_of(CheckConfig, sweep, skip=("device",))
    return CheckConfig.for_point(point, **{**saved, **{k: v for k, v in settings.items() if v is not None}})
