"""One point of a sweep's grid (SweepPoint): the configuration a pipeline runs, and the global batch it makes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mbtune.recordio import (
    Record,
)


@dataclass(frozen=True, kw_only=True)
class SweepPoint(Record):
    """One configuration of the sweep grid."""

    FORMER_NAMES: ClassVar[dict[str, str]] = {"num_microbatches": "num_micro_batches"}  # before schema 4

    schedule: str
    num_ranks: int  # pipeline ranks (one process each; one GPU each on CUDA)
    num_micro_batches: int
    grad_accum_steps: int
    micro_batch_size: int
    stages_per_rank: int = 1  # model stages each rank holds (looped and V schedules hold several)
    data_parallel_size: int = 1
    recompute: str = "none"  # one of RECOMPUTE_MODES
    # A sweep of the user's own command: the values of the settings it added to the grid (--grid NAME=...),
    # each filled into the command's {NAME}.
    grid: tuple[tuple[str, str], ...] = ()

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.grad_accum_steps * self.data_parallel_size

    @property
    def label(self) -> str:
        replicas = f" dp={self.data_parallel_size}" if self.data_parallel_size > 1 else ""
        recompute = f" recompute={self.recompute}" if self.recompute != "none" else ""
        own = "".join(f" {name}={value}" for name, value in self.grid)
        return (f"{self.schedule} p={self.num_ranks} m={self.num_micro_batches} "
                f"accum={self.grad_accum_steps} mbs={self.micro_batch_size}{replicas}{recompute}{own}")

    @property
    def num_processes(self) -> int:
        """One process per pipeline rank of every replica."""
        return self.num_ranks * self.data_parallel_size


def micro_batch_size_for(global_batch: int, *, num_micro_batches: int, grad_accum_steps: int,
                         data_parallel_size: int = 1) -> tuple[int, str | None]:
    """The micro-batch size that makes `global_batch` (see SweepPoint.global_batch) and None; where the
    batch does not divide evenly, the size just below it (at least 1) and why the point cannot run."""
    per_step = num_micro_batches * grad_accum_steps * data_parallel_size
    if global_batch % per_step:
        replicas = f" x {data_parallel_size} data-parallel replicas" if data_parallel_size != 1 else ""
        return max(1, global_batch // per_step), (
            f"global batch {global_batch} does not divide into {num_micro_batches} micro-batches x "
            f"{grad_accum_steps} accumulation steps{replicas}")
    return global_batch // per_step, None
