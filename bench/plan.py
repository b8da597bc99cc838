"""Benchmark: the calibrated pipeline simulator against real CPU pipelines, and the quick sweep strategy
against the exhaustive grid.

1. Runs an exhaustive grid for real (schedules x micro-batches x micro-batch sizes at two stages, one fresh
   process per rank, in shuffled order so a neighbour's load drifting over time favours no schedule).
2. Prints predicted against measured step time for every point: in-sample (one model fitted to all points)
   and leave-one-out (each point predicted by a model fitted to the others), median and worst error.
3. Replays the measured grid through the quick strategy (run_point looks the measured result up, so the
   comparison is cheap and sees exactly the numbers the exhaustive sweep saw) and prints the fraction of
   the grid it ran and the best it found against the exhaustive best.
4. Measures a few points again and prints how much a repeat differs: the noise floor no predictor beats.

Run: .venv/bin/python bench/plan.py [--save grid.json] [--load grid.json] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from mbtune.pipeline import PipelineSpec, run_pipeline_point
from mbtune.pipeline.theory import stages_per_rank
from mbtune.plan.api import block_facts, validate_results
from mbtune.plan.quick import quick_search, simulator_predictor
from mbtune.records import SweepPoint, TrialResult
from mbtune.sweep import summarize_point

WORKLOAD = "mlp"
OPTIONS = (("layers", 4), ("width", 512))


def grid(schedules: list[str], micro_batches: list[int], sizes: list[int]) -> list[SweepPoint]:
    """Every schedule x micro-batches x micro-batch size point at two stages."""
    return [SweepPoint(schedule=s, num_stages=2, num_microbatches=m, grad_accum_steps=1, micro_batch_size=b,
                       virtual_stages=stages_per_rank(s)) for s in schedules for m in micro_batches for b in sizes]


def run(point: SweepPoint, steps: int) -> TrialResult:
    """Run one point for real and summarise it as the sweep does."""
    spec = PipelineSpec(workload=WORKLOAD, workload_options=OPTIONS, schedule=point.schedule, num_ranks=2,
                        virtual_stages=point.virtual_stages if point.virtual_stages > 1 else None,
                        num_microbatches=point.num_microbatches, micro_batch_size=point.micro_batch_size,
                        measured_steps=steps, threads=1)
    outcome = run_pipeline_point(spec, timeout_s=300)
    return summarize_point(point, outcome, tokens_per_sample=None, flops_per_sample=None, peak_flops_total=None)


def measure(points: list[SweepPoint], steps: int, seed: int) -> list[TrialResult]:
    """Run every point once, in shuffled order; results in the points' order."""
    order = list(points)
    random.Random(seed).shuffle(order)
    started = time.monotonic()
    results = {}
    for index, point in enumerate(order, 1):
        results[point] = run(point, steps)
        if sys.stdout.isatty() or index == len(order):
            print(f"\r  measured {index}/{len(order)} points ({time.monotonic() - started:.0f} s)", end="", flush=True)
    print()
    return [results[p] for p in points]


def validation(results: list[TrialResult]) -> None:
    """Print predicted against measured, in-sample and leave-one-out."""
    print(f"\n2. predicted vs measured step time, {len(results)} points that ran")
    checks = {method: validate_results(results, workload=WORKLOAD, workload_options=dict(OPTIONS), method=method)
              for method in ("in-sample", "leave-one-out")}
    print(f"  {'point':<42}{'measured':>10}{'in-sample':>11}{'err':>8}{'held out':>10}{'err':>8}")
    for row, held in zip(checks["in-sample"].rows, checks["leave-one-out"].rows):
        print(f"  {row.point.label:<42}{row.measured_step_s * 1e3:>8.1f}ms{row.predicted_step_s * 1e3:>9.1f}ms"
              f"{row.step_error:>+8.1%}{held.predicted_step_s * 1e3:>8.1f}ms{held.step_error:>+8.1%}")
    for method, check in checks.items():
        print(f"  {method:>13}: step time |error| median {check.median_step_error:.1%}, worst "
              f"{check.worst_step_error:.1%}; bubble |predicted - measured| median "
              f"{100 * check.median_bubble_error:.1f} pts, worst {100 * check.worst_bubble_error:.1f} pts")


def quick_vs_exhaustive(results: list[TrialResult]) -> None:
    """Replay the measured grid through the quick strategy and compare bests."""
    print("\n3. quick strategy vs the exhaustive grid (replayed: run_point returns the measured result)")
    by_point = {r.point: r for r in results}
    facts = block_facts(WORKLOAD, OPTIONS)
    found = quick_search(list(by_point), by_point.__getitem__,
                         predict_rates=simulator_predictor(facts, workload=WORKLOAD))
    best = max((r for r in results if r.ok), key=lambda r: r.samples_per_s)
    quick_best = found.results[found.best]
    print(f"  ran {len(found.results)} of {found.num_grid_points} points ({found.fraction_run:.0%}); "
          f"best found {quick_best.point.label} at {quick_best.samples_per_s:,.1f} samples/s")
    print(f"  exhaustive best {best.point.label} at {best.samples_per_s:,.1f} samples/s: quick found "
          f"{quick_best.samples_per_s / best.samples_per_s:.1%} of it")
    print(f"  stopped: {found.stopped_because}")


def noise_floor(results: list[TrialResult], repeat: int, steps: int) -> None:
    """Measure a few points again: how much a repeat moves on this machine."""
    if repeat <= 0:
        return
    print(f"\n4. noise floor: {repeat} points measured again")
    differences = []
    for original in random.Random(1).sample([r for r in results if r.ok], min(repeat, len(results))):
        again = run(original.point, steps)
        if again.ok:
            change = again.step_time_median_s / original.step_time_median_s - 1
            differences.append(abs(change))
            print(f"  {original.point.label:<42}{original.step_time_median_s * 1e3:>8.1f} ms, again "
                  f"{again.step_time_median_s * 1e3:.1f} ms ({change:+.1%})")
    if differences:
        print(f"  a repeat differs by {statistics.median(differences):.1%} (median), {max(differences):.1%} (worst)")


def main() -> None:
    """Measure (or load) the grid, then print the three comparisons."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zero-bubble,zbv")
    parser.add_argument("--micro-batches", default="2,4,8")
    parser.add_argument("--micro-batch-sizes", default="16,32,64")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="points to measure again for the noise floor")
    parser.add_argument("--save", help="write the measured grid to this JSON file")
    parser.add_argument("--load", help="analyse a grid saved by --save instead of measuring")
    args = parser.parse_args()
    if args.load:
        with open(args.load) as handle:
            results = [TrialResult.from_dict(r) for r in json.load(handle)]
        print(f"1. loaded {len(results)} measured points from {args.load}")
    else:
        points = grid(args.schedules.split(","), [int(m) for m in args.micro_batches.split(",")],
                      [int(b) for b in args.micro_batch_sizes.split(",")])
        print(f"1. measuring {len(points)} points: {WORKLOAD} {dict(OPTIONS)}, 2 stages, {args.steps} measured steps, "
              "one thread per rank, shuffled order")
        results = measure(points, args.steps, args.seed)
        if args.save:
            with open(args.save, "w") as handle:
                json.dump([r.to_dict() for r in results], handle)
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"  {len(failed)} point(s) failed: " + "; ".join(f"{r.point.label}: {r.status}" for r in failed))
    validation(results)
    quick_vs_exhaustive(results)
    if not args.load:
        noise_floor(results, args.repeat, args.steps)


if __name__ == "__main__":
    main()
