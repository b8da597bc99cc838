"""Benchmark: do qualification verdicts mean something on this machine?

(a) Self-check: make a baseline (the workload tuned on the CPU, each point measured as precisely as
    qualify measures: a 95% interval a quarter of the tolerance wide, or 30 s), or reuse one with
    --profile, then qualify this machine against it --runs times (default 10) at the default tolerance.
    Nothing changed: the rule is at least 9 in 10 PASS and no FAIL.
(b) Slowdowns: the same baseline with `-O slowdown=S` added to its workload (workloads/slowdown.py: every
    block's throughput cut by S), qualified --slow-runs times per S against the unchanged figures. The rule
    at 15% is at least 9 in 10 FAIL, at 12% no PASS; others give the detection rate. Every run is kept in
    a history per kind (as qualify keeps one per machine and baseline); the unchanged runs' history should
    name no step, and --keep-history keeps them for bench/history.py. A shortfall measured while other
    work keeps the machine busy is INCONCLUSIVE by design; the "busy points" column says whether it was.

Prints every run's verdict, exit code and wall time, the gating figures (best throughput now / baseline,
the geometric mean over common points, each with its measured spread), the counts, and whether both
rules held.

Run (tens of minutes on two cores):   .venv/bin/python bench/qualify.py
Quick smoke of the mechanics:         .venv/bin/python bench/qualify.py --runs 1 --repeats 1 --workload mlp \\
                                          -O layers=1 -O width=32 --memory-budget 256MiB \\
                                          --tune-args "--max-batch 32 --schedules gpipe -m 2 --accum 1"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEST = "best throughput (samples/s)"
AGGREGATE = "throughput, all common points (geometric mean of now/baseline ratios)"
STATUSES = ("PASS", "INCONCLUSIVE", "FAIL", "ERROR")


def mbtune(args: list[str], *, cwd: Path, prefix: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the mbtune CLI from this checkout; return the finished process and its wall time (s)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    start = time.perf_counter()
    done = subprocess.run([*prefix, sys.executable, "-m", "mbtune", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd)
    return done, time.perf_counter() - start


def make_baseline(args: argparse.Namespace, scratch: Path) -> Path:
    """Tune the workload like `make demo` into a scratch profiles folder; the profile's path."""
    root = scratch / "baseline"
    options = [x for kv in args.option for x in ("-O", kv)]
    # Made as the README and the CI guide say (--as-baseline: as precisely as qualify measures, a quarter of
    # the tolerance, up to its 30 s a point, nothing raced): a baseline is made once and judged against many
    # times, so its own error would bias every verdict.
    tolerance = float(args.tolerance.rstrip("%")) / (100 if args.tolerance.endswith("%") else 1) \
        if args.tolerance else 0.10
    command = ["tune", "--workload", args.workload, *options, "--device", "cpu", "--memory-budget",
               args.memory_budget, "--steps", "2", "--profiles-dir", str(root), "--as-baseline",
               *(["--target-ci", f"{tolerance / 4:g}"] if args.tolerance else []), *shlex.split(args.tune_args)]
    print("baseline: mbtune " + " ".join(command), flush=True)
    done, wall_s = mbtune(command, cwd=scratch)
    if done.returncode != 0:
        sys.exit(f"the baseline tune failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    [path] = root.glob(f"*/{args.workload}.json")
    print(f"baseline made in {wall_s:.0f} s: {path}", flush=True)
    return path


def slowed_baseline(baseline: Path, share: float, scratch: Path) -> Path:
    """The baseline profile with `slowdown=share` added to its workload's options: qualify re-runs it slower,
    against the figures the unchanged workload measured."""
    data = json.loads(baseline.read_text())
    for section in ("probe", "sweep"):
        if data.get(section):
            data[section]["workload_options"] = {**data[section].get("workload_options", {}), "slowdown": share}
    path = scratch / f"slowed-{share:g}" / baseline.parent.name / baseline.name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def qualify_once(baseline: Path, args: argparse.Namespace, scratch: Path, label: str, kind: str) -> dict:
    """One `mbtune qualify` run, kept in the history of its kind (scratch/runs-KIND); its verdict, exit code,
    wall time and gating figures (the verdict's json kept as LABEL.json under --keep)."""
    repeats = ["--repeats", str(args.repeats)] if args.repeats else []
    command = ["qualify", "--baseline", str(baseline), *repeats, "--profiles-dir", str(scratch / f"runs-{kind}"),
               "--format", "json", *(["--tolerance", args.tolerance] if args.tolerance else [])]
    done, wall_s = mbtune(command, cwd=scratch)
    try:
        verdict = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"status": "ERROR", "exit": done.returncode, "wall_s": wall_s, "error": done.stderr.strip()[-300:]}
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        (args.keep / f"{label}.json").write_text(done.stdout)
    checks = {c["name"]: c for c in verdict["checks"]}
    results = (verdict.get("sweep") or {}).get("results", [])
    keep = 1.0 - verdict["tolerance"]
    best, aggregate = checks.get(BEST, {}), checks.get(AGGREGATE, {})
    return {
        "status": verdict["status"], "exit": done.returncode, "wall_s": wall_s,
        "best_ratio": best["measured"] * keep / best["expected"] if best.get("measured") is not None else None,
        "best_spread_pct": best.get("spread_pct"), "best_status": best.get("status"),
        "aggregate_ratio": aggregate.get("measured"), "aggregate_spread_pct": aggregate.get("spread_pct"),
        "aggregate_status": aggregate.get("status"),
        "not_passed": [f"{c['name']}: {c['status']}: {c['detail']}" for c in verdict["checks"]
                       if c["gating"] and c["status"] != "PASS"],
        "per_point_fails": sum(1 for c in verdict["checks"] if not c["gating"] and c["status"] == "FAIL"),
        "per_point": sum(1 for c in verdict["checks"] if not c["gating"]),
        "busy_points": sum(1 for r in results if (r.get("load") or {}).get("busy")),
        "points": len(results),
        "load_avg": max(((r.get("load") or {}).get("load_avg_1m") or 0.0 for r in results), default=None),
        "stopped": sorted({r.get("stopped", "") for r in results}),
        "changes": [c["check"] + ": run " + str(c["run"]) + f" {c['change_pct']:+.1f}%" for c in verdict.get("changes", [])],
    }


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_run(label: str, run: dict) -> None:
    print(f"{label:<7}{run['status']:<14}{run['exit']:>4}{run['wall_s']:>8.0f}"
          f"{_fmt(run.get('best_ratio'), '.3f'):>8}{_fmt(run.get('best_spread_pct'), '.1f'):>8}"
          f"  {str(run.get('best_status')):<13}{_fmt(run.get('aggregate_ratio'), '.3f'):>8}"
          f"{_fmt(run.get('aggregate_spread_pct'), '.1f'):>8}  {str(run.get('aggregate_status')):<13}"
          f"{run.get('per_point_fails', 0):>5}/{run.get('per_point', 0):<5}"
          f"{run.get('busy_points', 0):>5}/{run.get('points', 0):<5}{_fmt(run.get('load_avg'), '.2f'):>6}  "
          f"{','.join(run.get('stopped') or [])}", flush=True)
    for line in run.get("changes", []):
        print(f"{'':7}  step named in the history: {line}")
    for line in run.get("not_passed", []):
        print(f"{'':7}  {line}")
    if run.get("error"):
        print(f"{'':7}  {run['error']}")


