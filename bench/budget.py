"""Benchmark: the CPU budget's answers held against what really runs.

1. The probe (from its prediction), with its trials and wall time.
2. Near the ceiling, a size is a size: `--runs` fresh trials at the ceiling - 1 granule, the ceiling and the
   ceiling + 1 granule, each size's outcomes and the spread of its peaks.
3. The user's own training loop (examples/nanogpt/train.py, a plain loop) under `mbtune confirm`: at the
   safe batch, at the ceiling, one granule above it and at ceiling x 1.15, each with its peak.
4. The margin: how far apart fitting and failing sizes were, the peaks' run-to-run spread, the gap between
   the trial's peak and the user loop's at the same size, and whether the margin covers them.

Run: .venv/bin/python bench/budget.py [--budget 512MiB] [--runs 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from mbtune.probing.config import ProbeConfig, TrialConfig
from mbtune.probing.run import probe_workload
from mbtune.probing.trial import run_trial
from mbtune.units import parse_bytes, size_flag

WORKLOAD = "examples.nanogpt.workload:gpt"
LOOP = [sys.executable, "-m", "examples.nanogpt.train"]
MIB = 2**20


def confirm(budget: int, batch: int, runs: int) -> dict:
    command = [sys.executable, "-m", "mbtune", "-q", "confirm", "--memory-budget", size_flag(budget), "--runs",
               str(runs), "-d", "cpu", "-f", "json", "--", *LOOP, "--batch-size", str(batch)]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=False).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="512MiB")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--confirm-runs", type=int, default=3)
    args = parser.parse_args()
    budget = parse_bytes(args.budget)

    started = time.perf_counter()
    probed = probe_workload(ProbeConfig(workload=WORKLOAD, device="cpu", memory_budget_bytes=budget, resolution=1))
    wall = time.perf_counter() - started
    ceiling, safe, g = probed.ceiling, probed.safe_batch, probed.granularity
    predicted = probed.predicted.ceiling if probed.predicted else None
    print(f"1. probe of {WORKLOAD} under {args.budget}: ceiling {ceiling}, first failing {probed.first_failing}, "
          f"safe batch {safe}; predicted {predicted} before any trial; {len(probed.trials)} trials, {wall:.1f} s")

    print(f"\n2. {args.runs} fresh trials a size (peak: live tensor bytes, MiB)")
    peaks_at: dict[int, list[int]] = {}
    for size in (ceiling - g, ceiling, ceiling + g):
        outcomes = [run_trial(TrialConfig(workload=WORKLOAD, batch_size=size, device="cpu", memory_budget_bytes=budget),
                              timeout_s=600) for _ in range(args.runs)]
        statuses = sorted({o.status for o in outcomes})
        peaks = [o.budget_used_bytes for o in outcomes if o.ok and o.budget_used_bytes]
        peaks_at[size] = peaks
        spread = (f"peaks {min(peaks) / MIB:.3f}-{max(peaks) / MIB:.3f} (median {statistics.median(peaks) / MIB:.3f})"
                  if peaks else "")
        print(f"  batch {size}: {', '.join(f'{s} {sum(o.status == s for o in outcomes)}/{args.runs}' for s in statuses)}"
              f" {spread}")

    print(f"\n3. the user's own loop ({' '.join(LOOP[1:])}) under mbtune confirm, {args.confirm_runs} runs a size")
    loop_peaks: dict[int, int | None] = {}
    for label, size in (("safe batch", safe), ("ceiling", ceiling), ("ceiling + 1 granule", ceiling + g),
                        ("ceiling x 1.15", int(ceiling * 1.15))):
        result = confirm(budget, size, args.confirm_runs)
        outcomes = [run["outcome"] for run in result["runs"]]
        peaks = [run["peak_bytes"] for run in result["runs"] if run["peak_bytes"]]
        loop_peaks[size] = max(peaks) if peaks else None
        print(f"  {label} ({size}): {', '.join(f'{o} {outcomes.count(o)}/{len(outcomes)}' for o in sorted(set(outcomes)))}"
              f", peak {max(peaks) / MIB:.3f} MiB, exit code {result['exit_code']}" if peaks else "")

    print("\n4. the margin")
    at_ceiling = peaks_at.get(ceiling) or [0]
    spread = (max(at_ceiling) - min(at_ceiling)) / max(at_ceiling) if max(at_ceiling) else 0.0
    gap = ((loop_peaks[ceiling] or 0) - max(at_ceiling)) / max(at_ceiling) if max(at_ceiling) else 0.0
    print(f"  fitting and failing sizes were {(probed.first_failing or ceiling) - ceiling} sample(s) apart; the peaks "
          f"at the ceiling spread {spread:.2%} over {len(at_ceiling)} runs; the user loop's peak at the ceiling was "
          f"{gap:+.2%} of the trial's")
    room = probed.margin * ceiling
    print(f"  the {probed.margin:.0%} margin leaves {room:.0f} samples ({room * (probed.memory_model.per_sample_bytes or 0) / MIB:.0f} "
          f"MiB at the fitted per-sample cost) for what mbtune cannot see; these measurements needed "
          f"{max(spread, gap, 0):.2%} of it" if probed.memory_model else "")


if __name__ == "__main__":
    main()
