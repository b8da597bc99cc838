"""What a pipelined run returns: per-rank reports, the action timeline, and the measured bubble. No torch import.

Times are time.perf_counter seconds relative to the start of the optimizer step they belong to; every rank
starts a step right after the same barrier, so the ranks' clocks agree to within the barrier's skew. On CUDA
action times come from CUDA events measured from an event recorded at that same origin.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mbtune.actions import find_input, input_stage
from mbtune.records import OK, IdleShares, Record


@dataclass(frozen=True, kw_only=True)
class ActionRecord(Record):
    """One compute action of one stage on one micro-batch."""

    step: int  # measured optimizer step, from 0
    accum: int  # pipeline step inside the optimizer step, from 0
    stage: int
    kind: str  # one of mbtune.actions.ACTION_KINDS
    microbatch: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, kw_only=True)
class StageReport(Record):
    """Everything one rank measured. Step lists cover the measured steps only, unless named warmup."""

    rank: int  # pipeline rank, within its replica
    num_ranks: int
    device: str
    stage_indices: tuple[int, ...]
    block_indices: tuple[tuple[int, ...], ...]  # per local stage, global block indices
    num_parameters: int
    step_times_s: tuple[float, ...]  # whole optimizer step, barrier to barrier
    pipeline_times_s: tuple[float, ...]  # the grad_accum_steps schedule steps only, barrier to barrier
    warmup_step_times_s: tuple[float, ...] = ()
    actions: tuple[ActionRecord, ...] = ()
    losses: tuple[float, ...] = ()  # per measured step; only on the rank that holds the last stage
    peak_memory_bytes: int | None = None
    memory_source: str = ""  # cuda_max_allocated | cpu_tensor_bytes
    output_dtype: str = ""  # dtype of the last stage's output (evidence of autocast), on that rank only
    grads: dict[str, Any] | None = None  # "<block>.<param>" -> CPU tensor, the last step's before the update
    # CUDA only: per measured step, the device's own time (events) from the step's origin to the end of its
    # last work, without the closing barrier; at most the wall-clock step time.
    cuda_step_times_s: tuple[float, ...] = ()
    # time.time() as the first measured step started and as the last one ended (the parent keeps only the
    # NVML samples taken in between).
    measured_window_unix_s: tuple[float, float] | None = None
    cpu_time_s: float | None = None  # this rank process's CPU time over its whole life
    device_uuid: str | None = None  # CUDA: the GPU this rank ran on ("GPU-..."), as NVML names it
    replica: int = 0  # which data-parallel replica of the pipeline
    # Data parallel only: per measured step, (start, end) of the gradient all-reduce from the step's origin.
    allreduce_spans_s: tuple[tuple[float, float], ...] = ()
    node: str = ""  # under torchrun, the node this rank ran on ("node 1 (hostname)")
    cores: tuple[int, ...] = ()  # the CPU cores this rank process was pinned to (none: not pinned)
    # `mbtune check` only: every tensor its stages sent or received across a boundary (pipeline/handover.py)
    crossings: tuple[Any, ...] = ()

    @property
    def allreduce_times_s(self) -> tuple[float, ...]:
        return tuple(end - start for start, end in self.allreduce_spans_s)

    @property
    def loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    def busy_s(self, step: int | None = None) -> float:
        """Compute time of this rank's actions, in one measured step or all of them."""
        return sum(a.duration_s for a in self.actions if step is None or a.step == step)


