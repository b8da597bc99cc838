"""Benchmark: the calibrated pipeline simulator against real CPU pipelines, and the quick sweep strategy
against the exhaustive grid.

1. Runs an exhaustive grid for real (schedules x micro-batches x micro-batch sizes at two stages, one fresh
   process per rank), `--repeats` times (default 2), each pass in its own shuffled order so a neighbour's
   load drifting over time favours no schedule; a point's repeats are merged as `mbtune sweep --repeats`
   merges them (mbtune.sweeping.measured.merge_repeats: every repeat's steps, one median per repeat).
2. Prints predicted against measured step time for every point: in-sample (one model fitted to all points)
   and leave-one-out (each point predicted by a model fitted to the others), with scatter measured and
   none, median and worst error, and beside them the noise floor: per point, (max - min) / median of its
   repeats' median step times, then the median and worst over points (the floor no predictor beats).
   With one repeat the floor is the spread of steps within one run, labelled so.
3. Replays the measured grid through the quick strategy (run_point looks the measured result up, so the
   comparison is cheap and sees exactly the numbers the exhaustive sweep saw) and prints the fraction of
   the grid it ran and the best it found against the exhaustive best.

0. First, the simulator's speed and its textbook bubbles at scale (bench/simulator.py; --skip-simulator
   leaves them out, --simulator-only prints them alone).

Run: .venv/bin/python bench/plan.py [--repeats 2] [--save grid.json] [--load grid.json] [--simulator-only]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import simulator  # noqa: E402 - bench/simulator.py, beside this file

from mbtune.pipeline.launch import run_pipeline_point
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.theory import stages_per_rank_of
from mbtune.planning.api import block_facts, validate_results
from mbtune.planning.calibrate import usable
from mbtune.planning.quick import quick_search, simulator_predictor
from mbtune.planning.records import Validation
from mbtune.report.plan import noise_floor_text, noise_verdict
from mbtune.sweeping.measured import merge_repeats, summarize_point
from mbtune.sweeping.records import PointResult

WORKLOAD = "mlp"
OPTIONS = (("layers", 4), ("width", 512))


def grid(schedules: list[str], micro_batches: list[int], sizes: list[int]) -> list[SweepPoint]:
    """Every schedule x micro-batches x micro-batch size point at two stages."""
    return [SweepPoint(schedule=s, num_ranks=2, num_micro_batches=m, grad_accum_steps=1, micro_batch_size=b,
                       stages_per_rank=stages_per_rank_of(s)) for s in schedules for m in micro_batches for b in sizes]


def run(point: SweepPoint, steps: int) -> PointResult:
    """Run one point for real and summarise it as the sweep does."""
    spec = PipelineSpec.for_point(point, workload=WORKLOAD, workload_options=OPTIONS, device="cpu",
                                  measured_steps=steps, threads=1)
    outcome = run_pipeline_point(spec, timeout_s=300)
    return summarize_point(point, outcome, tokens_per_sample=None, flops_per_sample=None, peak_flops_total=None)


def measure(points: list[SweepPoint], steps: int, seed: int, repeats: int) -> list[PointResult]:
    """Run every point `repeats` times, each pass in its own shuffled order; results in the points' order,
    each point's repeats merged."""
    started = time.monotonic()
    runs: dict[SweepPoint, list[PointResult]] = {p: [] for p in points}
    total = len(points) * repeats
    for repeat in range(repeats):
        order = list(points)
        random.Random(seed + repeat).shuffle(order)
        for index, point in enumerate(order, 1):
            runs[point].append(run(point, steps))
            done = repeat * len(points) + index
            if sys.stdout.isatty() or done == total:
                print(f"\r  measured {done}/{total} point runs ({time.monotonic() - started:.0f} s)", end="",
                      flush=True)
    print()
    return [merge_repeats(runs[p]) for p in points]


