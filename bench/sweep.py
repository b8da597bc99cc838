"""Benchmark: measured vs theoretical bubble for GPipe and 1F1B at two stages, m = 2..16, on CPU; and the
harness overhead: mbtune's one-stage measured step against a plain hand-written training loop.

Run: .venv/bin/python bench/sweep.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from mbtune.pipeline import PipelineSpec, run_pipeline_point, theoretical_bubble
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
                                num_microbatches=m, micro_batch_size=micro_batch_size, measured_steps=steps, threads=1)
            outcome = run_pipeline_point(spec, timeout_s=600)
            if not outcome.ok:
                print(f"{schedule:<8}{m:>4}  {outcome.status}: {outcome.error}")
                continue
            theory = theoretical_bubble(schedule, num_ranks=2, num_microbatches=m)
            measured = outcome.measured_bubble
            rate = spec.global_batch_size / statistics.median(outcome.step_times_s)
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
                            num_microbatches=1, micro_batch_size=batch_size, measured_steps=steps, threads=1)
        outcome = run_pipeline_point(spec, timeout_s=600)
        harness = batch_size / statistics.median(outcome.step_times_s)
        plain = run_isolated(plain_loop, batch_size, steps, timeout_s=600).value
        ratios.append(harness / plain)
    print(f"harness overhead, one stage, batch {batch_size}, {steps} steps, {repeats} runs: "
          f"mbtune / plain loop throughput = {statistics.median(ratios):.3f} (median; runs "
          + ", ".join(f"{r:.3f}" for r in ratios) + ")")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bubble_table(args.micro_batch_size, args.steps)
    overhead(args.micro_batch_size * 4, args.steps, args.repeats)


if __name__ == "__main__":
    main()
