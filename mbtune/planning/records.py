"""Records of the planner: the workload's block facts, the calibrated cost model, simulations, predictions,
validation against what really ran, plan reports and quick-search summaries. No torch import here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mbtune.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from mbtune.pipeline.point import SweepPoint
from mbtune.records import DeviceInfo, Record, TimelineAction, frame, pct
from mbtune.sweeping.records import PointResult, SkippedPoint

_COST_FIELD = {FORWARD: "forward_s", BACKWARD: "backward_s", BACKWARD_INPUT: "backward_input_s",
               BACKWARD_WEIGHT: "backward_weight_s"}

# How predictions treat the measured scatter of durations: draw costs from it, or use the average costs only.
SCATTER_MEASURED, SCATTER_NONE = "measured", "none"
SCATTER_MODES = (SCATTER_MEASURED, SCATTER_NONE)
BETWEEN_RUN, WITHIN_RUN = "between-run", "within-run"  # what a NoiseFloor compares


@dataclass(frozen=True, kw_only=True)
class OrderedAction(Record):
    """One compute action in a rank's schedule order: which stage does what to which micro-batch."""

    stage: int
    kind: str  # one of mbtune.actions.COMPUTE_KINDS
    microbatch: int


@dataclass(frozen=True, kw_only=True)
class LinearCost(Record):
    """seconds = fixed_s + per_sample_s x micro-batch size, the line; between the smallest and the largest size
    measured, the measured seconds themselves, joined by straight lines (a CPU's cost per sample can rise with
    the micro-batch as it outgrows the caches, which no line through the origin's side follows)."""

    fixed_s: float = 0.0
    per_sample_s: float = 0.0
    measured: tuple[tuple[int, float], ...] = ()  # (micro-batch size, seconds), ascending; () where not kept

    def at(self, micro_batch_size: int) -> float:
        """Seconds at this micro-batch size (never negative)."""
        table = self.measured
        if len(table) >= 2 and table[0][0] <= micro_batch_size <= table[-1][0]:
            for (low, low_s), (high, high_s) in zip(table, table[1:]):
                if low <= micro_batch_size <= high:
                    return max(0.0, low_s + (high_s - low_s) * (micro_batch_size - low) / (high - low))
        return max(0.0, self.fixed_s + self.per_sample_s * micro_batch_size)

    def scaled(self, factor: float) -> LinearCost:
        """Both terms (and what was measured) times `factor`."""
        return LinearCost(fixed_s=self.fixed_s * factor, per_sample_s=self.per_sample_s * factor,
                          measured=tuple((size, seconds * factor) for size, seconds in self.measured))

    def plus(self, other: LinearCost) -> LinearCost:
        """The cost of doing both."""
        sizes = sorted({size for size, _ in self.measured} | {size for size, _ in other.measured})
        return LinearCost(fixed_s=self.fixed_s + other.fixed_s, per_sample_s=self.per_sample_s + other.per_sample_s,
                          measured=tuple((size, self.at(size) + other.at(size)) for size in sizes))


@dataclass(frozen=True, kw_only=True)
class BlockFacts(Record):
    """What the planner knows about a workload's blocks without running them (read on the meta device).

    `weights` say how a stage's measured time is shared among its blocks (forward FLOPs per sample where
    they are countable, else parameters, else equal shares; `weight_source` says which)."""

    num_blocks: int
    parameters: tuple[int, ...]
    weights: tuple[float, ...]
    weight_source: str  # flops | parameters | equal
    output_bytes_per_sample: tuple[int, ...] = ()  # what block i sends to block i+1, per sample
    saved_bytes_per_sample: tuple[int, ...] = ()  # activations block i keeps for its backward, per sample
    # What the runner balances stages by: Workload.compute_weights, or the block times a sweep balanced by.
    split_weights: tuple[float, ...] = ()

    @property
    def balance_weights(self) -> tuple[float, ...] | None:
        """The weights split_blocks gets, exactly as the runner passes them (None: equal blocks)."""
        weights = self.split_weights or self.parameters
        return weights if any(weights) else None

    @classmethod
    def uniform(cls, num_blocks: int, *, parameters: int = 0, output_bytes_per_sample: int = 0,
                saved_bytes_per_sample: int = 0) -> BlockFacts:
        """Identical blocks (tests and what-if plans)."""
        return cls(num_blocks=num_blocks, parameters=(parameters,) * num_blocks, weights=(1.0,) * num_blocks,
                   weight_source="equal", output_bytes_per_sample=(output_bytes_per_sample,) * num_blocks,
                   saved_bytes_per_sample=(saved_bytes_per_sample,) * num_blocks)


