"""Benchmark: mbtune's model-guided probe against plain doubling + bisection on the same workload and budget.

Prints trials and wall time of each, and how far each landed from the true ceiling (found by stepping
every granule up from the probe's answer until the first OOM). Run: .venv/bin/python bench/probe.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from mbtune.config import ProbeConfig, parse_bytes, parse_options
from mbtune.probe import search_ceiling
from mbtune.records import TrialOutcome
from mbtune.worker import run_trial


def doubling_bisection(run, granularity: int) -> tuple[int, int]:
    """The classic search: double until OOM, then bisect. Returns (ceiling, trials)."""
    trials, lo, size = 0, 0, granularity
    while True:
        trials += 1
        if not run(size).ok:
            hi = size
            break
        lo, size = size, size * 2
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        trials += 1
        lo, hi = (mid, hi) if run(mid).ok else (lo, mid)
    return lo, trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("-O", "--option", action="append", default=[])
    parser.add_argument("--memory-budget", default="1GiB")
    parser.add_argument("--granularity", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    config = ProbeConfig(workload=args.workload, workload_options=parse_options(args.option), device="cpu",
                         memory_budget_bytes=parse_bytes(args.memory_budget), granularity=args.granularity)

    def run(batch: int) -> TrialOutcome:
        return run_trial(config.trial(batch_size=batch, device="cpu"), timeout_s=config.trial_timeout_s)

    rows = {"mbtune probe": [], "doubling + bisection": []}
    for _ in range(args.repeats):
        started = time.perf_counter()
        found = search_ceiling(run, granularity=config.granularity, budget_bytes=config.memory_budget_bytes,
                               margin=config.margin, confirm=config.confirm)
        rows["mbtune probe"].append((found.ceiling, len(found.trials), time.perf_counter() - started))
        started = time.perf_counter()
        ceiling, trials = doubling_bisection(run, config.granularity)
        rows["doubling + bisection"].append((ceiling, trials, time.perf_counter() - started))

    truth = truth_ceiling(run, min(r[0] for r in rows["mbtune probe"]), config.granularity)
    print(f"workload {config.workload} {dict(config.workload_options)}, budget {args.memory_budget}, "
          f"granularity {config.granularity}, repeats {args.repeats}")
    print(f"true ceiling (stepping up until two OOMs in a row): {truth}")
    print(f"{'method':<22}{'ceilings':>18}{'trials (median)':>17}{'wall s (median)':>17}{'off by (median)':>17}")
    for name, results in rows.items():
        ceilings = ",".join(str(r[0]) for r in results)
        print(f"{name:<22}{ceilings:>18}{statistics.median(r[1] for r in results):>17}"
              f"{statistics.median(r[2] for r in results):>17.1f}"
              f"{statistics.median(r[0] - truth for r in results):>17}")
    note = ("doubling + bisection reports a single pass, unconfirmed and with no safe-batch run; "
            "mbtune's count includes confirmation and the safe-batch verification")
    print(note)


def truth_ceiling(run, start: int, granularity: int) -> int:
    """Step every granule up from start; the truth is the last size before two consecutive OOMs."""
    size, last_ok, misses = start, start, 0
    while misses < 2:
        if run(size).ok:
            last_ok, misses = size, 0
        else:
            misses += 1
        size += granularity
    return last_ok


if __name__ == "__main__":
    main()
