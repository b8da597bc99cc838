"""PlanConfig: every option of a plan, validated, with the bounds past which the simulation would not answer.

Limits, measured on a shared 2-core CPU machine with `mbtune plan` on a gpt profile; about 3-4 s of every
plan is importing torch, reading the blocks on the meta device, calibrating and validating, whatever the grid:

- MAX_SIMULATED_ACTIONS: a plan simulates, for every point of the grid, every compute action of one
  optimizer step, 3 to 15 draws of the costs where it draws them from the measured scatter
  (planner.spread_samples), once with scatter none. The simulator takes a step's dependency graph a level
  at a time (planning/step_graph.py): 2-5M simulated actions a second for one draw, 7.5-14M for 15 draws
  at once (bench/simulator.py, p=64 m=256); the six schedules at p=64 m=256 from scratch in 2.5 s. 100M
  actions are then 10-40 s.
- MAX_HELD_BYTES: memory, not time, bounds the largest points. The orders of every point stay cached
  (about 150 bytes an action), and the point being simulated holds its graph (about 300 bytes an action)
  and its draws (about 160 bytes an action and draw): gpipe p=512 m=4096 (4.2M actions) held 1.7 GB.
- MAX_MODEL_STAGES and MAX_BLOCKS: a weighted split of blocks over stages costs about the square of the
  blocks in time and blocks x stages in memory (pipeline/split.py): 1024 blocks split in 0.1-0.2 s, 4096 in
  1-2.5 s, 8192 in 16 s; 20000 stages of one block each took 94 s and 6.4 GB. Without num_blocks a point is
  planned with a block per stage, so the stages in all (ranks x stages per rank) are bounded as blocks are.
- MAX_COUNT: replicas and samples cost the simulation nothing; past int32 they are typos.
"""

from __future__ import annotations

from dataclasses import dataclass

from mbtune.errors import ConfigError
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.theory import (
    DEFAULT_STAGES_PER_RANK,
    SCHEDULE_NAMES,
    stages_per_rank_of,
)
from mbtune.planning.accuracy import LEAVE_ONE_OUT, METHODS
from mbtune.planning.cluster import ClusterGrid, count_points
from mbtune.planning.defaults import (
    DEFAULT_PLAN_MICRO_BATCHES,
    DEFAULT_PLAN_RANKS,
    DEFAULT_PLAN_SCATTER,
    DEFAULT_PLAN_VALIDATION,
)
from mbtune.planning.planner import (
    Link,
    PlanGrid,
    grid_points,
    point_actions,
    simulated_actions,
)
from mbtune.planning.records import SCATTER_MEASURED, SCATTER_MODES
from mbtune.records import RECOMPUTE_MODES
from mbtune.sweeping.config import DEFAULT_SCHEDULES
from mbtune.validation import check_types, require, require_unique

MAX_SIMULATED_ACTIONS = 100_000_000
MAX_HELD_BYTES = 6 * 10**9
MAX_MODEL_STAGES = 1024
MAX_BLOCKS = 1024
MAX_COUNT = 2**31 - 1
MAX_GPUS = 65536
MAX_CANDIDATES = 200_000  # a cluster plan's configurations, each estimated in closed form (about 20 us each)
BYTES_PER_ORDERED_ACTION = 150  # measured: a cached order's action
BYTES_PER_GRAPH_ACTION = 300  # measured: the simulated point's graph, per action
BYTES_PER_DRAWN_ACTION = 160  # measured: the simulated point's state, per action and draw

assert DEFAULT_PLAN_VALIDATION == LEAVE_ONE_OUT and DEFAULT_PLAN_SCATTER == SCATTER_MEASURED


