"""Benchmark: rank processes kept between repeats (pipeline/warm.py) against fresh ones for every repeat, on
the demo's workload (gpt, 2 stages, global batch 128: the points `make demo` ranks first).

Each repeat is the sweep's own (sweeping/repeat.py run_point: the launch, the NVML sampler, the load meter,
the summary), timed from the parent. Its overhead is its wall time less its measured steps (the start or the
hand-over of the processes, the stages' build, the warm-up step, the report; a kept set's repeat of a point it
ran before is primed instead of warmed up: the ratio of each repeat's first measured step to its later ones
shows whether that leaves the first step slower). The two modes alternate round
by round (fresh then kept, kept then fresh), so the machine's drift falls on both alike. Printed: per mode,
the median overhead per repeat and its range, the share of the wall in measured steps, the ratio kept /
fresh; per point, the throughput of each mode (median and range over its repeats) and their ratio beside
the spread between one mode's own repeats, and each mode's peak memory per stage (every distinct one seen).

Run: .venv/bin/python bench/warm_ranks.py [--rounds 4] [--device cpu|cuda] [--stages 2] [--points 4] [-O KEY=VALUE]
     [--json FILE] (the figures as one JSON document too: bench/gpu_check.sh's summary reads it)
"""

from __future__ import annotations

import argparse
import statistics
import time

from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.warm import WarmRanks
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.repeat import run_point
from mbtune.sweeping.run import _placement
from mbtune.units import parse_options
from mbtune.workloads.facts import workload_facts

# The demo's leading points at global batch 128 (mbs x m x accum).
SHAPES = (("1f1b", 8, 2, 8), ("gpipe", 8, 1, 16), ("gpipe", 4, 1, 32), ("zero-bubble", 8, 2, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--points", type=int, default=len(SHAPES))
    parser.add_argument("--json", default=None)
    parser.add_argument("-O", dest="options", action="append", default=[], help="a gpt option, KEY=VALUE")
    args = parser.parse_args()
    options = parse_options(args.options)
    config = SweepConfig(workload="gpt", workload_options=options, device=args.device, num_ranks=args.stages,
                         measured_steps=args.steps, repeats=1)
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    stages, threads, _, _ = _placement(config, device)
    points = [SweepPoint(schedule=s, num_ranks=stages, num_micro_batches=m, grad_accum_steps=a, micro_batch_size=b,
                         stages_per_rank=2 if s in ("interleaved-1f1b", "zero-bubble") else None)
              for s, m, a, b in SHAPES[:args.points]]
    workload = workload_facts("gpt", options)
    seen: dict[str, list[tuple[SweepPoint, float, float, float | None, tuple[int | None, ...]]]] = {"fresh": [], "kept": []}
    first_steps: dict[str, list[float]] = {"fresh": [], "kept": []}  # a repeat's first measured step / the rest's
    with WarmRanks() as ranks:
        for index in range(args.rounds):
            for mode in (("fresh", "kept") if index % 2 == 0 else ("kept", "fresh")):
                for point in points:
                    started = time.monotonic()
                    result = run_point(point, config, device, threads, workload, None, None,
                                       ranks if mode == "kept" else None)
                    wall = time.monotonic() - started
                    if not result.ok:
                        print(f"{mode} {point.label}: {result.status}: {result.error}")
                        continue
                    seen[mode].append((point, wall, sum(result.step_times_s), result.samples_per_s,
                                       result.peak_memory_bytes))
                    if len(result.step_times_s) > 1:
                        first_steps[mode].append(result.step_times_s[0] / statistics.median(result.step_times_s[1:]))
        starts = ranks.starts
    print(f"gpt, {stages} stage(s) on {device}, {args.steps} measured steps a repeat, {args.rounds} rounds of "
          f"{len(points)} points per mode (kept processes: {starts} set(s) started)")
    print(f"{'mode':<6}{'repeats':>8}{'overhead/repeat':>17}{'range':>16}{'in measured steps':>19}")
    overheads = {}
    for mode, rows in seen.items():
        over = [wall - measured for _, wall, measured, _, _ in rows]
        overheads[mode] = statistics.median(over)
        share = sum(m for _, _, m, _, _ in rows) / sum(w for _, w, _, _, _ in rows)
        print(f"{mode:<6}{len(rows):>8}{overheads[mode]:>16.3f}s{min(over):>7.3f}-{max(over):.3f}s{share:>18.0%}")
    ratio = overheads["kept"] / overheads["fresh"]
    print(f"overhead per repeat, kept / fresh: {ratio:.2f}")
    for mode, ratios in first_steps.items():
        if ratios:
            print(f"{mode}: a repeat's first measured step / its later ones, median {statistics.median(ratios):.3f} "
                  f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} repeats)")
    figures: dict[str, object] = {"device": device, "stages": stages, "rounds": args.rounds, "sets_started": starts,
                                  "overhead_s": overheads, "overhead_kept_over_fresh": ratio,
                                  "first_step_over_rest": first_steps, "points": []}
    print(f"{'point':<40}{'fresh samples/s':>22}{'kept samples/s':>22}{'kept/fresh':>11}{'peak MiB fresh | kept':>28}")
    for point in points:
        rates, peaks = {}, {}
        for mode, rows in seen.items():
            rates[mode] = [r for p, _, _, r, _ in rows if p == point and r]
            # Kept processes count a point's memory once (its later repeats run uncounted: None).
            peaks[mode] = {tuple(peak) for p, _, _, _, peak in rows if p == point and None not in peak}
        if not rates["fresh"] or not rates["kept"]:
            continue
        cells = [f"{statistics.median(v):,.1f} ({min(v):,.0f}-{max(v):,.0f})" for v in (rates["fresh"], rates["kept"])]
        ratio = statistics.median(rates["kept"]) / statistics.median(rates["fresh"])
        mib = " | ".join(",".join("/".join(f"{b / 2**20:.1f}" for b in peak if b) for peak in sorted(peaks[m]))
                         for m in ("fresh", "kept"))
        print(f"{point.label:<40}{cells[0]:>22}{cells[1]:>22}{ratio:>11.3f}{mib:>28}")
        figures["points"].append({"point": point.label, "samples_per_s": rates, "kept_over_fresh": ratio,  # type: ignore[attr-defined]
                                  "peak_memory_bytes": {m: sorted(peaks[m]) for m in peaks}})
    if args.json:
        import json

        with open(args.json, "w") as file:
            json.dump(figures, file, indent=2)


if __name__ == "__main__":
    main()
