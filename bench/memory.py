"""Benchmark: every rank's predicted peak memory (pipeline/rank_memory.py, before anything runs) against the peak
the same point's rank measured in a real pipelined run: on the CPU its live tensor bytes (device/tensor_bytes.py),
on CUDA the allocator's allocated peak.

Per workload, schedule, micro-batch count and recompute mode: both ranks' measured and predicted peaks and
the error; then the median and worst error over all of them, and per (workload, schedule, recompute, rank)
how far the prediction's growth from the fewest to the most micro-batches is from the measured growth.

With --against-computed, no sweep runs: every point's prediction with later micro-batches echoed from
earlier ones (pipeline/echoes.py, what `plan` and the probe use) is held against the same prediction with
every micro-batch computed, and both are timed.

Run: .venv/bin/python bench/memory.py [--workloads gpt,hf:llama,hf:bert] [--micro-batches 2,4,8,16]
     on one GPU: python bench/memory.py --device cuda --ranks 1 --precision bf16 [-O layers=8 ...]
     echoed against computed: .venv/bin/python bench/memory.py --against-computed
"""

from __future__ import annotations

import argparse
import statistics
import time

from mbtune.pipeline.launch import run_pipeline_point
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.units import parse_options
from mbtune.worker import run_isolated

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv")
MIB = 2**20


def _predict_all(specs: list[PipelineSpec], echoes: bool = True) -> list[tuple[int, ...]]:
    """Every spec's predicted rank peaks, in one process (the workload is loaded once there)."""
    from mbtune.pipeline.rank_memory import RankPeaks
    from mbtune.workloads import load_workload

    peaks = RankPeaks(load_workload(specs[0].workload, specs[0].workload_options), echoes=echoes)
    return [peaks(spec) for spec in specs]


def _specs(workload: str, schedules: tuple[str, ...], recomputes: list[str], micro_batches: list[int],
           micro_batch_size: int, *, device: str, ranks: int, precision: str,
           options: tuple[tuple[str, object], ...]) -> list[PipelineSpec]:
    return [PipelineSpec(workload=workload, workload_options=options, schedule=schedule, num_ranks=ranks,
                         num_micro_batches=m, micro_batch_size=micro_batch_size, recompute=recompute,
                         measured_steps=1, device=device, precision=precision)
            for schedule in schedules for recompute in recomputes for m in micro_batches]


def against_computed(workloads: list[str], micro_batches: list[int], recomputes: list[str], micro_batch_size: int,
                     *, ranks: int, precision: str, options: tuple[tuple[str, object], ...],
                     schedules: tuple[str, ...]) -> None:
    num_equal = num_peaks = 0
    for workload in workloads:
        specs = _specs(workload, schedules, recomputes, micro_batches, micro_batch_size, device="cpu", ranks=ranks,
                       precision=precision, options=options)
        timed = []
        for echoes in (True, False):
            started = time.perf_counter()
            outcome = run_isolated(_predict_all, specs, echoes, timeout_s=3600)
            if outcome.status != "ok":
                print(f"{workload}: the prediction failed: {outcome.error}")
                break
            timed.append((outcome.value, time.perf_counter() - started))
        if len(timed) < 2:
            continue
        (echoed, echoed_s), (computed, computed_s) = timed
        for spec, fast, whole in zip(specs, echoed, computed, strict=True):
            for rank, (a, b) in enumerate(zip(fast, whole, strict=True)):
                num_peaks += 1
                num_equal += a == b
                if a != b:
                    print(f"{workload:<10}{spec.schedule:<18}{spec.recompute:<10}{spec.num_micro_batches:>3}{rank:>5}"
                          f"  echoed {a / MIB:.2f} MiB, computed {b / MIB:.2f} MiB")
        print(f"{workload}: {len(specs)} points predicted in {echoed_s:.1f} s echoed, {computed_s:.1f} s computed "
              f"(ratio {echoed_s / computed_s:.2f}; one process each, the model loaded once)")
    print(f"\n{num_equal} of {num_peaks} rank peaks echoed equal to computed")


def _pct(predicted: float, measured: float) -> float:
    return 100 * (predicted - measured) / measured


