"""The sweep's settings (SweepConfig) and its defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mbtune.errors import ConfigError
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.theory import DEFAULT_STAGES_PER_RANK
from mbtune.settings import (
    DEFAULT_LOAD_TIMEOUT_S,
    DEFAULT_TRIAL_TIMEOUT_S,
    MAX_BUDGET_BYTES,
    MAX_COUNT,
    MAX_PROCESSES,
    MAX_SAMPLES,
    OPTIMIZERS,
    STRATEGIES,
    as_tuple,
    bound_load_timeout,
    check_at_most,
    check_lr,
    check_recompute_modes,
    check_seed,
    check_timeout,
)
from mbtune.sweeping.equivalence import DEFAULT_EQUIVALENCE
from mbtune.sweeping.stopping import default_repeats
from mbtune.units import parse_device
from mbtune.validation import check_types, require_unique
from mbtune.validation import require as _require

if TYPE_CHECKING:
    from mbtune.pipeline.nodes import Nodes


DEFAULT_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


OBJECTIVES = ("throughput", "memory", "bubble")

DEFAULT_TIME_BUDGET_S = 90.0  # the sweep's measuring, from its first point (every point is measured once even past it)


BALANCES = ("parameters", "time")  # how a sweep splits blocks over stages (--balance params | time)


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """Settings of `mbtune sweep` (and the sweep half of `mbtune tune`)."""

    workload: str = "gpt"
    workload_options: tuple[tuple[str, int | float | str], ...] = ()
    device: str = "auto"
    num_ranks: int = 2
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    micro_batches: tuple[int, ...] | None = None  # default: p, 2p, 4p
    grad_accum_steps: tuple[int, ...] = (1, 2)
    micro_batch_size: tuple[int, ...] | None = None  # fixed sizes (the global batch then varies)
    global_batch: tuple[int, ...] | None = None  # held fixed, each split every way the grid allows
    data_parallel_size: tuple[int, ...] = (1,)  # replicas of the pipeline (world = stages x replicas processes)
    recompute: tuple[str, ...] = ("none",)  # activation recompute modes, one point each
    balance: str = "parameters"  # stages split by compute-bearing parameters, or by measured block time
    safe_batch: int | None = None  # from a probe: micro-batch sizes above it are skipped
    recompute_safe_batch: int | None = None  # the probe's with full recompute (bounds those points instead)
    ceiling: int | None = None
    ceiling_peak_memory_bytes: int | None = None
    stages_per_rank: int = DEFAULT_STAGES_PER_RANK
    warmup_steps: int = 1
    measured_steps: int = 3
    # Each point run this many times in fresh processes (None: until known; the default is MBTUNE_REPEATS's).
    repeats: int | None = field(default_factory=default_repeats)
    # Until known (sweeping/stopping.py): repeats until the 95% interval of samples/s is at most target_ci
    # wide (a share of it), or the next repeat would pass max_time_per_point_s.
    target_ci: float = 0.05
    max_time_per_point_s: float = 10.0
    # Raced (races): the seconds the sweep's measuring may take in all (None: no limit). Every point is measured
    # once whatever it says; after that, repeats go where they decide the most until it runs out.
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S
    # Race the grid (sweeping/race.py): after one repeat each, repeats only for the points still tied with the
    # best; False: every point until known.
    race: bool = True
    # Equal is an answer (sweeping/equivalence.py): rows whose throughput a 95% equivalence test shows within this
    # share of the best one's are equivalent to it.
    equivalence: float = DEFAULT_EQUIVALENCE
    # Raced: measure every point of the grid (True), or a few first, then only those the simulator's prediction
    # cannot rule out (sweeping/screen.py).
    measure_all: bool = False
    # Every repeat in processes of its own (True), or the ranks' processes kept between repeats and points
    # (pipeline/warm.py), started afresh after a failure or where the placement changes.
    fresh_processes: bool = False
    # Measure for a baseline (qualify --baseline): every point until known at qualify's precision, no race.
    as_baseline: bool = False
    pin_cpus: bool = True  # on the CPU, each rank process on its own cores (pipeline/rank_device.py)
    optimizer: str = "adamw"
    precision: str = "fp32"
    threads: int | None = None
    point_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    objective: str = "throughput"
    strategy: str = "grid"
    seed: int = 0
    lr: float | None = None  # trains with it (None: the optimizer's default); with reference_batch, the recipe's
    reference_batch: int | None = None  # the recipe's global batch: each row's advised lr is scaled from it
    points: tuple[SweepPoint, ...] | None = None  # run exactly these (qualification re-runs a baseline's)
    command_line: str = ""
    extra_warnings: tuple[str, ...] = field(default=(), compare=False)  # what reading a saved probe noted
    # Who starts each point's ranks: mbtune's own launcher on this host, or torch.distributed.run's elastic
    # agent (pipeline/torchrun.py), on this host or on nnodes hosts meeting at rdzv_endpoint.
    launcher: str = "local"
    nnodes: int | None = None  # None: the scheduler's, under torchrun (pipeline/nodes.py launch_nodes); else 1
    node_rank: int | None = None  # None: the scheduler's, under torchrun; else 0
    rdzv_endpoint: str | None = None
    join_timeout_s: float = 60.0
    # The user's own training command, for a job that pipelines with its own code: swept as it is, its
    # placeholders filled from each point (sweeping/command.py), instead of a workload mbtune splits.
    command: tuple[str, ...] = ()
    name: str | None = None  # a command's name in the profile (default: its script's name)
    steps_from_output: str | None = None  # a line the command prints once a step (probing/command.py)
    # More of the command's own settings to sweep (--grid NAME=v1,v2): each fills the command's {NAME}.
    grid: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # A command's points run under this cap (a tune's probed budget: a point past it is an out-of-memory row);
    # None: the whole device, where the cap only counts what each process held.
    memory_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        from mbtune.pipeline.theory import SCHEDULE_NAMES

        for name in ("global_batch", "micro_batch_size", "data_parallel_size", "recompute"):
            as_tuple(self, name)
        if self.grid:  # NAME=v1,v2 items or a mapping, as the field holds them (sweeping/command.py)
            from mbtune.sweeping.command import check_grid

            object.__setattr__(self, "grid", check_grid(self.grid))
        check_types(self)
        check_recompute_modes(self.recompute)
        object.__setattr__(self, "device", parse_device(self.device))
        _require(self.num_ranks >= 1, "num_ranks", self.num_ranks, "an integer >= 1")
        for name in ("schedules", "micro_batches", "grad_accum_steps", "global_batch", "micro_batch_size",
                     "data_parallel_size", "recompute"):
            require_unique(getattr(self, name), name)
        _require(bool(self.schedules), "schedules", self.schedules, "at least one schedule")
        unknown = [s for s in self.schedules if s not in SCHEDULE_NAMES]
        _require(not unknown, "schedules", ",".join(unknown), " | ".join(SCHEDULE_NAMES))
        _require(self.micro_batches is None or (bool(self.micro_batches) and min(self.micro_batches) >= 1),
                 "micro_batches", self.micro_batches, "integers >= 1")
        _require(bool(self.grad_accum_steps) and min(self.grad_accum_steps) >= 1, "grad_accum_steps", self.grad_accum_steps,
                 "integers >= 1")
        if self.micro_batch_size is not None and self.global_batch is not None:
            raise ConfigError("--micro-batch-size and --global-batch both given",
                              hint="Give one: the other follows from micro-batches and accumulation steps.")
        for name in ("safe_batch", "recompute_safe_batch", "ceiling"):
            value = getattr(self, name)
            _require(value is None or value >= 1, name, value, "an integer >= 1")
        for name in ("global_batch", "micro_batch_size"):
            value = getattr(self, name)
            _require(value is None or (bool(value) and min(value) >= 1), name, value, "integers >= 1")
        _require(bool(self.data_parallel_size) and min(self.data_parallel_size) >= 1, "data_parallel_size", self.data_parallel_size,
                 "integers >= 1")
        _require(self.stages_per_rank >= 2, "stages_per_rank", self.stages_per_rank, "an integer >= 2")
        _require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        _require(self.measured_steps >= 1, "measured_steps", self.measured_steps, "an integer >= 1")
        _require(self.repeats is None or self.repeats >= 1, "repeats", self.repeats, "an integer >= 1")
        _require(0 < self.target_ci < 1, "target_ci", self.target_ci, "a share between 0% and 100%")
        _require(0 < self.equivalence < 0.5, "equivalence", self.equivalence, "a share between 0% and 50%, e.g. 3%")
        _require(self.max_time_per_point_s > 0, "max_time_per_point_s", self.max_time_per_point_s, "a duration > 0")
        _require(self.time_budget_s is None or self.time_budget_s > 0, "time_budget_s", self.time_budget_s,
                 "a duration > 0")
        if self.as_baseline:  # what qualify --baseline measures to: every point known, none raced, no budget
            from mbtune.sweeping.stopping import DEFAULT_TOLERANCE, QUALIFY_MAX_TIME_PER_POINT_S, qualify_target_ci

            object.__setattr__(self, "target_ci", min(self.target_ci, qualify_target_ci(DEFAULT_TOLERANCE)))
            object.__setattr__(self, "max_time_per_point_s", max(self.max_time_per_point_s, QUALIFY_MAX_TIME_PER_POINT_S))
            object.__setattr__(self, "time_budget_s", None)
        _require(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, " | ".join(OPTIMIZERS))
        _require(self.precision in ("fp32", "bf16"), "precision", self.precision,
                 "fp32 | bf16 for pipelined steps (fp16 would need one loss scale across all ranks)")
        _require(self.threads is None or self.threads >= 1, "threads", self.threads, ">= 1")
        check_at_most(self, MAX_SAMPLES, "micro_batch_size", "global_batch", "safe_batch", "recompute_safe_batch",
                      "ceiling", "reference_batch")
        _require(self.memory_budget_bytes is None or self.memory_budget_bytes > 0, "memory_budget_bytes",
                 self.memory_budget_bytes, "a size above zero")
        check_at_most(self, MAX_BUDGET_BYTES, "memory_budget_bytes")
        check_at_most(self, MAX_COUNT, "micro_batches", "grad_accum_steps", "warmup_steps", "measured_steps", "repeats")
        check_at_most(self, MAX_PROCESSES, "num_ranks", "data_parallel_size", "stages_per_rank", "threads")
        check_seed(self.seed)
        check_timeout(self.point_timeout_s, "point_timeout_s")
        check_timeout(self.load_timeout_s, "load_timeout_s")
        bound_load_timeout(self, self.point_timeout_s)
        _require(self.objective in OBJECTIVES, "objective", self.objective, " | ".join(OBJECTIVES))
        _require(self.strategy in STRATEGIES, "strategy", self.strategy, " | ".join(STRATEGIES))
        if self.balance == "params":
            object.__setattr__(self, "balance", "parameters")
        _require(self.balance in BALANCES, "balance", self.balance, "params | time")
        check_lr(self.lr)
        _require(self.reference_batch is None or self.reference_batch >= 1, "reference_batch", self.reference_batch,
                 "an integer >= 1")
        from mbtune.pipeline.nodes import launch_nodes

        nodes = launch_nodes(self.launcher, nnodes=self.nnodes, node_rank=self.node_rank, endpoint=self.rdzv_endpoint,
                             join_timeout_s=self.join_timeout_s)
        object.__setattr__(self, "nnodes", nodes.nnodes)
        object.__setattr__(self, "node_rank", nodes.node_rank)
        object.__setattr__(self, "rdzv_endpoint", nodes.endpoint)
        self._check_command()

    def _check_command(self) -> None:
        if isinstance(self.command, list):
            object.__setattr__(self, "command", tuple(self.command))
        if not self.command:
            for name in ("steps_from_output", "grid"):
                if getattr(self, name):
                    raise ConfigError(f"{name} is for a sweep of your own command, and there is none", field=name,
                                      hint="Give the command after --.")
            return
        from mbtune.probing.command import command_name, step_line
        from mbtune.sweeping.command import check_sweep_template

        object.__setattr__(self, "command", check_sweep_template(self.command, tuple(n for n, _ in self.grid)))
        object.__setattr__(self, "workload", self.name or command_name(self.command))
        if self.steps_from_output is not None:
            step_line(self.steps_from_output)
        for name, value, why in (("strategy", "quick", "the simulator's pick needs a workload mbtune splits"),
                                 ("balance", "time", "the command splits its model itself"),
                                 ("launcher", "torchrun", "the command starts its own processes (write torchrun "
                                                          "in it)")):
            if getattr(self, name) == value:
                raise ConfigError(f"{name} {value} does not go with a command: {why}", field=name,
                                  hint=f"Leave --{name} out.")

    @property
    def races(self) -> bool:
        """Whether the grid is raced (sweeping/race.py): measured until known, ranked by throughput, the grid's
        own points (not a baseline's to re-measure, not the quick strategy's pick), not made for a baseline."""
        return (self.race and self.repeats is None and self.objective == "throughput" and self.points is None
                and self.strategy == "grid" and not self.as_baseline)

    @property
    def screens(self) -> bool:
        """Whether a raced grid measures a few points first and races only those the simulator's prediction cannot
        rule out (sweeping/screen.py): not with measure_all, not for a command (the simulator needs the blocks
        mbtune splits)."""
        return self.races and not self.measure_all and not self.command

    @property
    def nodes(self) -> Nodes:
        """The hosts this sweep's ranks run on (pipeline/torchrun.py)."""
        from mbtune.pipeline.nodes import Nodes

        assert self.nnodes is not None and self.node_rank is not None, "filled in by __post_init__"
        return Nodes(nnodes=self.nnodes, node_rank=self.node_rank, endpoint=self.rdzv_endpoint,
                     join_timeout_s=self.join_timeout_s)

    @property
    def launch(self) -> Nodes | None:
        """The nodes a torchrun launch spans (one or more); None for mbtune's own launcher on this host."""
        return self.nodes if self.launcher == "torchrun" else None

    def safe_batch_for(self, recompute: str) -> int | None:
        """The probed safe batch that bounds a point's micro-batch size: with full recompute, the probe's
        with it where one ran."""
        if recompute == "full" and self.recompute_safe_batch is not None:
            return self.recompute_safe_batch
        return self.safe_batch

    @property
    def micro_batch_counts(self) -> tuple[int, ...]:
        p = self.num_ranks
        return self.micro_batches or tuple(sorted({p, 2 * p, 4 * p}))

    @property
    def global_batches(self) -> tuple[int, ...]:
        """The global batches held fixed: the given ones; else, with a probed safe batch and no fixed
        micro-batch size, the one the default rule picks (default_global_batch); else none (the micro-batch
        size is fixed and the global batch varies from point to point)."""
        if self.global_batch is not None:
            return self.global_batch
        if self.micro_batch_size is None and self.safe_batch is not None:
            return (default_global_batch(self.safe_batch, self.micro_batch_counts, self.grad_accum_steps,
                                         self.data_parallel_size),)
        return ()


def default_global_batch(safe_batch: int, micro_batch_counts: tuple[int, ...], grad_accum_steps: tuple[int, ...],
                         data_parallel_size: tuple[int, ...] = (1,)) -> int:
    """The global batch a sweep holds fixed by default: the largest power of two that the fewest
    micro-batches, accumulation steps and replicas of the grid hold at the probed safe batch. Every
    (micro-batches, accumulation, replicas) combination of powers of two then splits it with a micro-batch
    size within the safe batch."""
    most = safe_batch * min(micro_batch_counts) * min(grad_accum_steps) * min(data_parallel_size)
    return 1 << (most.bit_length() - 1)
