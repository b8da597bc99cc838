"""A rank process's place in its world: joining the process group (once per process, where ranks are kept
between points: pipeline/warm.py), and the smaller groups a point's data parallelism and tied weights need."""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.rank_device import pin_to_cores, rank_device, set_threads
from mbtune.pipeline.split import StageBlocks
from mbtune.pipeline.theory import stage_to_rank
from mbtune.workloads import Workload


@dataclass(frozen=True)
class Joined:
    """A rank process in its process group: its rank in the world, its device and the cores it is pinned to."""

    rank: int
    device: torch.device
    cores: tuple[int, ...] = ()


def join_group(spec: PipelineSpec, *, rank: int, store_path: str | None) -> Joined:
    """Pin this process (on the CPU, where asked), set its threads, and join the world's process group (see
    run_rank for `store_path`). A process kept between points (pipeline/warm.py) does this once."""
    local_rank = rank if store_path is not None else int(os.environ.get("LOCAL_RANK", "0"))
    cores: tuple[int, ...] = ()
    if spec.pin_cpus and spec.device == "cpu":
        local_size = spec.world_size if store_path is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cores = pin_to_cores(local_rank, local_size)
    if spec.threads is not None:
        set_threads(min(spec.threads, len(cores)) if cores else spec.threads)
    device = rank_device(spec, local_rank)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        **({"store": dist.FileStore(store_path, spec.world_size)} if store_path is not None
           else {"init_method": "env://"}),
        rank=rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
    )
    return Joined(rank=rank, device=device, cores=cores)


def leave_group() -> None:
    _GROUPS.clear()
    dist.destroy_process_group()


# Groups made once per process: a rank kept between points makes each only once, and every rank of the world
# asks for them in the same order (as torch requires), since every rank runs the same points.
# A test may make and destroy several worlds in one process: the groups are the current world's.
_GROUPS: dict[tuple[int, ...], Any] = {}
_WORLD: list[Any] = [None]


def _group(ranks: Sequence[int]) -> Any:
    if _WORLD[0] is not dist.group.WORLD:
        _GROUPS.clear()
        _WORLD[0] = dist.group.WORLD
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key))
    return _GROUPS[key]


def rank_groups(spec: PipelineSpec, rank: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This process's pipeline group (its replica's ranks) and replica group (the ranks of the other
    replicas that hold the same stages); both None without data parallelism (the world is the pipeline).
    Every process creates every group, in the same order, as torch requires."""
    if spec.data_parallel_size == 1:
        return None, None
    p, d = spec.num_ranks, spec.data_parallel_size
    pipelines = [_group([replica * p + i for i in range(p)]) for replica in range(d)]
    replicas = [_group([replica * p + i for replica in range(d)]) for i in range(p)]
    pipeline_rank, replica = spec.place(rank)
    return pipelines[replica], replicas[pipeline_rank]


def tie_groups_of(spec: PipelineSpec, workload: Workload, all_blocks: StageBlocks,
                rank: int) -> dict[int, dist.ProcessGroup]:
    """Per tie of the workload whose members sit on several pipeline ranks, the group of those ranks in
    this process's replica, where this process is one of them: their copies' gradients are summed in it.
    Every process creates every group, in the same order."""
    owners = stage_to_rank(spec.schedule, spec.num_ranks, spec.num_model_stages)
    holder = {block: owners[stage] for stage, blocks in enumerate(all_blocks) for block in blocks}
    pipeline_rank, my_replica = spec.place(rank)
    mine = {}
    for index, tie in enumerate(workload.ties):
        ranks = sorted({holder[block] for block, _ in tie})
        if len(ranks) < 2:
            continue  # one rank holds every member: they are one parameter there
        for replica in range(spec.data_parallel_size):
            group = _group([replica * spec.num_ranks + r for r in ranks])
            if replica == my_replica and pipeline_rank in ranks:
                mine[index] = group
    return mine
