"""Benchmark: the pipeline simulator's speed, and the textbook bubbles it reproduces at scale.

1. Speed at p=64, m=256 for the six schedules (two stages per rank for the looped ones): the time to read
   the orders (torch's own for the looped and zero-bubble schedules), to build the step's graph, and to
   simulate one draw and 15 draws of the costs (medians of --repeats, with min-max), in simulated actions a
   second; then the whole (orders, graph, 15 draws) from scratch for all six; and the event-by-event
   simulator this one replaced (tests/unit/event_simulator.py) on one point for the ratio.
2. Theory: with uniform costs and free hand-overs, each schedule's simulated bubble beside its closed form
   (pipeline/theory.py theoretical_bubble), p up to 512 and m up to 4096.

Run: .venv/bin/python bench/simulator.py [--repeats 5] [--skip-theory]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

from mbtune.pipeline.theory import stage_to_rank, stages_per_rank_of, theoretical_bubble
from mbtune.planning.orders import schedule_orders
from mbtune.planning.records import Spread
from mbtune.planning.simulate import Jitter, Overheads, simulate_draws, step_graph, uniform_costs

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv")  # p=64 m=256: the six the design names
SPREAD = Spread(compute=(0.9, 0.95, 1.0, 1.05, 1.2), transfer=(0.8, 1.0, 1.5), gap=(1.0, 2.0))
DRAWS = 15
# (schedule, p, m): every schedule at p=512 and at m=4096, and the largest both where the orders allow.
THEORY = [
    ("gpipe", 512, 4096), ("gpipe", 8, 4096), ("1f1b", 512, 1024), ("1f1b", 64, 4096),
    ("interleaved-1f1b", 512, 512), ("interleaved-1f1b", 4, 4096), ("looped-bfs", 512, 256), ("looped-bfs", 4, 4096),
    ("zero-bubble", 512, 512), ("zero-bubble", 4, 4096), ("zb-h1", 512, 512), ("zb-h1", 4, 4096),
    ("zbv", 512, 1024), ("zbv", 4, 4096), ("dualpipev", 512, 1024), ("dualpipev", 4, 4096),
]


def _point(schedule: str, p: int, m: int):
    v = stages_per_rank_of(schedule, 2)
    orders = schedule_orders(schedule, num_ranks=p, num_micro_batches=m, stages_per_rank=v)
    costs = uniform_costs(p * v, forward_s=1 / v, backward_s=2 / v)  # split parts F = B_input = B_weight
    return orders, stage_to_rank(schedule, p, p * v), costs, v


def _timed(fn, repeats: int) -> tuple[float, float, float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), min(times), max(times)


def speed(repeats: int) -> None:
    print(f"simulator speed, p=64 m=256 (median of {repeats}, min-max; actions a second of the median)")
    print(f"{'schedule':18s} {'actions':>8s} {'orders s':>9s} {'graph s':>8s} {'1 draw s':>16s} {'M act/s':>8s} "
          f"{f'{DRAWS} draws s':>16s} {'M act/s':>8s}")
    over = Overheads(transfer_s=(1e-3,) * 127, send_s=2e-4, gap_s=5e-5, start_s=1e-3)
    for schedule in SCHEDULES:
        started = time.perf_counter()
        orders, owners, costs, v = _point(schedule, 64, 256)
        read = time.perf_counter() - started
        actions = sum(map(len, orders))
        started = time.perf_counter()
        step_graph(orders, owners, 1)
        built = time.perf_counter() - started
        jitters = [Jitter(SPREAD, seed) for seed in range(DRAWS)]
        simulated = functools.partial(simulate_draws, orders, stage_to_rank=owners, stage_costs=costs, overheads=over)
        one = _timed(simulated, repeats)
        many = _timed(functools.partial(simulated, jitters=jitters), repeats)
        print(f"{schedule:18s} {actions:8d} {read:9.2f} {built:8.3f} {one[0]:6.3f} ({one[1]:.3f}-{one[2]:.3f}) "
              f"{actions / one[0] / 1e6:8.1f} {many[0]:6.3f} ({many[1]:.3f}-{many[2]:.3f}) "
              f"{DRAWS * actions / many[0] / 1e6:8.1f}")
    schedule_orders.cache_clear()
    started = time.perf_counter()
    total = 0
    for schedule in SCHEDULES:
        orders, owners, costs, _ = _point(schedule, 64, 256)
        simulate_draws(orders, stage_to_rank=owners, stage_costs=costs, overheads=over,
                       jitters=[Jitter(SPREAD, seed) for seed in range(DRAWS)])
        total += sum(map(len, orders))
    print(f"all six from scratch (orders, graph, {DRAWS} draws each): {time.perf_counter() - started:.2f} s, "
          f"{total} actions a draw")
    _against_events(repeats)


def _against_events(repeats: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.unit.event_simulator import simulate_events

    orders, owners, costs, _ = _point("1f1b", 16, 64)
    actions = sum(map(len, orders))
    old = _timed(lambda: simulate_events(orders, stage_to_rank=owners, stage_costs=costs), repeats)
    new = _timed(lambda: simulate_draws(orders, stage_to_rank=owners, stage_costs=costs), repeats)
    print(f"1f1b p=16 m=64 ({actions} actions): event by event {old[0] * 1e3:.1f} ms ({old[1] * 1e3:.1f}-"
          f"{old[2] * 1e3:.1f}), vectorised {new[0] * 1e3:.1f} ms ({new[1] * 1e3:.1f}-{new[2] * 1e3:.1f}): "
          f"{old[0] / new[0]:.1f}x")


def theory() -> None:
    print("\ntheory at scale: uniform costs (split parts equal), free hand-overs")
    print(f"{'schedule':18s} {'p':>4s} {'m':>5s} {'actions':>9s} {'simulated':>10s} {'closed form':>11s} "
          f"{'error':>9s} {'seconds':>8s}")
    worst = 0.0
    for schedule, p, m in THEORY:
        started = time.perf_counter()
        orders, owners, costs, v = _point(schedule, p, m)
        simulated = simulate_draws(orders, stage_to_rank=owners, stage_costs=costs)[0].bubble
        expected = theoretical_bubble(schedule, num_ranks=p, num_micro_batches=m, stages_per_rank=v)
        error = abs(simulated - expected) / expected
        worst = max(worst, error)
        print(f"{schedule:18s} {p:4d} {m:5d} {sum(map(len, orders)):9d} {simulated:10.6f} {expected:11.6f} "
              f"{100 * error:8.4f}% {time.perf_counter() - started:8.1f}")
        schedule_orders.cache_clear()
    print(f"worst relative error {100 * worst:.4f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-theory", action="store_true")
    args = parser.parse_args()
    speed(args.repeats)
    if not args.skip_theory:
        theory()


if __name__ == "__main__":
    main()