@dataclass(frozen=True, kw_only=True)
class BlockCost(Record):
    """One block's compute per micro-batch, by action kind."""

    forward: LinearCost
    backward: LinearCost  # full backward (input and weight gradients)
    backward_input: LinearCost
    backward_weight: LinearCost


@dataclass(frozen=True, kw_only=True)
class StageCost(Record):
    """Seconds one stage spends per micro-batch on each action kind (the simulator's input)."""

    forward_s: float
    backward_s: float
    backward_input_s: float
    backward_weight_s: float
    loss_s: float = 0.0  # only on the last stage: added to its forward

    def of(self, kind: str) -> float:
        """Seconds of one action kind (forward | backward | backward_input | backward_weight)."""
        return getattr(self, _COST_FIELD[kind])


@dataclass(frozen=True, kw_only=True)
class Spread(Record):
    """How measured durations scatter around the fitted costs, as evenly spaced quantiles of measured /
    fitted: compute actions, stage-to-stage hand-overs, and a rank's gaps between actions. Empty: no scatter
    known (the simulation is then deterministic)."""

    compute: tuple[float, ...] = ()
    transfer: tuple[float, ...] = ()
    gap: tuple[float, ...] = ()

    @property
    def known(self) -> bool:
        return bool(self.compute or self.transfer or self.gap)


@dataclass(frozen=True, kw_only=True)
class CostModel(Record):
    """Per-block costs calibrated from measured timelines, plus the costs around the compute.

    Stage cost = sum of its blocks' costs. `send_s` is what a rank spends after an action whose result goes to
    another rank (posting the send), `gap_s` what it spends between other actions, `transfer` the latency of
    a stage-to-stage hand-over on the machine that was measured, `update` the optimizer step and barriers
    after the pipeline (fixed + per parameter of the rank), `start_s` the delay before the first action.
    Memory: a rank's peak = base_bytes + state_bytes_per_parameter x its parameters + in-flight activations.
    """

    workload: str
    workload_options: dict[str, Any] = field(default_factory=dict)
    device: str = ""
    blocks: tuple[BlockCost, ...]
    facts: BlockFacts
    loss: LinearCost
    transfer: LinearCost
    send_s: float = 0.0
    gap_s: float = 0.0
    start_s: float = 0.0
    update_fixed_s: float = 0.0
    update_per_parameter_s: float = 0.0
    base_bytes: float = 0.0
    state_bytes_per_parameter: float = 16.0
    micro_batch_sizes: tuple[int, ...] = ()  # the sizes that were measured
    num_points: int = 0
    split_backward_measured: bool = False  # False: input/weight parts assumed half of the full backward each
    spread: Spread = field(default_factory=Spread)
    notes: tuple[str, ...] = ()
    # Data parallel: ring all-reduce volume per second (planner.allreduce_volume_bytes over the measured
    # all-reduce), the median over the measured data-parallel points; None where none was measured.
    allreduce_bytes_per_s: float | None = None
    allreduce_points: int = 0
    # Hand-overs that crossed a node boundary (torchrun across nodes), fitted apart from `transfer`; None
    # where none was measured.
    inter_node_transfer: LinearCost | None = None
    inter_node_samples: int = 0


