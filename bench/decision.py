"""Benchmark: is the demo's decision right, and how long does it take? First the truth: the demo's whole grid
measured long (every point a fixed number of repeats, nothing raced, nothing predicted); then `make demo`'s
tune run N times, each a fresh process, as a user runs it (raced, screened by the simulator, equal within the
declared size). Optionally with CPU-bound processes beside every run (--load K), as on a busy machine.

Prints the truth table (each point's mean samples/s and its 95% interval), then per run: its decision
(decided, equivalent, not decided), its best and group, its wall time, the points it left out as predicted;
and the figures: runs decided (decided or equivalent) and their wall time (median, min-max); runs whose
best's true throughput lies within the declared size of the true best; points left out as predicted that
were not truly below the best by more than the size (there should be none); the exit codes.

Run (about 7 minutes for the truth at 4 repeats, then 2-3 minutes a run, on two cores):
    .venv/bin/python bench/decision.py [--runs 10] [--truth-repeats 4] [--keep-truth FILE | --truth FILE] [--load 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

DEMO = ["tune", "--workload", "gpt", "--device", "auto", "--memory-budget", "512MiB", "--steps", "2", "--lr", "3e-4",
        "--reference-batch", "256"]


def label(point: dict) -> str:
    return (f"{point['schedule']} p={point['num_ranks']} m={point['num_micro_batches']} "
            f"accum={point['grad_accum_steps']} mbs={point['micro_batch_size']}")


def run_json(args: list[str]) -> tuple[dict, float, int]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mbtune", *args, "--no-save", "-f", "json"], capture_output=True,
                          text=True)
    wall = time.monotonic() - started
    if done.returncode not in (0, 1):
        print(f"run exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return {}, wall, done.returncode
    return json.loads(done.stdout), wall, done.returncode


@contextmanager
def load(processes: int):
    """CPU-bound processes beside the run (none for 0)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def truth_of(sweep: dict) -> dict[str, tuple[float, float | None]]:
    """Per point label: (mean samples/s, 95% half-interval in %)."""
    return {label(r["point"]): (r["samples_per_s"], r.get("ci_half_pct")) for r in sweep["results"]
            if r["status"] == "ok" and r.get("samples_per_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--truth-repeats", type=int, default=4)
    parser.add_argument("--truth", help="a JSON kept by --keep-truth: the truth without measuring it again")
    parser.add_argument("--keep-truth", help="where to keep the truth's JSON")
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes beside each demo run")
    args = parser.parse_args()

    if args.truth:
        with open(args.truth) as f:
            truth_run = json.load(f)
    else:
        truth_run, wall, _ = run_json([*DEMO, "--repeats", str(args.truth_repeats), "--no-check"])
        print(f"truth: the whole grid, {args.truth_repeats} repeats a point, in {wall:.0f} s")
        if args.keep_truth:
            with open(args.keep_truth, "w") as f:
                json.dump(truth_run, f)
    truth = truth_of(truth_run["sweep"])
    true_best = max(rate for rate, _ in truth.values())
    print(f"\n{'point':44s} {'samples/s':>10s} {'95% +-':>7s} {'vs best':>8s}")
    for name, (rate, half) in sorted(truth.items(), key=lambda item: -item[1][0]):
        print(f"{name:44s} {rate:10.1f} {(half or 0):6.1f}% {rate / true_best - 1:+8.1%}")

    rows = []
    for n in range(1, args.runs + 1):
        with load(args.load):
            out, wall, code = run_json(DEMO)
        sweep = out.get("sweep") or {}
        decision = sweep.get("decision") or {}
        results, ranking = sweep.get("results", []), sweep.get("ranking", [])
        size = decision.get("size", 0.03)
        best = label(results[ranking[0]]["point"]) if ranking else "-"
        group = [label(results[i]["point"]) for i in decision.get("group", [])]
        within = best in truth and truth[best][0] >= true_best * (1 - size)
        wrong_out = [label(p["point"]) for p in sweep.get("predicted", [])
                     if label(p["point"]) in truth and truth[label(p["point"])][0] >= true_best * (1 - size)]
        busy = sum(1 for r in results if (r.get("load") or {}).get("busy"))
        rows.append({"state": decision.get("state", "-"), "wall": wall, "within": within, "wrong_out": wrong_out,
                     "code": code, "left_out": len(sweep.get("predicted", []))})
        print(f"\nrun {n}: {decision.get('state', '-')} in {wall:.0f} s (exit {code}); best {best} "
              f"(true {truth.get(best, (float('nan'),))[0]:.1f}, {'within' if within else 'NOT within'} {size:.0%} of "
              f"the true best); group {group or '-'}; {len(results)} measured, {rows[-1]['left_out']} predicted, "
              f"{busy} measured busy; left out but not truly below by more than {size:.0%}: {wrong_out or 'none'}")

    decided = [r for r in rows if r["state"] in ("decided", "equivalent")]
    walls = [r["wall"] for r in rows]
    print(f"\nload beside each run: {args.load} CPU-bound process(es)")
    print(f"decided (decided or equivalent): {len(decided)} of {len(rows)}"
          + (f", in {statistics.median(r['wall'] for r in decided):.0f} s median" if decided else ""))
    print(f"wall per run: median {statistics.median(walls):.0f} s ({min(walls):.0f}-{max(walls):.0f})")
    print(f"best within the size of the true best: {sum(r['within'] for r in rows)} of {len(rows)}")
    print(f"points left out as predicted: {sum(r['left_out'] for r in rows)} in all, of which not truly below by more "
          f"than the size: {sum(len(r['wrong_out']) for r in rows)}")
    print(f"exit codes: {sorted({r['code'] for r in rows})}")


if __name__ == "__main__":
    main()