def validation(results: list[PointResult]) -> None:
    """Print predicted against measured, in-sample and leave-one-out, with the noise floor beside them."""
    print(f"\n2. predicted vs measured step time, {len(results)} points that ran")
    checks = {(method, scatter): validate_results(results, workload=WORKLOAD, workload_options=dict(OPTIONS),
                                                  method=method, scatter=scatter)
              for method, scatter in (("in-sample", "measured"), ("leave-one-out", "measured"),
                                      ("leave-one-out", "none"))}
    in_sample, held_out = checks[("in-sample", "measured")], checks[("leave-one-out", "measured")]
    print(f"  {'point':<42}{'measured':>10}{'repeats':>9}{'in-sample':>11}{'err':>8}{'held out':>10}{'err':>8}")
    for row, held, result in zip(in_sample.rows, held_out.rows, usable(results)):
        print(f"  {row.point.label:<42}{row.measured_step_s * 1e3:>8.1f}ms{_repeat_range(result):>9}"
              f"{row.predicted_step_s * 1e3:>9.1f}ms{row.step_error:>+8.1%}{held.predicted_step_s * 1e3:>8.1f}ms"
              f"{held.step_error:>+8.1%}")
    for (method, scatter), check in checks.items():
        print(f"  {method:>13}, scatter {scatter:<8}: step time |error| median {check.median_step_error:.1%}, worst "
              f"{check.worst_step_error:.1%}; bubble |predicted - measured| median "
              f"{100 * check.median_bubble_error:.1f} pts, worst {100 * check.worst_bubble_error:.1f} pts")
    print(f"  noise floor: {noise_floor_text(held_out.noise_floor)}")
    for (method, scatter), check in checks.items():
        print(f"  {method}, scatter {scatter}: {noise_verdict(check)}")
    _headline(held_out)


def _repeat_range(result: PointResult) -> str:
    """(max - min) / median of a point's repeat medians, or '-' with fewer than two."""
    medians = result.repeat_step_time_medians_s
    if len(medians) < 2:
        return "-"
    return f"{(max(medians) - min(medians)) / statistics.median(medians):.1%}"


def _headline(held_out: Validation) -> None:
    """The figures the README quotes, in its words."""
    noise = held_out.noise_floor
    floor = f"{noise.median:.1%} (worst {noise.worst:.1%}, {noise.kind})" if noise else "unknown"
    print(f"  README: leave-one-out median step-time error {held_out.median_step_error:.1%} (worst "
          f"{held_out.worst_step_error:.1%}) against a noise floor of {floor}")


def quick_vs_exhaustive(results: list[PointResult]) -> None:
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


def main() -> None:
    """Measure (or load) the grid, then print the comparisons."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zero-bubble,zbv")
    parser.add_argument("--micro-batches", default="2,4,8")
    parser.add_argument("--micro-batch-sizes", default="16,32,64")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2,
                        help="times every point is measured, each in fresh processes (>= 2 for the between-run noise floor)")
    parser.add_argument("--save", help="write the measured grid to this JSON file")
    parser.add_argument("--load", help="analyse a grid saved by --save instead of measuring")
    parser.add_argument("--simulator-only", action="store_true",
                        help="print the simulator's speed and theory tables (bench/simulator.py) and stop")
    parser.add_argument("--skip-simulator", action="store_true", help="leave the simulator's tables out")
    args = parser.parse_args()
    if not args.skip_simulator:
        simulator.speed(repeats=5)
        simulator.theory()
        print()
    if args.simulator_only:
        return
    if args.load:
        with open(args.load) as handle:
            results = [PointResult.from_dict(r) for r in json.load(handle)]
        print(f"1. loaded {len(results)} measured points from {args.load}")
    else:
        points = grid(args.schedules.split(","), [int(m) for m in args.micro_batches.split(",")],
                      [int(b) for b in args.micro_batch_sizes.split(",")])
        print(f"1. measuring {len(points)} points x {args.repeats} repeat(s): {WORKLOAD} {dict(OPTIONS)}, 2 stages, "
              f"{args.steps} measured steps, one thread per rank, shuffled order per repeat")
        results = measure(points, args.steps, args.seed, max(1, args.repeats))
        if args.save:
            with open(args.save, "w") as handle:
                json.dump([r.to_dict() for r in results], handle)
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"  {len(failed)} point(s) failed: " + "; ".join(f"{r.point.label}: {r.status}" for r in failed))
    validation(results)
    quick_vs_exhaustive(results)


if __name__ == "__main__":
    main()
