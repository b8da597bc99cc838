"""Benchmark: measured vs theoretical bubble for GPipe and 1F1B at two stages, m = 2..16, on CPU; the
harness overhead (mbtune's one-stage measured step against a plain hand-written training loop); and, on the
gpt demo at one fixed global batch, the micro-batch trade-off (sizes 2-16: bubble against per-sample
compute), data parallelism (the all-reduce's share of the step) and activation recompute (its throughput
cost beside its memory saving).

Run: .venv/bin/python bench/sweep.py [--repeats 5] [--sections bubble,overhead,global-batch,dp,recompute]
"""

from __future__ import annotations

import argparse
import statistics
import time

from mbtune.pipeline.launch import run_pipeline_point
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.theory import theoretical_bubble
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.records import PointResult
from mbtune.sweeping.run import sweep_workload
from mbtune.worker import run_isolated

WORKLOAD = "mlp"
OPTIONS = (("layers", 4), ("width", 512))


def bubble_table(micro_batch_size: int, steps: int) -> None:
    print(f"bubble, 2 stages, {WORKLOAD} {dict(OPTIONS)}, micro-batch size {micro_batch_size}, {steps} measured steps")
    print("measured bubble split by cause: schedule (an input not computed yet, fill and drain), transfer (an input "
          "computed but not here yet), overhead (between actions)")
    print(f"{'schedule':<8}{'m':>4}{'measured':>10}{'theory':>9}{'excess':>9}{'=sched':>9}{'+transfer':>11}"
          f"{'+overhead':>11}{'samples/s':>11}")
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 4, 8, 16):
            spec = PipelineSpec(workload=WORKLOAD, workload_options=OPTIONS, schedule=schedule, num_ranks=2,
                                num_micro_batches=m, micro_batch_size=micro_batch_size, measured_steps=steps, threads=1)
            outcome = run_pipeline_point(spec, timeout_s=600)
            if not outcome.ok:
                print(f"{schedule:<8}{m:>4}  {outcome.status}: {outcome.error}")
                continue
            theory = theoretical_bubble(schedule, num_ranks=2, num_micro_batches=m)
            measured = outcome.measured_bubble
            rate = spec.global_batch / statistics.median(outcome.step_times_s)
            idle = outcome.idle_shares
            print(f"{schedule:<8}{m:>4}{measured:>10.1%}{theory:>9.1%}{measured - theory:>+9.1%}{idle.schedule:>9.1%}"
                  f"{idle.transfer:>11.1%}{idle.overhead:>11.1%}{rate:>11.1f}")


def plain_loop(batch_size: int, steps: int) -> float:
    """Samples/s of a hand-written loop (median step after one warm-up), in a fresh trial process."""
    import torch

    from mbtune.workloads import load_workload

    torch.set_num_threads(1)
    workload = load_workload(WORKLOAD, OPTIONS)
    model = workload.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 1):
        inputs, targets = workload.make_batch(batch_size, generator)
        start = time.perf_counter()
        workload.loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return batch_size / statistics.median(times[1:])


def overhead(batch_size: int, steps: int, repeats: int) -> None:
    ratios = []
    for _ in range(repeats):
        spec = PipelineSpec(workload=WORKLOAD, workload_options=OPTIONS, schedule="gpipe", num_ranks=1,
                            num_micro_batches=1, micro_batch_size=batch_size, measured_steps=steps, threads=1)
        outcome = run_pipeline_point(spec, timeout_s=600)
        harness = batch_size / statistics.median(outcome.step_times_s)
        plain = run_isolated(plain_loop, batch_size, steps, timeout_s=600).value
        ratios.append(harness / plain)
    print(f"harness overhead, one stage, batch {batch_size}, {steps} steps, {repeats} runs: "
          f"mbtune / plain loop throughput = {statistics.median(ratios):.3f} (median; runs "
          + ", ".join(f"{r:.3f}" for r in ratios) + ")")


def _run_points(points: list[SweepPoint], *, repeats: int, steps: int) -> list[PointResult]:
    """The gpt demo's points, each run `repeats` times in fresh processes (figures: medians, ranges)."""
    config = SweepConfig(workload="gpt", device="cpu", num_ranks=max(p.num_ranks for p in points),
                         points=tuple(points), repeats=repeats, measured_steps=steps, threads=1)
    return list(sweep_workload(config).results)


def _rate(r: PointResult) -> str:
    return f"{r.samples_per_s:7.1f} ({r.samples_per_s_min:.1f}-{r.samples_per_s_max:.1f})"