@dataclass(frozen=True, kw_only=True)
class PlanWork:
    """What simulating a grid costs: the actions simulated (time) and held (memory), and its largest point."""

    simulated_actions: int
    held_actions: int  # cached orders: every point's actions
    largest: SweepPoint | None = None
    largest_held_bytes: int = 0  # the point that holds the most while it is simulated

    @property
    def memory_bytes(self) -> int:
        """About the memory the simulation holds beyond the fixed cost of a plan."""
        return BYTES_PER_ORDERED_ACTION * self.held_actions + self.largest_held_bytes


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """Settings of `mbtune plan`: the grid to predict (schedules x micro-batch counts at `num_ranks` ranks
    and `data_parallel_size` replicas), the interconnect, and how the simulator is checked and run.

    Without a micro-batch size or global batch, the plan takes the size the profile measured most.
    `validation_method` None skips the check against the measured points (leave-one-out refits the model
    once per point). `scatter` measured draws costs from the scatter measured on the profiled machine, none
    predicts with average costs. `keep_timeline` keeps the recommended configuration's simulated timeline
    in the plan (for pictures and traces). ConfigError where a setting is out of range or the grid is too
    large to simulate in seconds (see the module docstring for the limits)."""

    num_ranks: int = DEFAULT_PLAN_RANKS  # pipeline ranks
    micro_batches: tuple[int, ...] = DEFAULT_PLAN_MICRO_BATCHES
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    data_parallel_size: int = 1
    micro_batch_size: int | None = None
    global_batch: int | None = None
    grad_accum_steps: int = 1
    num_blocks: int | None = None  # a what-if model of this many blocks; None: the workload's own
    stages_per_rank: int = DEFAULT_STAGES_PER_RANK  # stages per rank of the looped schedules
    link_bandwidth_bytes_per_s: float | None = None  # None: hand-overs cost what they cost when profiled
    link_latency_s: float | None = None
    ranks_per_node: int | None = None  # None: every hand-over as within a node (or over the given link)
    validation_method: str | None = DEFAULT_PLAN_VALIDATION
    scatter: str = DEFAULT_PLAN_SCATTER
    keep_timeline: bool = False
    recompute: tuple[str, ...] = ("none",)  # activation recompute modes, every point in each
    # A cluster plan: every split of this many GPUs into pipeline ranks x replicas for global_batch (the
    # grid's num_ranks, micro_batches, data_parallel_size and grad_accum_steps are then enumerated).
    num_gpus: int | None = None
    device_memory_bytes: int | None = None  # each device's memory (None: the profile's probed ceiling)
    target_device: str | None = None  # plan for this device: compute scaled by its peak FLOP/s (an estimate)

    def __post_init__(self) -> None:
        if self.validation_method == "none":  # as the command line says it
            object.__setattr__(self, "validation_method", None)
        for name in ("micro_batches", "schedules", "recompute"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        check_types(self)
        self._check_grid()
        self._check_settings()
        if self.num_gpus is None:
            self._check_size()
        else:
            self._check_cluster()

    def _check_grid(self) -> None:
        require(1 <= self.num_ranks <= MAX_MODEL_STAGES, "num_ranks", self.num_ranks,
                f"an integer from 1 to {MAX_MODEL_STAGES}")
        require(bool(self.micro_batches), "micro_batches", self.micro_batches, "at least one micro-batch count")
        require(min(self.micro_batches) >= 1, "micro_batches", self.micro_batches, "integers >= 1")
        require_unique(self.micro_batches, "micro_batches")
        require(bool(self.schedules), "schedules", self.schedules, "at least one schedule")
        unknown = [s for s in self.schedules if s not in SCHEDULE_NAMES]
        require(not unknown, "schedules", ",".join(unknown), " | ".join(SCHEDULE_NAMES))
        require_unique(self.schedules, "schedules")
        unknown = [r for r in self.recompute if r not in RECOMPUTE_MODES]
        require(bool(self.recompute) and not unknown, "recompute", ",".join(unknown) or self.recompute,
                " | ".join(RECOMPUTE_MODES))
        require_unique(self.recompute, "recompute")
        require(2 <= self.stages_per_rank <= MAX_MODEL_STAGES, "stages_per_rank", self.stages_per_rank,
                f"an integer from 2 to {MAX_MODEL_STAGES}")
        require(self.num_blocks is None or 3 <= self.num_blocks <= MAX_BLOCKS, "num_blocks", self.num_blocks,
                f"an integer from 3 to {MAX_BLOCKS} (a deeper model repeats its interior blocks)")
        for name in ("data_parallel_size", "grad_accum_steps"):
            require(1 <= getattr(self, name) <= MAX_COUNT, name, getattr(self, name), f"an integer from 1 to {MAX_COUNT}")
        for name in ("micro_batch_size", "global_batch"):
            value = getattr(self, name)
            require(value is None or 1 <= value <= MAX_COUNT, name, value, f"an integer from 1 to {MAX_COUNT}")
        if self.micro_batch_size is not None and self.global_batch is not None:
            raise ConfigError("micro_batch_size and global_batch both given", field="micro_batch_size",
                              hint="Give one: the other follows from micro-batches, accumulation and data-parallel size.")

    def _check_settings(self) -> None:
        bandwidth, latency = self.link_bandwidth_bytes_per_s, self.link_latency_s
        require(bandwidth is None or bandwidth > 0, "link_bandwidth_bytes_per_s", bandwidth, "bytes/s above 0")
        require(latency is None or latency >= 0, "link_latency_s", latency, "seconds >= 0")
        require(self.ranks_per_node is None or self.ranks_per_node >= 1, "ranks_per_node", self.ranks_per_node,
                "an integer >= 1")
        require(self.validation_method is None or self.validation_method in METHODS, "validation_method",
                self.validation_method, f"{' | '.join(METHODS)}, or None to skip it")
        require(self.scatter in SCATTER_MODES, "scatter", self.scatter, " | ".join(SCATTER_MODES))

    def _check_size(self) -> None:
        for schedule in self.schedules:
            per_rank = stages_per_rank_of(schedule, self.stages_per_rank)
            require(self.num_ranks * per_rank <= MAX_MODEL_STAGES, "num_ranks", self.num_ranks,
                    f"at most {MAX_MODEL_STAGES // per_rank} with {schedule} at {per_rank} stages per rank "
                    f"({MAX_MODEL_STAGES} stages in all at most)")
        # The cheapest point (gpipe: two actions per stage and micro-batch) bounds each count alone, before
        # the grid is built (some checks of a point cost as much as its micro-batch count).
        per_count = 2 * self.num_ranks * self.grad_accum_steps
        require(per_count <= MAX_SIMULATED_ACTIONS, "grad_accum_steps", self.grad_accum_steps,
                f"at most {MAX_SIMULATED_ACTIONS // (2 * self.num_ranks)} (at {self.num_ranks} stages, more is "
                "too much to simulate)")
        require(max(self.micro_batches) * per_count <= MAX_SIMULATED_ACTIONS, "micro_batches", self.micro_batches,
                f"at most {MAX_SIMULATED_ACTIONS // per_count} (at {self.num_ranks} stages x {self.grad_accum_steps} "
                "accumulation steps, more is too much to simulate)")
        work = self.work()
        if work.memory_bytes > MAX_HELD_BYTES:
            raise ConfigError(
                f"the grid would hold ~{work.memory_bytes / 1e9:.3g} GB of simulation state (limit "
                f"{MAX_HELD_BYTES / 1e9:.3g} GB)", hint="Plan fewer stages, micro-batches, accumulation steps or schedules.")
        if work.simulated_actions > MAX_SIMULATED_ACTIONS:
            largest = work.largest
            assert largest is not None
            raise ConfigError(
                f"the grid needs ~{_count(work.simulated_actions)} simulated actions (limit "
                f"{_count(MAX_SIMULATED_ACTIONS)}; {largest.schedule} p={largest.num_ranks} "
                f"m={largest.num_micro_batches} alone {_count(simulated_actions(largest, self.scatter))})",
                hint="Plan fewer stages, micro-batches, accumulation steps or schedules.")

    def _check_cluster(self) -> None:
        require(1 <= self.num_gpus <= MAX_GPUS, "num_gpus", self.num_gpus, f"an integer from 1 to {MAX_GPUS}")  # type: ignore[operator]
        if self.global_batch is None:
            raise ConfigError("a cluster plan needs the global batch to split over the GPUs", field="global_batch",
                              hint="Give it: mbtune plan PROFILE --gpus 64 --global-batch 1024.")
        require(self.device_memory_bytes is None or self.device_memory_bytes > 0, "device_memory_bytes",
                self.device_memory_bytes, "bytes above 0")
        candidates = count_points(self.cluster_grid(), MAX_BLOCKS, MAX_CANDIDATES)
        require(candidates <= MAX_CANDIDATES, "global_batch", self.global_batch,
                f"a batch with fewer splits: more than {MAX_CANDIDATES} configurations to estimate")
        if candidates == 0:
            raise ConfigError(f"no way to split {self.num_gpus} GPUs for global batch {self.global_batch}: no "
                              "replica count divides the batch, or no schedule runs the micro-batch counts left",
                              field="global_batch", hint="Give a global batch divisible by a divisor of --gpus.")

    def cluster_grid(self) -> ClusterGrid:
        """What a cluster plan enumerates (see planning/cluster.py)."""
        assert self.num_gpus is not None and self.global_batch is not None
        return ClusterGrid(num_gpus=self.num_gpus, global_batch=self.global_batch, schedules=self.schedules,
                           recompute=self.recompute, stages_per_rank=(self.stages_per_rank, 2 * self.stages_per_rank))

    def grid(self) -> PlanGrid:
        """The configurations to predict (micro-batch size still None where neither it nor the global batch
        is given: the plan takes it from the profile)."""
        return PlanGrid(num_ranks=self.num_ranks, micro_batches=self.micro_batches, schedules=self.schedules,
                        data_parallel_size=self.data_parallel_size, micro_batch_size=self.micro_batch_size,
                        global_batch=self.global_batch, grad_accum_steps=self.grad_accum_steps,
                        stages_per_rank=self.stages_per_rank, num_blocks=self.num_blocks, recompute=self.recompute)

    def link(self) -> Link:
        """The interconnect to plan with (None parts: as measured)."""
        return Link(bandwidth_bytes_per_s=self.link_bandwidth_bytes_per_s, latency_s=self.link_latency_s,
                    ranks_per_node=self.ranks_per_node)

    def work(self) -> PlanWork:
        """What simulating the grid's runnable points costs (points that cannot run are not simulated). A
        kept timeline simulates one more draw of the recommended point, left out here (a third of that
        point's share at most), so whether a grid is refused does not depend on pictures being asked for."""
        points, _ = grid_points(self.grid(), self.num_blocks)
        simulated = [simulated_actions(p, self.scatter) for p in points]
        held = [point_actions(p) for p in points]
        if not points:
            return PlanWork(simulated_actions=0, held_actions=0)
        index = max(range(len(points)), key=simulated.__getitem__)
        largest = max(BYTES_PER_GRAPH_ACTION * a + BYTES_PER_DRAWN_ACTION * s for a, s in zip(held, simulated, strict=True))
        return PlanWork(simulated_actions=sum(simulated), held_actions=sum(held), largest=points[index],
                        largest_held_bytes=largest)


def _count(value: int) -> str:
    for scale, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return str(value)