def run(workloads: list[str], micro_batches: list[int], recomputes: list[str], micro_batch_size: int, *,
        device: str = "cpu", ranks: int = 2, precision: str = "fp32", options: tuple[tuple[str, object], ...] = (),
        schedules: tuple[str, ...] = SCHEDULES) -> None:
    errors: list[float] = []
    growth: list[tuple[str, float]] = []
    print(f"{ranks} stage(s) on {device}, {precision}, micro-batch size {micro_batch_size}, one warm-up and one "
          "measured step per point; MiB")
    print(f"{'workload':<10}{'schedule':<18}{'recompute':<10}{'m':>3}{'rank':>5}{'measured':>10}{'predicted':>11}"
          f"{'error':>8}")
    for workload in workloads:
        specs = _specs(workload, schedules, recomputes, micro_batches, micro_batch_size, device=device, ranks=ranks,
                       precision=precision, options=options)
        started = time.perf_counter()
        predicted = run_isolated(_predict_all, specs, timeout_s=3600)
        if predicted.status != "ok":
            print(f"{workload}: the prediction failed: {predicted.error}")
            continue
        predict_s = time.perf_counter() - started
        measured: dict[tuple[str, str], dict[int, tuple[int | None, ...]]] = {}
        for spec, peaks in zip(specs, predicted.value):
            outcome = run_pipeline_point(spec, timeout_s=600)
            if not outcome.ok:
                print(f"{workload:<10}{spec.schedule:<18}{spec.recompute:<10}{spec.num_micro_batches:>3}  "
                      f"{outcome.status}: {outcome.error}")
                continue
            measured.setdefault((spec.schedule, spec.recompute), {})[spec.num_micro_batches] = outcome.peak_memory_bytes
            for rank, (real, guess) in enumerate(zip(outcome.peak_memory_bytes, peaks)):
                if real is None:
                    continue
                errors.append(_pct(guess, real))
                print(f"{workload:<10}{spec.schedule:<18}{spec.recompute:<10}{spec.num_micro_batches:>3}{rank:>5}"
                      f"{real / MIB:>10.2f}{guess / MIB:>11.2f}{errors[-1]:>+7.2f}%")
            measured[(spec.schedule, spec.recompute)][-spec.num_micro_batches] = peaks  # predicted, by -m
        print(f"{workload}: {len(specs)} points predicted in {predict_s:.1f} s (one process, the model traced once)")
        growth += _growth(workload, measured, micro_batches)
    _summary(errors, growth, micro_batches)


def _growth(workload: str, table: dict[tuple[str, str], dict[int, tuple[int | None, ...]]],
            micro_batches: list[int]) -> list[tuple[str, float]]:
    low, high = min(micro_batches), max(micro_batches)
    rows = []
    for (schedule, recompute), by_m in table.items():
        if low not in by_m or high not in by_m:
            continue
        for rank, (lo, hi) in enumerate(zip(by_m[low], by_m[high])):
            grown, guessed = (hi or 0) - (lo or 0), by_m[-high][rank] - by_m[-low][rank]
            if grown > 0:
                rows.append((f"{workload} {schedule} {recompute} rank {rank}: measured +{grown / MIB:.2f}, "
                             f"predicted +{guessed / MIB:.2f} MiB", _pct(guessed, grown)))
    return rows


def _summary(errors: list[float], growth: list[tuple[str, float]], micro_batches: list[int]) -> None:
    if not errors:
        return
    sizes = sorted(abs(e) for e in errors)
    quartiles = statistics.quantiles(sizes, n=4) if len(sizes) > 1 else [sizes[0]] * 3
    print(f"\npeak error over {len(sizes)} rank peaks: median |error| {statistics.median(sizes):.2f}%, "
          f"quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f}%, worst {sizes[-1]:.2f}%")
    if growth:
        print(f"growth from m={min(micro_batches)} to m={max(micro_batches)} (where memory grew):")
        for label, error in growth:
            print(f"  {label} ({error:+.1f}%)")
        worst = max(abs(e) for _, e in growth)
        print(f"growth error: median |error| {statistics.median(abs(e) for _, e in growth):.2f}%, worst {worst:.2f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="gpt,hf:llama,hf:bert")
    parser.add_argument("--micro-batches", default="2,4,8,16")
    parser.add_argument("--recompute", default="none,full")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (every rank on its own GPU)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("-O", dest="options", action="append", default=[], help="a workload option, KEY=VALUE")
    parser.add_argument("--against-computed", action="store_true",
                        help="no sweeps: echoed predictions against every micro-batch computed, both timed")
    args = parser.parse_args()
    options = parse_options(args.options)
    if args.against_computed:
        against_computed(args.workloads.split(","), [int(m) for m in args.micro_batches.split(",")],
                         args.recompute.split(","), args.micro_batch_size, ranks=args.ranks, precision=args.precision,
                         options=options, schedules=tuple(args.schedules.split(",")))
        return
    run(args.workloads.split(","), [int(m) for m in args.micro_batches.split(",")], args.recompute.split(","),
        args.micro_batch_size, device=args.device, ranks=args.ranks, precision=args.precision, options=options,
        schedules=tuple(args.schedules.split(",")))


if __name__ == "__main__":
    main()