def header() -> None:
    print(f"{'run':<7}{'verdict':<14}{'exit':>4}{'wall s':>8}{'best':>8}{'spr %':>8}  {'':<13}"
          f"{'geomean':>8}{'spr %':>8}  {'':<13}{'point FAILs':<12}{'busy pts'}{'load':>6}  stopped")
    print("(best: fastest point now / fastest of the baseline; geomean: over common points; spr: measured spread; "
          "point FAILs are not gating; busy: points measured while other work took over a quarter of the CPUs)")


def counts_line(label: str, runs: list[dict]) -> dict[str, int]:
    counts = {s: sum(r["status"] == s for r in runs) for s in STATUSES}
    ratios = [r["aggregate_ratio"] for r in runs if r.get("aggregate_ratio") is not None]
    figures = (f"; geometric mean now/baseline median {statistics.median(ratios):.3f} "
               f"(min-max {min(ratios):.3f}-{max(ratios):.3f})") if ratios else ""
    walls = [r["wall_s"] for r in runs]
    print(f"{label}, {len(runs)} runs: " + ", ".join(f"{s} {n}" for s, n in counts.items()) + figures
          + f"; wall per run median {statistics.median(walls):.0f} s")
    return counts


def summarize(runs: list[dict], slowed: dict[float, list[dict]]) -> None:
    print()
    counts = counts_line("unchanged", runs)
    unchanged = [r["aggregate_ratio"] for r in runs if r.get("aggregate_ratio") is not None]
    need = len(runs) - len(runs) // 10
    print(f"  rule: at least {need} PASS and no FAIL: "
          f"{'held' if counts['PASS'] >= need and counts['FAIL'] == 0 else 'DID NOT HOLD'}")
    for share, slow_runs in slowed.items():
        counts = counts_line(f"slowdown {share:.0%}", slow_runs)
        ratios = [r["aggregate_ratio"] for r in slow_runs if r.get("aggregate_ratio") is not None]
        shown = (f"; the step's throughput fell by {1 - statistics.median(ratios) / statistics.median(unchanged):.1%}"
                 " (median geometric mean against the unchanged runs')") if ratios and unchanged else ""
        print(f"  detection rate (FAIL share): {counts['FAIL'] / len(slow_runs):.0%}{shown}")
        if abs(share - 0.15) < 1e-9:
            need = len(slow_runs) - len(slow_runs) // 10
            print(f"  rule: at least {need} FAIL: {'held' if counts['FAIL'] >= need else 'DID NOT HOLD'}")
        if abs(share - 0.12) < 1e-9:
            print(f"  rule: no PASS: {'held' if counts['PASS'] == 0 else 'DID NOT HOLD'}")
    named = sum(1 for r in runs if r.get("changes"))
    print(f"unchanged runs whose history named a step: {named} of {len(runs)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, help="Reuse this baseline profile instead of making one.")
    parser.add_argument("--runs", type=int, default=10, help="Self-qualifications to make (default 10).")
    parser.add_argument("--slow-runs", type=int, default=10, help="Qualifications per slowdown (default 10).")
    parser.add_argument("--slowdowns", default="0.15,0.12",
                        help="Shares of -O slowdown to qualify, each S or S:RUNS (RUNS instead of --slow-runs).")
    parser.add_argument("--keep-baseline", type=Path, help="Copy the baseline made here to this path.")
    parser.add_argument("--keep", type=Path, help="Keep each run's verdict (json) in this folder.")
    parser.add_argument("--keep-history", type=Path,
                        help="Copy the runs' histories (one per kind: self, slow0.15, ...) into this folder "
                             "(bench/history.py replays them).")
    parser.add_argument("--repeats", type=int, default=None, help="qualify --repeats (default: until known).")
    parser.add_argument("--tolerance", default=None, help="qualify --tolerance (default: qualify's, 10%%).")
    parser.add_argument("--workload", default="mlp", help="Workload of the baseline tune (default mlp).")
    parser.add_argument("-O", "--option", action="append", default=[], help="Workload option KEY=VALUE.")
    parser.add_argument("--memory-budget", default="512MiB", help="Baseline tune's budget (default 512MiB).")
    parser.add_argument("--tune-args", default="--schedules gpipe,1f1b -m 2,4 --accum 1",
                        help="More arguments for the baseline tune.")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="mbtune-bench-qualify-"))
    baseline = args.profile.resolve() if args.profile else make_baseline(args, scratch)
    if args.keep_baseline:
        args.keep_baseline.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(baseline, args.keep_baseline)
    print(f"machine: {os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable; qualify "
          f"{'--repeats ' + str(args.repeats) if args.repeats else 'until known'}, tolerance "
          f"{args.tolerance or 'default'}; best = fastest now / fastest baseline")
    header()
    runs = []
    for i in range(args.runs):
        runs.append(qualify_once(baseline, args, scratch, f"self-{i + 1}", "self"))
        print_run(f"{i + 1}", runs[-1])
    slowed: dict[float, list[dict]] = {}
    for item in (s for s in args.slowdowns.split(",") if s):
        share_text, _, count = item.partition(":")
        share = float(share_text)
        path = slowed_baseline(baseline, share, scratch)
        slowed[share] = []
        for i in range(int(count) if count else args.slow_runs):
            slowed[share].append(qualify_once(path, args, scratch, f"slow{share:g}-{i + 1}", f"slow{share:g}"))
            print_run(f"s{share:g}.{i + 1}", slowed[share][-1])
    summarize(runs, slowed)
    if args.keep_history:
        for kept in scratch.glob("runs-*/history/*/*.json"):
            target = args.keep_history / f"{kept.parents[2].name}.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(kept, target)
            print(f"history kept: {target}")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
