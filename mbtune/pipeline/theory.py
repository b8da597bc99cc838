"""Pure pipeline facts: the schedules mbtune knows, which points can run, where stages live, theoretical bubble.

No torch import here, so planning code (sweep grids, the simulator, the CLI) can use it without torch. The
constraints mirror torch.distributed.pipelining 2.13 (schedules.py); tests/unit/test_pipeline_theory.py
cross-checks them against torch's own constructors and schedule simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

# How a schedule places its stages on ranks.
SINGLE = "single"  # one stage per rank: stage i on rank i
LOOP = "loop"  # v stages per rank, stage i on rank i % num_ranks
V_SHAPE = "v"  # two stages per rank, rank r holds stages r and 2p-1-r

DEFAULT_STAGES_PER_RANK = 2


@dataclass(frozen=True, kw_only=True)
class ScheduleInfo:
    """What mbtune needs to know about one torch pipelining schedule."""

    name: str
    torch_class: str
    layout: str
    splits_backward: bool  # runs backward-input and backward-weight as separate actions
    description: str
    stage_list: bool = True  # torch's constructor takes a list of the rank's stages (all but gpipe and 1f1b)


SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo(name="gpipe", torch_class="ScheduleGPipe", layout=SINGLE, splits_backward=False,
                     description="all forwards, then all backwards (fill-drain)", stage_list=False),
        ScheduleInfo(name="1f1b", torch_class="Schedule1F1B", layout=SINGLE, splits_backward=False,
                     description="one forward, one backward in steady state", stage_list=False),
        ScheduleInfo(name="zb-h1", torch_class="ScheduleInterleavedZeroBubble", layout=SINGLE, splits_backward=True,
                     description="ZB-H1: 1F1B with one stage per rank, weight gradients fill its bubble"),
        ScheduleInfo(name="interleaved-1f1b", torch_class="ScheduleInterleaved1F1B", layout=LOOP,
                     splits_backward=False, description="1F1B over v looped virtual stages per rank, depth first"),
        ScheduleInfo(name="looped-bfs", torch_class="ScheduleLoopedBFS", layout=LOOP, splits_backward=False,
                     description="v looped virtual stages per rank, breadth first"),
        ScheduleInfo(name="zero-bubble", torch_class="ScheduleInterleavedZeroBubble", layout=LOOP,
                     splits_backward=True, description="interleaved ZB-H1: weight gradients fill the bubble"),
        ScheduleInfo(name="zbv", torch_class="ScheduleZBVZeroBubble", layout=V_SHAPE, splits_backward=True,
                     description="zero-bubble V: two stages per rank in a V, split backward"),
        ScheduleInfo(name="dualpipev", torch_class="ScheduleDualPipeV", layout=V_SHAPE, splits_backward=True,
                     description="DualPipeV: two stages per rank in a V, a forward overlapped with a backward"),
    )
}
SCHEDULE_NAMES = tuple(SCHEDULES)


def schedule_info(schedule: str) -> ScheduleInfo:
    """The ScheduleInfo of a schedule name; ValueError naming the known schedules otherwise."""
    try:
        return SCHEDULES[schedule]
    except KeyError:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULE_NAMES)}") from None


def stages_per_rank_of(schedule: str, asked: int | None = None) -> int:
    """Stages each rank holds: 1 for gpipe/1f1b, exactly 2 for zbv, the stages per rank `asked` (default 2)
    for the looped schedules (interleaved-1f1b, looped-bfs, zero-bubble)."""
    layout = schedule_info(schedule).layout
    if layout == SINGLE:
        return 1
    if layout == V_SHAPE:
        return 2
    return DEFAULT_STAGES_PER_RANK if asked is None else asked


def check_point(
    schedule: str, num_model_stages: int, num_ranks: int, num_micro_batches: int, *, num_blocks: int | None = None
) -> str | None:
    """Why this (schedule, stages, ranks, micro-batches) point cannot run, or None when it can.

    `num_model_stages` counts every stage (virtual stages included); `num_blocks`, when given, is the
    workload's block count, which bounds the number of stages.
    """
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULE_NAMES)}"
    for label, value in (("stages", num_model_stages), ("ranks", num_ranks), ("micro-batches", num_micro_batches)):
        if value < 1:
            return f"{label} must be at least 1, got {value}"
    if num_blocks is not None and num_model_stages > num_blocks:
        return f"the workload has {num_blocks} blocks, too few for {num_model_stages} stages (one block at least each)"
    if num_model_stages % num_ranks:
        return f"{num_model_stages} stages do not spread evenly over {num_ranks} ranks"
    per_rank = num_model_stages // num_ranks
    return _layout_reason(schedule, per_rank) or _microbatch_reason(schedule, num_ranks, num_micro_batches)


def _layout_reason(schedule: str, per_rank: int) -> str | None:
    layout = SCHEDULES[schedule].layout
    if layout == SINGLE and per_rank != 1:
        return f"{schedule} runs one stage per rank, not {per_rank}"
    if layout == V_SHAPE and per_rank != 2:
        return f"{schedule} needs exactly two stages per rank (a V), not {per_rank}"
    if layout == LOOP and per_rank < 2:
        return f"{schedule} needs at least two stages per rank; with one it degenerates to gpipe/1f1b"
    return None


def _microbatch_reason(schedule: str, num_ranks: int, num_micro_batches: int) -> str | None:
    if schedule == "1f1b" and num_micro_batches < num_ranks:
        return f"1f1b needs at least as many micro-batches as stages ({num_ranks}), got {num_micro_batches}"
    if schedule == "dualpipev" and num_micro_batches < 2 * num_ranks:
        return f"dualpipev needs at least as many micro-batches as stages ({2 * num_ranks}), got {num_micro_batches}"
    if schedule in ("interleaved-1f1b", "zero-bubble", "zb-h1"):
        # torch runs max(1, m // p) rounds and needs the micro-batches to split evenly into them.
        rounds = max(1, num_micro_batches // num_ranks)
        if num_micro_batches % rounds:
            below, above = _nearest_valid_rounds(num_ranks, num_micro_batches)
            return (f"{schedule} groups {num_micro_batches} micro-batches into {rounds} rounds "
                    f"(micro-batches // ranks) and needs them to divide evenly; try {below} or {above}")
    return None


def interleaved_counts_ok(num_ranks: int, num_micro_batches: int) -> bool:
    """torch's interleaved constraint: m divisible by max(1, m // p)."""
    return num_micro_batches % max(1, num_micro_batches // num_ranks) == 0


def _nearest_valid_rounds(num_ranks: int, num_micro_batches: int) -> tuple[int, int]:
    below = next(m for m in range(num_micro_batches, 0, -1) if interleaved_counts_ok(num_ranks, m))
    above = next(m for m in range(num_micro_batches, 2 * num_micro_batches + 2) if interleaved_counts_ok(num_ranks, m))
    return below, above


def stage_to_rank(schedule: str, num_ranks: int, num_model_stages: int) -> tuple[int, ...]:
    """The rank that holds each stage, as torch expects it (loop: i % p; V: r and 2p-1-r)."""
    layout = schedule_info(schedule).layout
    if layout != V_SHAPE:
        return tuple(i % num_ranks for i in range(num_model_stages))
    if num_model_stages != 2 * num_ranks:
        raise ValueError(f"a V layout has 2 x {num_ranks} stages, not {num_model_stages}")
    return tuple(i if i < num_ranks else 2 * num_ranks - 1 - i for i in range(num_model_stages))


def stages_of_rank(schedule: str, num_ranks: int, num_model_stages: int, rank: int) -> tuple[int, ...]:
    """The stage indices one rank holds, in increasing order."""
    owners = stage_to_rank(schedule, num_ranks, num_model_stages)
    return tuple(i for i, owner in enumerate(owners) if owner == rank)


def theoretical_bubble(
    schedule: str, *, num_ranks: int, num_micro_batches: int, stages_per_rank: int | None = None
) -> float:
    """Idle fraction of rank-time inside one pipeline step, from the textbook models.

    All forms assume equal per-stage costs and free communication, and give the idle share of the step
    (comparable to the measured 1 - busy / (p x wall)); p = ranks, m = micro-batches, v = stages per rank:

    - gpipe, 1f1b: (p-1) / (m+p-1).
    - interleaved-1f1b, looped-bfs: a rank waits (p-1) virtual-stage slots of t/v, so (p-1) / (v*m + p-1)
      (Narayanan et al. 2021's (p-1)/(v*m) is the same bubble relative to compute, not to the step).
      When m < p each loop also stalls for the pipe to refill, which adds (v-1)(p-m) slots.
    - zero-bubble (torch's interleaved ZB-H1) and zb-h1 (the same schedule, one stage per rank: the Zero
      Bubble paper's ZB-H1): with forward = backward-input = backward-weight, the bubble is a third of
      1F1B's (Qi et al. 2024, Table 2): (p-1) / (3*v*m + p-1), v = 1 for zb-h1.
    - zbv and dualpipev: with m >= 2p-1 and equal F/B/W costs ZB-V keeps every rank busy in steady state
      (the paper's "zero bubble"); what remains, measured as above, is the fill while the first
      micro-batch travels down the V: p-1 slots of each rank's 6m, so (p-1) / (6m + p-1). With fewer
      micro-batches torch runs the 2p-1 schedule with slots left empty, so at least 1 - m/(2p-1).
      DualPipeV (DeepSeek-V3's DualPipe cut to one V) runs the same V with a forward and a backward
      overlapped; in sequence, as here, its bubble is ZB-V's (torch needs m >= 2p for it).
    """
    p, m = num_ranks, num_micro_batches
    if p < 1 or m < 1:
        raise ValueError(f"ranks and micro-batches must be at least 1, got {p} and {m}")
    v = stages_per_rank_of(schedule, stages_per_rank)
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule in ("interleaved-1f1b", "looped-bfs"):
        idle_slots = (p - 1) + (v - 1) * max(0, p - m)
        return idle_slots / (v * m + idle_slots)
    if schedule in ("zero-bubble", "zb-h1"):
        return (p - 1) / (3 * v * m + p - 1)
    return max((p - 1) / (6 * m + p - 1), 1.0 - m / (2 * p - 1))
