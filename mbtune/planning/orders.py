"""Per-rank action orders of the schedules: what each rank computes in one pipeline step, in order.

The looped and zero-bubble schedules (interleaved-1f1b, looped-bfs, zero-bubble, zb-h1, zbv, dualpipev, and any other
`_PipelineScheduleRuntime` schedule) execute torch's own `pipeline_order`, so that is read from torch
(pipeline/schedules.py builds the schedule without modules or a process group). GPipe and 1F1B run
hand-written loops in torch (`_step_microbatches`); their published `pipeline_order` is descriptive only,
and in torch 2.13 1F1B's is off by one micro-batch on the last rank. For those two, the orders below mirror
the loops that really run; tests check them against torch's published orders and against the order the
ranks were measured in. No torch import at module level: without torch only gpipe and 1f1b are available.
"""

from __future__ import annotations

import functools

from mbtune.actions import BACKWARD, FORWARD
from mbtune.pipeline.theory import SINGLE, schedule_info
from mbtune.planning.records import OrderedAction

RankOrders = tuple[tuple[OrderedAction, ...], ...]


def gpipe_order(num_ranks: int, num_micro_batches: int) -> RankOrders:
    """GPipe: every forward, then every backward, on each rank (stage r on rank r)."""
    return tuple(
        tuple(OrderedAction(stage=r, kind=FORWARD, microbatch=i) for i in range(num_micro_batches))
        + tuple(OrderedAction(stage=r, kind=BACKWARD, microbatch=i) for i in range(num_micro_batches))
        for r in range(num_ranks)
    )


def one_f_one_b_order(num_ranks: int, num_micro_batches: int) -> RankOrders:
    """1F1B as torch's Schedule1F1B runs it: stage s warms up with min(m, p - s) forwards, then alternates
    one backward and one forward, then drains the remaining backwards."""
    if num_micro_batches < num_ranks:
        raise ValueError(f"1f1b needs at least as many micro-batches as stages ({num_ranks}), got {num_micro_batches}")
    orders = []
    for s in range(num_ranks):
        warmup = min(num_micro_batches, num_ranks - s)
        actions = [OrderedAction(stage=s, kind=FORWARD, microbatch=i) for i in range(warmup)]
        forward_next = warmup
        for b in range(num_micro_batches):
            actions.append(OrderedAction(stage=s, kind=BACKWARD, microbatch=b))
            if forward_next < num_micro_batches:
                actions.append(OrderedAction(stage=s, kind=FORWARD, microbatch=forward_next))
                forward_next += 1
        orders.append(tuple(actions))
    return tuple(orders)


_PURE = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}


@functools.lru_cache(maxsize=256)
def schedule_orders(schedule: str, *, num_ranks: int, num_micro_batches: int, stages_per_rank: int = 1) -> RankOrders:
    """Per rank, the actions the schedule runs in one pipeline step. ValueError where the point cannot run."""
    if schedule_info(schedule).layout == SINGLE and stages_per_rank != 1:
        raise ValueError(f"{schedule} runs one stage per rank, not {stages_per_rank}")
    if schedule in _PURE:
        return _PURE[schedule](num_ranks, num_micro_batches)
    return torch_orders(schedule, num_ranks=num_ranks, num_micro_batches=num_micro_batches,
                        stages_per_rank=stages_per_rank)


def torch_orders(schedule: str, *, num_ranks: int, num_micro_batches: int, stages_per_rank: int = 1) -> RankOrders:
    """torch's published `pipeline_order` of a schedule, as OrderedActions (needs torch)."""
    try:
        from mbtune.pipeline.schedules import schedule_action_orders
    except ImportError as exc:  # torch missing or too old: only the pure orders are available
        raise ValueError(f"the {schedule} order comes from torch.distributed.pipelining, which cannot be imported "
                         f"here ({exc}); gpipe and 1f1b work without it") from exc
    raw = schedule_action_orders(schedule, num_ranks=num_ranks, num_micro_batches=num_micro_batches,
                                 stages_per_rank=stages_per_rank)
    return tuple(tuple(OrderedAction(stage=s, kind=k, microbatch=i) for s, k, i in rank) for rank in raw)