@dataclass(frozen=True, kw_only=True)
class PipelineOutcome(Record):
    """How one pipelined point ended: ok with every rank's report, or error / timeout / killed with why."""

    status: str
    reports: tuple[StageReport, ...] = ()
    error: str = ""  # one line
    error_detail: str = ""  # the last lines of the failing rank's traceback and stderr, when there are any
    wall_s: float = 0.0
    exit_codes: tuple[int | None, ...] = ()  # per rank; negative: killed by that signal
    pids: tuple[int, ...] = ()  # per rank; reaped by the time the outcome exists, unless kept (pipeline/warm.py)
    fresh_processes: bool = True  # False: the ranks ran an earlier point before this one (pipeline/warm.py)
    failed_rank: int | None = None  # the rank named as the root cause of a failure
    failed_blocks: tuple[int, ...] = ()  # the global block indices that rank holds (as far as it got)
    error_kind: str = ""  # workload | harness when the point failed (see records.ERROR_KINDS)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def pipeline_reports(self) -> tuple[StageReport, ...]:
        """The reports of one pipeline (replica 0), by pipeline rank: what the bubble, the idle shares and
        the timeline are read from (every replica runs the same schedule on its own samples)."""
        return tuple(sorted((r for r in self.reports if r.replica == 0), key=lambda r: r.rank))

    @property
    def peak_memory_bytes(self) -> tuple[int | None, ...]:
        """Per pipeline rank, the highest peak over the replicas (None where one did not say)."""
        peaks: dict[int, list[int | None]] = defaultdict(list)
        for report in self.reports:
            peaks[report.rank].append(report.peak_memory_bytes)
        return tuple(None if None in found else max(p for p in found if p is not None)
                     for _, found in sorted(peaks.items()))

    @property
    def allreduce_times_s(self) -> tuple[float, ...]:
        """Data parallel only: per measured step, the slowest rank's gradient all-reduce; () without."""
        if not self.reports or not all(r.allreduce_spans_s for r in self.reports):
            return ()
        return tuple(max(times) for times in zip(*(r.allreduce_times_s for r in self.reports)))

    @property
    def step_times_s(self) -> tuple[float, ...]:
        """Per measured step, the slowest rank's view (they differ only by barrier skew)."""
        if not self.reports:
            return ()
        return tuple(max(times) for times in zip(*(r.step_times_s for r in self.reports)))

    @property
    def cuda_step_times_s(self) -> tuple[float, ...]:
        """CUDA only: per measured step, the slowest rank's device time (see StageReport); () elsewhere."""
        if not self.reports or not all(r.cuda_step_times_s for r in self.reports):
            return ()
        return tuple(max(times) for times in zip(*(r.cuda_step_times_s for r in self.reports)))

    @property
    def measured_window_unix_s(self) -> tuple[float, float] | None:
        """time.time() from the first rank's start of the measured steps to the last rank's end."""
        windows = [r.measured_window_unix_s for r in self.reports if r.measured_window_unix_s is not None]
        if not windows:
            return None
        return min(w[0] for w in windows), max(w[1] for w in windows)

    @property
    def rank_cpu_time_s(self) -> float | None:
        """The CPU time of all rank processes together; None unless every rank reported its own."""
        times = [r.cpu_time_s for r in self.reports if r.cpu_time_s is not None]
        if not self.reports or len(times) < len(self.reports):
            return None
        return sum(times)

    @property
    def pinned_cores(self) -> tuple[tuple[int, ...], ...]:
        """The cores each rank was pinned to, in report order (empty where none was pinned)."""
        cores = tuple(r.cores for r in self.reports)
        return cores if any(cores) else ()

    @property
    def device_uuids(self) -> tuple[str, ...]:
        """The GPUs the ranks ran on, in rank order (empty on the CPU)."""
        return tuple(r.device_uuid for r in self.reports if r.device_uuid)

    @property
    def loss(self) -> float | None:
        """The optimizer step's loss: the sum over the replicas' last stages (each replica's loss is already
        divided by the replicas, so the sum is the global batch's mean)."""
        losses = [r.loss for r in self.reports if r.loss is not None]
        return sum(losses) if losses else None

    @property
    def measured_bubble(self) -> float | None:
        return bubble_from_reports(self.pipeline_reports)

    @property
    def idle_shares(self) -> IdleShares | None:
        return idle_shares(self.pipeline_reports)


def measured_bubble(busy_s_by_rank: Sequence[float], wall_s: float) -> float:
    """1 - (sum of busy compute time over ranks) / (ranks x wall time), clipped to [0, 1]."""
    if not busy_s_by_rank or wall_s <= 0:
        raise ValueError("need at least one rank and a positive wall time")
    fraction = 1.0 - sum(busy_s_by_rank) / (len(busy_s_by_rank) * wall_s)
    return min(1.0, max(0.0, fraction))