@dataclass(frozen=True, kw_only=True)
class Simulation(Record):
    """One simulated optimizer step's pipeline part: when every action ran, and what follows from it."""

    pipeline_s: float  # first action start to last action end, every accumulation step included
    busy_s: tuple[float, ...]  # per rank
    bubble: float  # 1 - sum(busy) / (ranks x pipeline_s), the measured bubble's definition
    peak_in_flight: tuple[int, ...]  # per stage: most micro-batches whose activations were held at once
    timeline: tuple[TimelineAction, ...] = ()
    seed: int | None = None  # the scatter draw simulated (None: average costs)


@dataclass(frozen=True, kw_only=True)
class Prediction(Record):
    """What the simulator predicts for one configuration."""

    point: SweepPoint
    blocks_per_stage: tuple[int, ...]
    step_time_s: float
    pipeline_s: float
    allreduce_s: float
    update_s: float
    samples_per_s: float
    tokens_per_s: float | None = None
    bubble: float
    bubble_theoretical: float
    peak_in_flight: tuple[int, ...]  # per stage
    stage_memory_bytes: tuple[float, ...] = ()  # per stage: parameter state + peak in-flight activations
    memory_bytes: tuple[float, ...]  # per rank: the runtime's base + every stage it holds
    memory_limit_bytes: float | None = None
    fits: bool | None = None  # None when no limit is known
    timeline: tuple[TimelineAction, ...] = ()
    seed: int | None = None  # the scatter draw whose simulated step is the prediction (None: average costs)
    lost_because: str = ""  # in a ranking, the part of its step time that lost most to the first's

    @property
    def max_memory_bytes(self) -> float:
        """The busiest rank's predicted memory."""
        return max(self.memory_bytes) if self.memory_bytes else 0.0

    @property
    def binding_rank(self) -> int | None:
        """The rank whose memory binds (the busiest)."""
        return max(range(len(self.memory_bytes)), key=self.memory_bytes.__getitem__) if self.memory_bytes else None

    @property
    def num_blocks(self) -> int:
        """Blocks of the model this point was predicted for (a deepened one where the workload had too few)."""
        return sum(self.blocks_per_stage)


@dataclass(frozen=True, kw_only=True)
class ValidationRow(Record):
    """Predicted against measured for one point that really ran."""

    point: SweepPoint
    measured_step_s: float
    predicted_step_s: float
    step_error: float  # (predicted - measured) / measured
    measured_bubble: float | None
    predicted_bubble: float
    bubble_error: float | None  # predicted - measured, in fractions of the step (not relative)
    measured_samples_per_s: float | None = None
    predicted_samples_per_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class NoiseFloor(Record):
    """How far a point's measured step time moves when nothing about the point changes: an error this size
    cannot be told apart from the measurement's own noise.

    between-run: for each point with two or more repeats (fresh processes each), (max - min) / median of the
    repeats' median step times (for a pair, |a - b| / their mean). within-run: (max - min) / median of one
    run's measured steps, all the data holds without repeats; it leaves out what changes between processes,
    so it understates the between-run floor. Median and worst over the points."""

    kind: str  # between-run | within-run
    median: float
    worst: float
    num_points: int


@dataclass(frozen=True, kw_only=True)
class Validation(Record):
    """How well the calibrated simulator reproduces the points the sweep measured."""

    method: str  # in-sample | leave-one-out
    rows: tuple[ValidationRow, ...] = ()
    median_step_error: float | None = None  # of |relative error|
    worst_step_error: float | None = None
    median_bubble_error: float | None = None  # of |predicted - measured|
    worst_bubble_error: float | None = None
    noise_floor: NoiseFloor | None = None  # of the measured step times the errors are against
    scatter: str = SCATTER_MEASURED  # measured: predictions drew costs from the measured scatter; none: average costs

    @property
    def within_noise_floor(self) -> bool | None:
        """Whether the median error is no larger than the median noise floor (None when either is unknown)."""
        if self.median_step_error is None or self.noise_floor is None:
            return None
        return self.median_step_error <= self.noise_floor.median


