"""Benchmark: does the best configuration repeat? Runs one tune (or sweep) command N times, each a fresh
process, and prints each run's best row, the rows it names as tied with the best, its wall time and the share
of it in measured steps (every repeat's timed steps and the probe's; not the warm-up steps), and across the runs:
whether every run's best lies in every other run's best-or-tied group, and the rows tied in every run.

Run: .venv/bin/python bench/demo_repeats.py [--runs 5] [-- mbtune tune ...]
(default: the README's `make demo` line, the built-in gpt under a 512 MiB budget).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEMO = ["tune", "--workload", "gpt", "--device", "auto", "--memory-budget", "512MiB", "--steps", "2", "--lr", "3e-4",
        "--reference-batch", "256"]


def label(row: dict) -> str:
    p = row["point"]
    return (f"{p['schedule']} p={p['num_ranks']} m={p['num_micro_batches']} accum={p['grad_accum_steps']} "
            f"mbs={p['micro_batch_size']}" + (f" dp={p['data_parallel_size']}" if p.get("data_parallel_size", 1) > 1
                                              else "") + (f" {p['recompute']}" if p.get("recompute", "none") != "none"
                                                          else ""))


def measured_steps_s(sweep: dict, probe: dict | None) -> float:
    """The run's time in measured steps: every repeat's timed steps, and the probe's trials'."""
    steps = sum(sum(r.get("step_times_s") or ()) for r in sweep["results"])
    return steps + sum(sum(t.get("step_times_s") or ()) for t in (probe or {}).get("trials", ()))


def one_run(args: list[str], keep: str | None) -> tuple[str, list[str], dict, dict | None, float]:
    started = time.monotonic()
    command = [sys.executable, "-m", "mbtune", *args, "--no-save", "-f", "json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    if keep:
        with open(keep, "w") as f:
            f.write(done.stdout)
    out = json.loads(done.stdout)
    sweep = out.get("sweep", out)
    results, ranking = sweep["results"], sweep["ranking"]
    best = label(results[ranking[0]])
    tied = [label(results[i]) for i in sweep.get("ties", [])]
    return best, tied, sweep, out.get("probe"), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep", help="a folder to keep each run's JSON in (run-N.json)")
    parser.add_argument("command", nargs="*", help="mbtune's arguments after `--` (default: the demo's)")
    args = parser.parse_args()
    command = args.command or DEMO
    print(f"command: mbtune {' '.join(command)}; {args.runs} fresh runs")
    runs = []
    for index in range(args.runs):
        load = os.getloadavg()[0]
        keep = None
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            keep = os.path.join(args.keep, f"run-{index + 1}.json")
        best, tied, sweep, probe, seconds = one_run(command, keep)
        rows = len(sweep["results"])
        stopped = sorted({r.get("stopped", "") for r in sweep["results"]})
        halves = sorted(r["ci_half_pct"] for r in sweep["results"] if r.get("ci_half_pct") is not None)
        spread = f"{halves[0]:.1f}-{halves[-1]:.1f}%" if halves else "n/a"
        measured = measured_steps_s(sweep, probe)
        repeats = sum(r.get("num_repeats") or 0 for r in sweep["results"])
        print(f"run {index + 1}: best {best}; tied with it {len(tied)} of {rows - 1} rows; intervals +-{spread}; "
              f"stopped {', '.join(stopped)}; {seconds:.0f} s, {measured:.1f} s of it in measured steps "
              f"({measured / seconds:.0%}; {repeats} repeats); load average before {load:.2f}", flush=True)
        if tied:
            print("   tied: " + "; ".join(tied))
        runs.append((best, set(tied)))
    groups = [{best} | tied for best, tied in runs]
    held = sum(all(best in group for group in groups) for best, _ in runs)
    always = set.intersection(*groups)
    print(f"every run's best inside every run's best-or-tied group: {held} of {len(runs)} runs' bests")
    print(f"the same best in every run: {len({best for best, _ in runs}) == 1}; distinct bests: "
          f"{sorted({best for best, _ in runs})}")
    print(f"rows best-or-tied in every run ({len(always)}): {'; '.join(sorted(always)) or 'none'}")


if __name__ == "__main__":
    main()
