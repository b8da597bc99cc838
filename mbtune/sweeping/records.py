"""The sweep's records: a point of the grid, what it measured, and the sweep's report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mbtune.checking.records import CheckResult
from mbtune.pipeline.point import SweepPoint
from mbtune.recordio import (
    Record,
)
from mbtune.records import (
    OK,
    Decision,
    DeviceInfo,
    IdleShares,
    MachineLoad,
    MachineState,
    NvmlSummary,
    Outcome,
    TimelineAction,
    frame,
    pct,
)


@dataclass(frozen=True, kw_only=True)
class LrAdvice(Record):
    """The learning rate a global batch implies: the reference batch's scaled by the rule (sweeping/lr.py)."""

    global_batch: int
    reference_batch: int  # the recipe's global batch, or the smallest one the sweep ran
    rule: str  # linear (SGD family) | square-root (Adam family)
    scale: float  # advised lr / the reference batch's lr
    lr: float | None = None  # the advised learning rate, where the recipe's (--lr) is known


@dataclass(frozen=True, kw_only=True)
class SkippedPoint(Record):
    """A grid point that was never spawned, and why."""

    point: SweepPoint
    reason: str


@dataclass(frozen=True, kw_only=True)
class PredictedPoint(Record):
    """A grid point the simulator's prediction left out of the race (sweeping/screen.py): what it was predicted
    to do, not a measurement."""

    point: SweepPoint
    samples_per_s: float  # predicted
    peak_memory_bytes: int | None = None  # predicted, on the busiest rank
    error: float  # the prediction's stated error: its largest miss on a measured point it had not seen
    reason: str  # why it was not measured


@dataclass(frozen=True, kw_only=True)
class PointResult(Outcome):
    """What one sweep point measured."""

    point: SweepPoint
    status: str
    error: str = ""
    step_times_s: tuple[float, ...] = ()
    step_time_median_s: float | None = None
    step_time_cv_pct: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    mfu_pct: float | None = None
    bubble_measured: float | None = None
    bubble_theoretical: float | None = None
    excess_idle_pct: float | None = None  # measured minus theoretical bubble: communication and imbalance
    bubble_unmeasured: str = ""  # why a point that ran has no measured bubble (the user's command)
    idle: IdleShares | None = None  # the measured bubble split into schedule, transfer and overhead
    peak_memory_bytes: tuple[int | None, ...] = ()  # per pipeline rank (the highest over data-parallel replicas)
    loss: float | None = None
    allreduce_s: float | None = None  # data parallel: median gradient all-reduce per step, inside the step time
    stage_blocks: tuple[tuple[int, ...], ...] = ()  # per model stage, the global blocks it held
    stage_imbalance: float | None = None  # slowest / fastest stage's compute over the measured steps
    nvml: NvmlSummary | None = None
    ran_as: str = ""
    warnings: tuple[str, ...] = ()
    timeline: tuple[TimelineAction, ...] = ()  # the actions of one measured step: the median one
    timeline_step: int = 0  # which measured step the timeline shows (index into step_times_s)
    wall_s: float = 0.0
    # Uncertainty. With repeats (fresh processes each), the range is over the repeats' medians; with one
    # run, over its measured steps. step_times_s then holds every repeat's steps, in order.
    num_repeats: int = 1
    repeat_step_time_medians_s: tuple[float, ...] = ()  # one per repeat that completed
    # Measured round-robin: the round each of those repeats ran in (points compared round by round, where the
    # machine's drift is shared); () where the point was measured on its own.
    repeat_rounds: tuple[int, ...] = ()
    samples_per_s_min: float | None = None
    samples_per_s_max: float | None = None
    bubble_measured_min: float | None = None
    bubble_measured_max: float | None = None
    load: MachineLoad | None = None
    # CUDA only: per measured step, the device's own time (CUDA events, origin to the step's last work,
    # slowest rank), beside the wall-clock step_times_s it can only be below.
    cuda_step_times_s: tuple[float, ...] = ()
    # Why a failed point failed: the rank named as the root cause, the blocks that rank holds, whose fault
    # it is (see ERROR_KINDS), and the last lines of that rank's traceback and stderr.
    failed_rank: int | None = None
    failed_blocks: tuple[int, ...] = ()
    error_kind: str = ""
    error_tail: str = ""
    # Under torchrun, per pipeline rank (replica 0), the node it ran on ("node 1 (hostname)"); () on one host.
    rank_nodes: tuple[str, ...] = ()
    # Measured until known (sweeping/stopping.py): the 95% interval of samples/s as half its width in % of
    # samples/s, what it was taken over, and why measuring stopped (known, time cap, most repeats, fixed,
    # failed, interrupted); repeats run again because other processes loaded the machine while they ran.
    ci_half_pct: float | None = None
    ci_basis: str = ""
    stopped: str = ""
    stopped_detail: str = ""  # why, where the race stopped it: "after 1 repeat, 31% below the best then, p < 0.05"
    busy_reruns: int = 0

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def samples_per_s_ci(self) -> tuple[float, float] | None:
        """The 95% interval of samples/s, or None where there is none."""
        if self.samples_per_s is None or self.ci_half_pct is None:
            return None
        half = self.samples_per_s * self.ci_half_pct / 100.0
        return self.samples_per_s - half, self.samples_per_s + half

    def crosses_nodes(self, rank: int, other: int) -> bool:
        """Whether a hand-over between these two pipeline ranks crossed a node boundary."""
        nodes = self.rank_nodes
        return max(rank, other) < len(nodes) and nodes[rank].split(" (")[0] != nodes[other].split(" (")[0]

    @property
    def max_peak_memory_bytes(self) -> int | None:
        known = [b for b in self.peak_memory_bytes if b is not None]
        return max(known) if known else None

    @property
    def compute_per_sample_s(self) -> float | None:
        """Busy compute seconds per sample, all ranks of all replicas together: the arithmetic efficiency of
        the micro-batch size with the bubble and the all-reduce taken out ((median step - all-reduce) x
        processes x (1 - measured bubble) / global batch)."""
        if self.step_time_median_s is None or self.bubble_measured is None:
            return None
        point = self.point
        busy = (self.step_time_median_s - (self.allreduce_s or 0.0)) * point.num_processes
        return busy * (1 - self.bubble_measured) / point.global_batch