@dataclass(frozen=True, kw_only=True)
class PlanReport(Record):
    """Ranked predictions for configurations beyond this machine, and the one recommended."""

    workload: str
    workload_options: dict[str, Any] = field(default_factory=dict)
    device: DeviceInfo | None = None
    model: CostModel  # before any per-point deepening (see Prediction.num_blocks)
    num_blocks: int  # the model's blocks: the workload's own, or --blocks
    scatter: str = SCATTER_MEASURED  # measured: costs drawn from the measured scatter; none: average costs only
    per_sample_memory: bool = True  # False: activations per sample left out (the probe could not resolve them)
    link_bandwidth_bytes_per_s: float | None = None
    link_latency_s: float | None = None
    ranks_per_node: int | None = None
    memory_limit_bytes: float | None = None
    memory_limit_source: str = ""  # what the limit is (the probe's peak at its ceiling, ...)
    predictions: tuple[Prediction, ...] = ()  # best first: fitting ones by throughput, then the rest
    skipped: tuple[SkippedPoint, ...] = ()
    recommended: int | None = None  # index into predictions
    validation: Validation | None = None  # the simulator against the points the profile's sweep ran
    warnings: tuple[str, ...] = ()
    recommended_timeline: tuple[TimelineAction, ...] = ()  # simulated, where the plan was asked to keep it
    num_gpus: int | None = None  # a cluster plan (plan --gpus): every split of this many GPUs
    num_candidates: int = 0  # a cluster plan's configurations estimated
    num_simulated: int = 0  # ... and those simulated
    estimated_for: str = ""  # a device the times were scaled to by peak FLOP/s (an estimate); "": as profiled

    def to_frame(self) -> Any:
        """A pandas DataFrame of the predictions, ranked, shaped for analysis."""
        return frame({
            "rank": i + 1, "schedule": p.point.schedule, "num_blocks": p.num_blocks, "num_ranks": p.point.num_ranks,
            "stages_per_rank": p.point.stages_per_rank, "num_micro_batches": p.point.num_micro_batches,
            "micro_batch_size": p.point.micro_batch_size, "data_parallel_size": p.point.data_parallel_size,
            "global_batch": p.point.global_batch, "samples_per_s": p.samples_per_s, "step_time_s": p.step_time_s,
            "bubble_pct": pct(p.bubble), "bubble_theoretical_pct": pct(p.bubble_theoretical),
            "memory_bytes_max": p.max_memory_bytes, "fits": p.fits, "recommended": i == self.recommended,
            "scatter": self.scatter, "grad_accum_steps": p.point.grad_accum_steps,
            "recompute": p.point.recompute, "allreduce_s": p.allreduce_s, "binding_rank": p.binding_rank,
            "lost_because": p.lost_because,
        } for i, p in enumerate(self.predictions))

    @property
    def best(self) -> Prediction | None:
        """The recommended prediction, if any fits."""
        return self.predictions[self.recommended] if self.recommended is not None else None


@dataclass(frozen=True, kw_only=True)
class QuickRound(Record):
    """One round of the quick strategy: which points it ran and the best it knew afterwards."""

    ran: tuple[SweepPoint, ...]
    best_samples_per_s: float | None
    best_predicted_unrun_samples_per_s: float | None


@dataclass(frozen=True, kw_only=True)
class QuickResult(Record):
    """What the quick strategy ran (in order), how much of the grid that was, and why it stopped."""

    results: tuple[PointResult, ...]
    num_grid_points: int
    fraction_run: float
    best: int | None  # index into results
    rounds: tuple[QuickRound, ...] = ()
    stopped_because: str = ""
    unrun: tuple[SweepPoint, ...] = ()  # the grid points it left out
    unrun_predicted_samples_per_s: tuple[float | None, ...] = ()  # what the final model predicts for them