def bubble_from_reports(reports: Sequence[StageReport]) -> float | None:
    """Measured bubble over all measured steps: busy action time against the pipeline part of each step
    (the optimizer update is outside it); None without reports or timeline."""
    if not reports or not any(r.actions for r in reports):
        return None
    wall_s = sum(max(times) for times in zip(*(r.pipeline_times_s for r in reports)))
    if wall_s <= 0:
        return None
    return measured_bubble([r.busy_s() for r in reports], wall_s)


def idle_shares(reports: Sequence[StageReport]) -> IdleShares | None:
    """Split every rank's idle time in the measured steps by what it waited for (see IdleShares).

    Each idle stretch ends at an action. Where that action needs another rank's result (a forward the
    previous stage's output, a backward the next stage's gradient), the stretch up to the moment the
    producer finished is schedule and the rest transfer; where it needs nothing remote, it is overhead.
    After a rank's last action it is schedule (the drain). Ranks leave each step's barrier a little apart, so
    their clocks are first aligned per step: a hand-over to an idle rank takes about as long both ways, so
    half the difference of the shortest hand-over each way is the offset (as NTP estimates it).
    None without a timeline.
    """
    if not reports or not any(r.actions for r in reports):
        return None
    owner = {stage: r.rank for r in reports for stage in r.stage_indices}
    last_stage = max(owner)
    walls = [max(times) for times in zip(*(r.pipeline_times_s for r in reports))]
    totals = {"schedule": 0.0, "transfer": 0.0, "overhead": 0.0}
    for step, wall in enumerate(walls):
        actions = [(r.rank, a) for r in reports for a in r.actions if a.step == step]
        done = {(a.kind, a.stage, a.accum, a.microbatch): (rank, a.end_s) for rank, a in actions}
        clock = _clock_origins(actions, done, owner, last_stage)
        by_rank: dict[int, list[ActionRecord]] = defaultdict(list)
        for rank, a in actions:
            by_rank[rank].append(a)
        for rank in {r.rank for r in reports}:
            free = 0.0
            for a in sorted(by_rank[rank], key=lambda a: a.start_s):
                gap = max(0.0, a.start_s - free)
                producer = _remote_input(a, done, owner, last_stage, rank)
                if producer is None:
                    totals["overhead"] += gap
                else:
                    sender, end_s = producer
                    ready = end_s + clock[sender] - clock[rank]  # the producer's end on this rank's clock
                    waiting = min(gap, max(0.0, ready - free))
                    totals["schedule"] += waiting
                    totals["transfer"] += gap - waiting
                free = max(free, a.end_s)
            totals["schedule"] += max(0.0, wall - free)
    span = len(reports) * sum(walls)
    if span <= 0:
        return None
    return IdleShares(**{name: seconds / span for name, seconds in totals.items()})


def _remote_input(action: ActionRecord, done: dict, owner: dict[int, int], last_stage: int,
                  rank: int) -> tuple[int, float] | None:
    """(rank, end) of the action on another rank whose result this one needs (see mbtune.actions), or None."""
    source = input_stage(action.kind, action.stage, last_stage)
    if source is None or owner[source] == rank:
        return None
    return find_input(done, action.kind, action.stage, action.accum, action.microbatch, last_stage)


def _clock_origins(actions: Sequence[tuple[int, ActionRecord]], done: dict, owner: dict[int, int],
                   last_stage: int) -> dict[int, float]:
    """Per rank, how much later its clock started than rank 0's (seconds), from the shortest hand-over
    each way between neighbouring ranks; 0 where a pair has no hand-over in both directions."""
    shortest: dict[tuple[int, int], float] = {}
    for rank, a in actions:
        producer = _remote_input(a, done, owner, last_stage, rank)
        if producer is not None:
            key = (producer[0], rank)
            shortest[key] = min(shortest.get(key, float("inf")), a.start_s - producer[1])
    ranks = sorted({rank for rank, _ in actions} | {0})
    origin = {rank: 0.0 for rank in ranks}
    for before, after in itertools.pairwise(ranks):
        there, back = shortest.get((before, after)), shortest.get((after, before))
        # A clock reads true time less its origin, so a hand-over before -> after reads its true length
        # less (origin[after] - origin[before]), and one back reads it plus that much.
        step = (back - there) / 2 if there is not None and back is not None else 0.0
        origin[after] = origin[before] + step
    return origin
