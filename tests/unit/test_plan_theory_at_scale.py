"""The textbook bubbles at the scale plans are made for: with uniform costs (a backward's input and weight
parts equal to a forward) and free hand-overs, every schedule's simulated bubble is its closed form
(pipeline/theory.py), at 512 pipeline ranks and at 4096 micro-batches. bench/simulator.py prints the same
table with p=512 and m=4096 together."""

from __future__ import annotations

import pytest

from mbtune.pipeline.theory import stage_to_rank, stages_per_rank_of, theoretical_bubble
from mbtune.planning.orders import schedule_orders
from mbtune.planning.simulate import simulate, uniform_costs


@pytest.mark.parametrize(("schedule", "p", "m"), [
    ("gpipe", 512, 512), ("gpipe", 8, 4096), ("1f1b", 512, 512), ("1f1b", 8, 4096),
    ("interleaved-1f1b", 512, 128), ("interleaved-1f1b", 4, 4096),
    ("looped-bfs", 512, 64), ("looped-bfs", 4, 4096),  # fewer micro-batches than ranks: each loop refills
    ("zero-bubble", 256, 256), ("zero-bubble", 4, 4096), ("zb-h1", 256, 256), ("zb-h1", 4, 4096),
    ("zbv", 256, 512), ("zbv", 4, 4096), ("dualpipev", 128, 256), ("dualpipev", 4, 4096),
])
def test_every_schedules_bubble_is_its_closed_form_at_scale(schedule: str, p: int, m: int) -> None:
    v = stages_per_rank_of(schedule)
    orders = schedule_orders(schedule, num_ranks=p, num_micro_batches=m, stages_per_rank=v)
    costs = uniform_costs(p * v, forward_s=1 / v, backward_s=2 / v)
    sim = simulate(orders, stage_to_rank=stage_to_rank(schedule, p, p * v), stage_costs=costs, keep_timeline=False)
    expected = theoretical_bubble(schedule, num_ranks=p, num_micro_batches=m, stages_per_rank=v)
    assert sim.bubble == pytest.approx(expected, rel=1e-3)
    schedule_orders.cache_clear()  # the largest orders hold a few hundred MB
