"""`mbtune tune`: probe, then sweep around the probed safe batch, then check the best row."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mbtune.checking.config import CheckConfig
from mbtune.errors import ConfigError, Interrupted, MbtuneError
from mbtune.probing.config import ProbeConfig
from mbtune.probing.records import ProbeResult
from mbtune.probing.run import probe_workload
from mbtune.progress import TrialProgress
from mbtune.records import ERROR, OK
from mbtune.settings import FORMER_NAMES, build, param_for, setting_names
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.limits import sweep_limits
from mbtune.sweeping.records import SweepReport
from mbtune.sweeping.run import GridPredictor, QuickSweep, sweep_workload

if TYPE_CHECKING:
    from mbtune.journal import Journal


def tune_workload(probe_config: ProbeConfig, sweep_config: SweepConfig, progress: TrialProgress | None = None,
                  store: Journal | None = None, *, check: bool = True, quick: QuickSweep | None = None,
                  predictor: GridPredictor | None = None) -> tuple[ProbeResult, SweepReport]:
    """Probe, then sweep around the probed safe batch, then (with `check`) check the best row's update
    against the plain model's."""
    probe = probe_workload(probe_config, progress, store)
    sweep_config = replace(sweep_config, **_command_limits(probe, sweep_config) if sweep_config.command
                           else sweep_limits(probe))
    sweep = sweep_workload(sweep_config, progress, store, quick=quick, predictor=predictor)
    if check and not sweep_config.command and sweep.best is not None and not sweep.interrupted:
        sweep = _checked(sweep, sweep_config, progress)
    return probe, sweep


def _command_limits(probe: ProbeResult, config: SweepConfig) -> dict[str, Any]:
    """A command's probe (at the grid's hungriest point, sweeping/command.py probe_command) as the sweep's limits:
    its safe size and ceiling over the micro-batches they spanned, as micro-batch sizes, and its budget, which
    every point runs under (a point past it is an out-of-memory row)."""
    from mbtune.sweeping.command import probe_command

    _, spans = probe_command(config)
    limits = sweep_limits(probe)
    safe, ceiling = limits["safe_batch"], limits["ceiling"]
    return {**limits, "safe_batch": max(1, safe // spans) if safe is not None else None,
            "ceiling": max(1, ceiling // spans) if ceiling is not None else None,
            "memory_budget_bytes": probe.memory_budget_bytes}


def _checked(sweep: SweepReport, config: SweepConfig, progress: TrialProgress | None) -> SweepReport:
    """The sweep with its best row checked (checking/run.py); a check that cannot run says why, and Ctrl-C during
    it keeps the sweep (as interrupted)."""
    from mbtune.checking.run import check_update

    assert sweep.best is not None
    point = sweep.best.point
    if progress:
        progress.start_trial(f"check {point.label}")
    try:
        run_point = None
        if config.launcher == "torchrun":  # the best row ran across these nodes: its check does too
            from mbtune.pipeline.torchrun import session

            run_point = session(config.nodes, config.command_line).run_point
        result = check_update(CheckConfig.for_point(
            point, workload=config.workload, options=config.workload_options, device=config.device,
            precision=config.precision, optimizer=config.optimizer, lr=config.lr, seed=config.seed,
            timeout=config.point_timeout_s, load_timeout=config.load_timeout_s), run_point)
    except (Interrupted, KeyboardInterrupt):
        return replace(sweep, interrupted=True, check_error="interrupted")
    except MbtuneError as exc:
        if progress:
            progress.end_trial(ERROR, exc.one_line())
        return replace(sweep, check_error=exc.one_line())
    finally:
        if config.launcher == "torchrun" and config.nnodes == 1:
            from mbtune.pipeline.torchrun import close_session

            close_session(config.nodes, 0)
    if progress:
        progress.end_trial(OK if result.status == "PASS" else ERROR, f"check {result.status}")
    return replace(sweep, check=result)


# tune takes the settings of probe and of sweep at once; `steps` are the sweep's measured steps, and the
# probe's own trial steps are this one.
PROBE_STEPS = "probe_steps"


def tune_configs(given: Mapping[str, Any], *, spelled: Callable[[str], str] = param_for,
                 said: Callable[[str], None] | None = None, command_line: str = "") -> tuple[ProbeConfig, SweepConfig]:
    """tune's two configs from one mapping of settings (see settings.build): each setting goes to the
    config that has it, a setting both have to both."""
    probe_names, sweep_names = setting_names(ProbeConfig), setting_names(SweepConfig)
    keys = {key: FORMER_NAMES.get(key.replace("-", "_"), key.replace("-", "_")) for key in given}
    unknown = [key for key, name in keys.items() if name not in probe_names | sweep_names and name != PROBE_STEPS]
    if unknown:
        known = sorted({*probe_names, *sweep_names, PROBE_STEPS})
        raise ConfigError(f"unknown setting {unknown[0]!r} for tune",
                          hint=f"Settings are the flags' names with underscores: {', '.join(known)}.")
    probe = {name: given[key] for key, name in keys.items() if name in probe_names and name != "steps"}
    if PROBE_STEPS in keys.values():
        probe["steps"] = next(given[key] for key, name in keys.items() if name == PROBE_STEPS)
    sweep = {key: given[key] for key, name in keys.items() if name in sweep_names}  # former names noted there
    sweep_config = build(SweepConfig, sweep, spelled=spelled, what="tune", said=said, command_line=command_line)
    if sweep_config.command:  # the probe's is the command at the grid's hungriest point, its batch stepped
        from mbtune.sweeping.command import probe_command

        probe.update(command=probe_command(sweep_config)[0], name=sweep_config.workload)
        probe.pop("grid", None)
    return (build(ProbeConfig, probe, spelled=lambda f: _probe_spelled(f, spelled), what="tune", command_line=command_line),
            sweep_config)


def _probe_spelled(field_name: str, spelled: Callable[[str], str]) -> str:
    word = spelled(field_name)
    return word.replace("steps", PROBE_STEPS.replace("_", "-") if word.startswith("--") else PROBE_STEPS) \
        if field_name == "steps" else word