def global_batch_table(global_batch: int, steps: int, repeats: int) -> None:
    """One global batch split every way at accumulation 1: micro-batch size 2..16 against micro-batches."""
    print(f"\nfixed global batch {global_batch}, gpt demo, 2 stages, accumulation 1, {repeats} repeats x {steps} "
          "steps (samples/s: median (min-max over repeats))")
    print("bigger micro-batches compute a sample faster; more micro-batches leave a smaller bubble")
    print(f"{'schedule':<8}{'mbs':>5}{'m':>5}{'samples/s':>26}{'bubble':>9}{'theory':>9}{'compute/sample':>16}"
          f"{'peak mem':>11}")
    points = [SweepPoint(schedule=schedule, num_ranks=2, num_micro_batches=global_batch // mbs, grad_accum_steps=1,
                         micro_batch_size=mbs) for schedule in ("gpipe", "1f1b") for mbs in (2, 4, 8, 16)]
    for r in _run_points(points, repeats=repeats, steps=steps):
        p = r.point
        if not r.ok:
            print(f"{p.schedule:<8}{p.micro_batch_size:>5}{p.num_micro_batches:>5}  {r.status}: {r.error[:80]}")
            continue
        print(f"{p.schedule:<8}{p.micro_batch_size:>5}{p.num_micro_batches:>5}{_rate(r):>26}"
              f"{r.bubble_measured:>9.1%}{r.bubble_theoretical:>9.1%}{r.compute_per_sample_s * 1e3:>13.2f} ms"
              f"{r.max_peak_memory_bytes / 2**20:>8.0f} MiB")


def data_parallel_table(global_batch: int, steps: int, repeats: int) -> None:
    """The same global batch on one pipeline and on two replicas of it (gradients all-reduced)."""
    print(f"\ndata parallel, gpt demo, 2 stages, global batch {global_batch}, 1f1b m=4, {repeats} repeats x {steps} "
          "steps (dp 2 is 4 processes on this machine's cores: oversubscribed where there are fewer)")
    print(f"{'dp':>3}{'mbs':>5}{'samples/s':>26}{'step':>10}{'all-reduce':>12}{'share':>8}{'bubble':>9}")
    points = [SweepPoint(schedule="1f1b", num_ranks=2, num_micro_batches=4, grad_accum_steps=1,
                         micro_batch_size=global_batch // (4 * dp), data_parallel_size=dp) for dp in (1, 2)]
    for r in _run_points(points, repeats=repeats, steps=steps):
        p = r.point
        if not r.ok:
            print(f"{p.data_parallel_size:>3}  {r.status}: {r.error[:80]}")
            continue
        reduce_s = r.allreduce_s or 0.0
        print(f"{p.data_parallel_size:>3}{p.micro_batch_size:>5}{_rate(r):>26}{r.step_time_median_s * 1e3:>7.1f} ms"
              f"{reduce_s * 1e3:>9.1f} ms{reduce_s / r.step_time_median_s:>8.0%}{r.bubble_measured:>9.1%}")


def recompute_table(steps: int, repeats: int) -> None:
    """Each point with and without full activation recompute: throughput cost against peak-memory saving."""
    print(f"\nrecompute, gpt demo, 2 stages, 1f1b m=4, {repeats} repeats x {steps} steps (peak: the busiest rank's "
          "VmHWM, which holds the runtime's ~250 MiB too)")
    print(f"{'mbs':>5}{'recompute':>11}{'samples/s':>26}{'peak mem':>11}{'throughput':>12}{'peak':>8}")
    points = [SweepPoint(schedule="1f1b", num_ranks=2, num_micro_batches=4, grad_accum_steps=1, micro_batch_size=mbs,
                         recompute=mode) for mbs in (8, 32) for mode in ("none", "full")]
    results = _run_points(points, repeats=repeats, steps=steps)
    for plain, full in zip(results[::2], results[1::2]):
        for r in (plain, full):
            if not r.ok:
                print(f"{r.point.micro_batch_size:>5}{r.point.recompute:>11}  {r.status}: {r.error[:80]}")
                continue
            change = (f"{r.samples_per_s / plain.samples_per_s - 1:>+12.0%}"
                      f"{r.max_peak_memory_bytes / plain.max_peak_memory_bytes - 1:>+8.0%}"
                      if r is full and plain.ok else "")
            print(f"{r.point.micro_batch_size:>5}{r.point.recompute:>11}{_rate(r):>26}"
                  f"{r.max_peak_memory_bytes / 2**20:>7.0f} MiB{change}")


SECTIONS = ("bubble", "overhead", "global-batch", "dp", "recompute")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if "bubble" in sections:
        bubble_table(args.micro_batch_size, args.steps)
    if "overhead" in sections:
        overhead(args.micro_batch_size * 4, args.steps, args.repeats)
    if "global-batch" in sections:
        global_batch_table(args.global_batch, args.steps, args.repeats)
    if "dp" in sections:
        data_parallel_table(args.global_batch, args.steps, args.repeats)
    if "recompute" in sections:
        recompute_table(args.steps, args.repeats)


if __name__ == "__main__":
    main()
