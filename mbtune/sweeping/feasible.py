"""A sweep that cannot run at all is bad input: settings of which no point can run (more stages than the
workload has blocks, a global batch that no split divides) are refused before any trial, naming the setting.
Points skipped for what a probe measured or for the GPUs this host has are not the settings' fault: such a
sweep still runs, and ends saying no point could run."""

from __future__ import annotations

import math

from mbtune.errors import ConfigError
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.grid import Grid, plan_grid

# Skip reasons (grid.plan_grid) that depend on a probe's result or on this host, not on the settings alone.
_NOT_THE_SETTINGS = ("probed safe batch", "visible", "split evenly over")


def refuse_unrunnable(config: SweepConfig, *, num_blocks: int, grid: Grid | None = None) -> None:
    """Raise ConfigError when no point of the sweep's grid can run because of the settings themselves."""
    grid = grid or plan_grid(config, num_blocks=num_blocks)
    if grid.points or not grid.skipped or config.points is not None:
        return
    reasons = [skipped.reason for skipped in grid.skipped]
    if any(sign in reason for reason in reasons for sign in _NOT_THE_SETTINGS):
        return
    if config.num_ranks > num_blocks:
        raise ConfigError(f"num_ranks={config.num_ranks} is more stages than workload {config.workload!r} has "
                          f"blocks ({num_blocks})", field="num_ranks",
                          hint=f"Each stage holds one block at least: give {num_blocks} stages or fewer.")
    if config.global_batch is not None and all(reason.startswith("global batch") for reason in reasons):
        splits = sorted({p.num_micro_batches * p.grad_accum_steps * p.data_parallel_size for p in
                         (skipped.point for skipped in grid.skipped)})
        given = ",".join(map(str, config.global_batch))
        near = math.ceil(config.global_batch[0] / splits[0]) * splits[0]
        raise ConfigError(f"global_batch={given} divides into none of the sweep's splits (micro-batches x "
                          f"accumulation steps x replicas: {', '.join(map(str, splits))})", field="global_batch",
                          hint=f"Give a global batch that one of them divides, such as {near}, or change the "
                               "micro-batches and accumulation steps.")
    if config.global_batch is None and config.global_batches:
        return  # the global batch the probe's safe batch chose: not the user's setting
    first = grid.skipped[0]
    raise ConfigError(f"none of the sweep's {len(reasons)} points can run: the first ({first.point.label}) because "
                      f"{first.reason}", hint="Change the stages, schedules or micro-batches.")
