"""The vectorised simulator against the event-by-event one it replaced (event_simulator.py): the same orders,
costs and overheads give the same step, the same busy time per rank and every action at the same time."""

from __future__ import annotations

import random

import pytest

from mbtune.pipeline.theory import stage_to_rank, stages_per_rank_of
from mbtune.planning.orders import schedule_orders
from mbtune.planning.records import OrderedAction, Spread, StageCost
from mbtune.planning.simulate import Jitter, Overheads, simulate, uniform_costs
from tests.unit.event_simulator import Scale, simulate_events

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv")
# The cases of test_plan_simulate.py: (schedule, p, m, v)
EXISTING = [
    *((s, p, m, 1) for s in ("gpipe", "1f1b") for p, m in [(1, 1), (2, 2), (2, 8), (4, 4), (4, 16), (8, 8), (8, 32)]),
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 4, 16, 2),
    ("interleaved-1f1b", 4, 8, 3), ("interleaved-1f1b", 4, 2, 2), ("looped-bfs", 4, 8, 2), ("looped-bfs", 2, 6, 3),
    ("zero-bubble", 2, 4, 2), ("zero-bubble", 4, 8, 2), ("zero-bubble", 4, 16, 2), ("zbv", 2, 4, 2), ("zbv", 4, 8, 2),
]


def _both(schedule: str, p: int, m: int, v: int, costs, overheads: Overheads | None, accum: int, *,
          scale: tuple[float, float, float] = (1.0, 1.0, 1.0)):
    orders = schedule_orders(schedule, num_ranks=p, num_micro_batches=m, stages_per_rank=v)
    owners = stage_to_rank(schedule, p, p * v)
    compute, transfer, gap = scale
    jitter = Jitter(Spread(compute=(compute,), transfer=(transfer,), gap=(gap,)), seed=3) if scale != (1, 1, 1) else None
    new = simulate(orders, stage_to_rank=owners, stage_costs=costs, overheads=overheads, num_accum=accum,
                   jitter=jitter)
    old = simulate_events(orders, stage_to_rank=owners, stage_costs=costs, overheads=overheads, num_accum=accum,
                          scale=Scale(compute, transfer, gap))
    return new, old


def _assert_same(new, old) -> None:
    assert new.pipeline_s == pytest.approx(old.pipeline_s, rel=1e-12, abs=1e-12)
    assert new.busy_s == pytest.approx(old.busy_s, rel=1e-12, abs=1e-12)
    assert new.bubble == pytest.approx(old.bubble, rel=1e-9, abs=1e-12)
    assert new.peak_in_flight == old.peak_in_flight

    def by_action(sim):
        return {(a.rank, a.stage, a.kind, a.microbatch, a.accum): (a.start_s, a.end_s) for a in sim.timeline}

    times_new, times_old = by_action(new), by_action(old)
    assert times_new.keys() == times_old.keys()
    for key, (start, end) in times_old.items():
        assert times_new[key] == pytest.approx((start, end), rel=1e-12, abs=1e-12), key


@pytest.mark.parametrize(("schedule", "p", "m", "v"), EXISTING)
def test_the_existing_cases_give_the_same_steps(schedule: str, p: int, m: int, v: int) -> None:
    costs = uniform_costs(p * v, forward_s=1.0 / v, backward_s=2.0 / v)
    overheads = Overheads(transfer_s=(0.05,) * (p * v - 1), send_s=0.01, gap_s=0.002, start_s=0.1)
    for over in (None, overheads):
        _assert_same(*_both(schedule, p, m, v, costs, over, accum=1))
    _assert_same(*_both(schedule, p, m, v, costs, overheads, accum=2))


def _random_case(rng: random.Random):
    schedule = rng.choice(SCHEDULES)
    v = stages_per_rank_of(schedule, rng.choice((2, 3)))
    p = rng.randint(1 if v == 1 else 2, 6)
    m = rng.choice([k for k in range(1, 25) if _runs(schedule, p, k, v)] or [p])
    stages = p * v
    costs = tuple(StageCost(forward_s=rng.uniform(0.1, 2), backward_s=rng.uniform(0.1, 4),
                            backward_input_s=rng.uniform(0.1, 2), backward_weight_s=rng.uniform(0.1, 2),
                            loss_s=rng.uniform(0, 0.5) if s == stages - 1 else 0.0) for s in range(stages))
    overheads = Overheads(transfer_s=tuple(rng.uniform(0, 0.3) for _ in range(stages - 1)), send_s=rng.uniform(0, 0.05),
                          gap_s=rng.uniform(0, 0.02), start_s=rng.uniform(0, 0.2))
    scale = (rng.choice((1.0, 0.5, 2.0)), rng.choice((1.0, 3.0)), rng.choice((1.0, 0.25)))
    return schedule, p, m, v, costs, overheads, rng.randint(1, 3), scale


def _runs(schedule: str, p: int, m: int, v: int) -> bool:
    try:
        schedule_orders(schedule, num_ranks=p, num_micro_batches=m, stages_per_rank=v)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("seed", range(40))
def test_random_points_costs_and_overheads_give_the_same_steps(seed: int) -> None:
    schedule, p, m, v, costs, overheads, accum, scale = _random_case(random.Random(seed))
    _assert_same(*_both(schedule, p, m, v, costs, overheads, accum, scale=scale))


def test_a_deadlocked_order_is_refused_alike() -> None:
    orders = ((OrderedAction(stage=0, kind="backward", microbatch=0), OrderedAction(stage=0, kind="forward", microbatch=0)),
              (OrderedAction(stage=1, kind="forward", microbatch=0), OrderedAction(stage=1, kind="backward", microbatch=0)))
    costs = uniform_costs(2)
    messages = []
    for run in (simulate, simulate_events):
        with pytest.raises(ValueError, match="deadlocks") as caught:
            run(orders, stage_to_rank=(0, 1), stage_costs=costs)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