@dataclass(frozen=True, kw_only=True)
class Balance(Record):
    """How a sweep split the blocks over stages: by compute-bearing parameters, or by block times measured
    once by a timing pass (forward + backward per block, the last with the loss) at one micro-batch size."""

    by: str = "parameters"  # parameters | time
    block_times_s: tuple[float, ...] = ()
    micro_batch_size: int | None = None  # what the timing pass ran


@dataclass(frozen=True, kw_only=True)
class SweepReport(Record):
    """A whole sweep: every point run, every point skipped, the ranking and the best."""

    __repr__ = Record.__repr__  # short: the dataclass one prints every trial and action
    def to_frame(self) -> Any:
        """A pandas DataFrame shaped for analysis."""
        stages = max((len(r.peak_memory_bytes) for r in self.results), default=0)
        order = list(self.ranking) + [i for i in range(len(self.results)) if i not in self.ranking]
        rows = []
        for index in order:
            r, p = self.results[index], self.results[index].point
            advice = self.advice_for(p.global_batch)
            load = r.load
            peaks = list(r.peak_memory_bytes) + [None] * (stages - len(r.peak_memory_bytes))
            rows.append({
                "rank": self.ranking.index(index) + 1 if index in self.ranking else None,
                "schedule": p.schedule, "num_ranks": p.num_ranks, "stages_per_rank": p.stages_per_rank,
                "num_micro_batches": p.num_micro_batches, "grad_accum_steps": p.grad_accum_steps,
                "data_parallel_size": p.data_parallel_size, "recompute": p.recompute,
                "micro_batch_size": p.micro_batch_size, "global_batch": p.global_batch,
                "lr_scale": advice.scale if advice else None, "lr": advice.lr if advice else None,
                "status": r.status, "num_repeats": r.num_repeats, "stopped": r.stopped,
                "stopped_detail": r.stopped_detail, "busy_reruns": r.busy_reruns,
                "samples_per_s": r.samples_per_s, "samples_per_s_ci_half_pct": r.ci_half_pct, "ci_basis": r.ci_basis,
                "samples_per_s_min": r.samples_per_s_min, "samples_per_s_max": r.samples_per_s_max,
                "tied_with_best": index in self.ties, "decision": self._standing(index), "pareto": index in self.pareto,
                "tokens_per_s": r.tokens_per_s, "step_time_median_s": r.step_time_median_s,
                "step_time_cv_pct": r.step_time_cv_pct, "allreduce_s": r.allreduce_s,
                "stage_imbalance": r.stage_imbalance,
                "bubble_measured_pct": pct(r.bubble_measured), "bubble_measured_min_pct": pct(r.bubble_measured_min),
                "bubble_measured_max_pct": pct(r.bubble_measured_max), "bubble_theoretical_pct": pct(r.bubble_theoretical),
                **{f"idle_{cause}_pct": pct(getattr(r.idle, cause)) if r.idle else None
                   for cause in ("schedule", "transfer", "overhead")},
                "peak_memory_bytes_max": r.max_peak_memory_bytes,
                **{f"peak_memory_bytes_stage{stage}": peak for stage, peak in enumerate(peaks)},
                "mfu_pct": r.mfu_pct, "load_avg_1m": load.load_avg_1m if load else None,
                "other_cpu_pct": pct(load.other_cpu_share) if load else None,
                "machine_busy": load.busy if load else None, "wall_s": r.wall_s, "error": r.error,
            })
        return frame(rows)

    workload: str
    workload_options: dict[str, Any] = field(default_factory=dict)
    device: DeviceInfo
    objective: str
    precision: str = "fp32"  # what every point trained with
    optimizer: str = "adamw"
    lr: float | None = None  # the learning rate trained with (None: not recorded, profiles before schema 3)
    results: tuple[PointResult, ...] = ()
    skipped: tuple[SkippedPoint, ...] = ()
    ranking: tuple[int, ...] = ()  # indices into results, best first (ok points only)
    pareto: tuple[int, ...] = ()  # indices of the throughput-vs-peak-memory Pareto front
    ties: tuple[int, ...] = ()  # indices a 95% test cannot tell from the best (tied with it)
    decision: Decision | None = None  # how decided the answer is (throughput objective)
    predicted: tuple[PredictedPoint, ...] = ()  # grid points left out of the race on their prediction, not measured
    machine_state: MachineState | None = None  # the machine's state while the sweep ran
    global_batches: tuple[int, ...] = ()  # held fixed, rows ranked within each; empty: the global batch varies
    global_batch_default: bool = False  # the global batch is the default rule's (config.default_global_batch)
    tradeoff: tuple[int, ...] = ()  # the best row and its neighbours in micro-batch size (grid.tradeoff)
    padding: tuple[int, ...] = ()  # (best, a row it beats by more micro-batches and fewer accumulation steps)
    # (without, with full recompute) per point that ran both ways (grid.recompute_pairs)
    recompute_pairs: tuple[tuple[int, int], ...] = ()
    balance: Balance = field(default_factory=Balance)
    ceiling: int | None = None  # from the probe, when one ran
    safe_batch: int | None = None
    ceiling_peak_memory_bytes: int | None = None  # the probe's peak at its ceiling, same measure as stage peaks
    warmup_steps: int = 1
    measured_steps: int = 3
    repeats: int | None = 1  # None: each point measured until known (its row says how it stopped)
    target_ci: float | None = None  # until known: the 95% interval's width aimed for, a share of samples/s
    strategy: str = "grid"  # grid: every runnable point; quick: the simulator picks (the rest are skipped)
    num_grid_points: int = 0
    interrupted: bool = False
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # what the run did that is worth knowing but not a problem
    lr_advice: tuple[LrAdvice, ...] = ()  # one per global batch that ran (sweeping/lr.py)
    check: CheckResult | None = None  # tune: the best row's update against the plain model's (checking/run.py)
    check_error: str = ""  # why that check could not run, where it could not
    command: tuple[str, ...] = ()  # the user's own training command that was swept (with its placeholders), if one was
    steps_from_output: str | None = None  # the line that counted its steps, where it was not torch's optimizer
    grid: tuple[tuple[str, tuple[str, ...]], ...] = ()  # the command's own settings it swept (--grid NAME=...)

    @property
    def best(self) -> PointResult | None:
        return self.results[self.ranking[0]] if self.ranking else None

    def _standing(self, index: int) -> str:
        """A row against the decision: best, equivalent (shown within the size), open (neither told apart nor
        shown within it), apart (told apart) or "" (no decision, or a row that did not run)."""
        decision = self.decision
        if decision is None or index not in self.ranking:
            return ""
        if index == self.ranking[0]:
            return "best"
        if self.global_batches and self.results[index].point.global_batch != self.results[self.ranking[0]].point.global_batch:
            return ""  # another global batch, another recipe: not compared
        return "equivalent" if index in decision.group else "open" if index in decision.open else "apart"

    def advice_for(self, global_batch: int) -> LrAdvice | None:
        """The learning-rate advice of one global batch, if the sweep ran it."""
        return next((a for a in self.lr_advice if a.global_batch == global_batch), None)
