"""The sweep's grid: the points a config describes at a number of ranks, each runnable or dropped with the
reason it cannot run. Pure."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mbtune.pipeline.point import SweepPoint, micro_batch_size_for
from mbtune.pipeline.theory import check_point, stages_per_rank_of
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.records import SkippedPoint

if TYPE_CHECKING:
    pass


@dataclass(frozen=True, kw_only=True)
class Grid:
    """What the sweep will run and what it will not, with why."""

    points: tuple[SweepPoint, ...]
    skipped: tuple[SkippedPoint, ...]


def default_micro_batch_size(config: SweepConfig) -> int:
    """Without --micro-batch-size or --global-batch: the probed safe batch spread over the most
    micro-batches of the grid (so every pipeline step fits what one device held whole), else 4."""
    if config.safe_batch is None:
        return 4
    return max(1, config.safe_batch // max(config.micro_batch_counts))


def plan_grid(config: SweepConfig, *, num_blocks: int, num_ranks: int | None = None,
              max_processes: int | None = None, nnodes: int = 1) -> Grid:
    """Every (schedule, micro-batches, accumulation, replicas, micro-batch size) point, or the config's
    explicit points, split into runnable and skipped (with the reason). `max_processes`: the most ranks
    the device can hold (GPUs: one rank each); `nnodes`: the nodes a point's processes split over evenly."""
    points, skipped = [], []
    for point, reason in _candidates(config, num_ranks or config.num_ranks):
        reason = reason or check_point(point.schedule, point.stages_per_rank * point.num_ranks, point.num_ranks,
                                       point.num_micro_batches, num_blocks=num_blocks)
        if reason is None and point.num_processes % nnodes:
            reason = f"{point.num_processes} process(es) do not split evenly over {nnodes} nodes"
        if reason is None and max_processes is not None and point.num_processes > max_processes:
            reason = (f"{point.num_ranks} stages x {point.data_parallel_size} replicas need {point.num_processes} "
                      f"GPUs, {max_processes} visible")
        safe = config.safe_batch_for(point.recompute)
        if reason is None and safe is not None and point.micro_batch_size > safe:
            with_recompute = " with full recompute" if point.recompute == "full" and config.recompute_safe_batch else ""
            reason = f"micro-batch size {point.micro_batch_size} is above the probed safe batch {safe}{with_recompute}"
        if reason:
            skipped.append(SkippedPoint(point=point, reason=reason))
        else:
            points.append(point)
    return Grid(points=tuple(points), skipped=tuple(skipped))


def _candidates(config: SweepConfig, p: int) -> list[tuple[SweepPoint, str | None]]:
    if config.points is not None:
        return [(replace(point, num_ranks=min(point.num_ranks, p)), None) for point in config.points]
    candidates = []
    for global_batch in config.global_batches or (None,):
        for schedule in config.schedules:
            v = stages_per_rank_of(schedule, config.stages_per_rank)
            for m in config.micro_batch_counts:
                for accum in config.grad_accum_steps:
                    for dp in config.data_parallel_size:
                        for mbs, reason in _micro_batch_sizes(config, global_batch, m, accum, dp):
                            for recompute in config.recompute:
                                for own in _own_values(config.grid):
                                    candidates.append((SweepPoint(
                                        schedule=schedule, num_ranks=p, num_micro_batches=m, grad_accum_steps=accum,
                                        micro_batch_size=mbs, stages_per_rank=v, data_parallel_size=dp,
                                        recompute=recompute, grid=own), reason))
    return candidates


def _own_values(grid: tuple[tuple[str, tuple[str, ...]], ...]) -> list[tuple[tuple[str, str], ...]]:
    """Every combination of the values of the settings a command's sweep added (--grid), in order."""
    import itertools

    names = [name for name, _ in grid]
    return [tuple(zip(names, values, strict=True)) for values in itertools.product(*(v for _, v in grid))]


def _micro_batch_sizes(config: SweepConfig, global_batch: int | None, m: int, accum: int,
                       dp: int) -> list[tuple[int, str | None]]:
    if global_batch is None:
        return [(size, None) for size in config.micro_batch_size or (default_micro_batch_size(config),)]
    return [micro_batch_size_for(global_batch, num_micro_batches=m, grad_accum_steps=accum, data_parallel_size=dp)]
