"""Benchmark: does the history find a step when there is one, and only then?

Replays series of qualification runs built from this machine's own measured runs: the runs of a history
(bench/qualify.py --keep-history DIR keeps them; `mbtune qualify` writes one per machine and baseline),
each gating check's figures over their median, drawn with replacement (a bootstrap of real runs, not a
formula) into series of --length runs (default 100).

(a) No change: --quiet-series series (default 20) as drawn. The rule: no change point in any.
(b) A step: --step-series series (default 10), each with every run from a random point on (between 30% and
    70% of the way) multiplied by 1 - --step (default 8% slower). Each series is watched as the nightly job
    sees it, run by run after the step: the step counts as found when the history first names a change
    within 2 runs of where it is, and the rule is that this happens within 5 runs of it in at least 9 of 10
    series. The change named in the whole series is reported too (where, and its size with its interval).

Prints every series, the false and missed detections, and whether both rules held.

Run:  .venv/bin/python bench/history.py --history DIR/runs-self.json   (a few seconds)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbtune.qualifying.changes import change_points  # noqa: E402
from mbtune.qualifying.history import gating_series, read_history  # noqa: E402

WITHIN = 5  # runs after the step by which it must be named
WHERE = 2  # how close to the step a named change must sit


def pools(path: Path) -> dict[str, list[float]]:
    """Each gating check's figures over their median, for checks measured in 5 runs or more and not constant."""
    history = read_history(path)
    if history is None:
        sys.exit(f"no history at {path}")
    out = {}
    for name, rows in gating_series(history).items():
        values = [v for _, v in rows]
        if len(values) >= 5 and len(set(values)) > 1 and statistics.median(values) > 0:
            middle = statistics.median(values)
            out[name] = [v / middle for v in values]
    if not out:
        sys.exit(f"{path}: no gating check with 5 runs or more that moves (ceilings that never move are not replayed)")
    return out


def named_after(series: np.ndarray, at: int) -> int | None:
    """The first run after the step (1 = the step's own run) at which the history names a change within WHERE
    runs of it, watching up to WITHIN + 5 runs; None if it never does."""
    for seen in range(1, WITHIN + 6):
        end = at + seen
        if end > len(series):
            return None
        if any(abs(s.index - at) <= WHERE for s in change_points(series[:end])):
            return seen
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=Path, required=True, help="A history file of unchanged runs.")
    parser.add_argument("--length", type=int, default=100, help="Runs per replayed series (default 100).")
    parser.add_argument("--quiet-series", type=int, default=20, help="Series with no change (default 20).")
    parser.add_argument("--step-series", type=int, default=10, help="Series with a step (default 10).")
    parser.add_argument("--step", type=float, default=0.08, help="The step, a share slower (default 0.08).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    held = True
    for name, pool in pools(args.history).items():
        spread = statistics.stdev(pool)
        print(f"\n{name}: {len(pool)} measured runs, spread of one run {100 * spread:.1f}% "
              f"(min-max {min(pool):.3f}-{max(pool):.3f} of their median)")
        false = 0
        for i in range(args.quiet_series):
            series = rng.choice(pool, size=args.length)
            found = change_points(series)
            false += bool(found)
            if found:
                print(f"  quiet {i + 1}: FALSE change(s) at run(s) " + ", ".join(
                    f"{s.index + 1} ({100 * s.change:+.1f}%)" for s in found))
        print(f"  no change: {false} of {args.quiet_series} series named a change (rule: none)")
        held &= false == 0
        in_time = 0
        for i in range(args.step_series):
            series = rng.choice(pool, size=args.length)
            at = int(rng.integers(int(0.3 * args.length), int(0.7 * args.length)))
            series[at:] *= 1 - args.step
            seen = named_after(series, at)
            in_time += seen is not None and seen <= WITHIN
            whole = change_points(series)
            words = ", ".join(f"run {s.index + 1}: {100 * s.change:+.1f}% ±{100 * s.half:.1f}%" for s in whole)
            when = f"at its run {seen}" if seen else f"NOT within {WITHIN + 5} runs"
            print(f"  step {i + 1}: at run {at + 1}; named {when}; in the whole series: {words or 'none'}")
        need = args.step_series - args.step_series // 10
        print(f"  a {args.step:.0%} step: named within {WITHIN} runs in {in_time} of {args.step_series} series, "
              f"missed in {args.step_series - in_time} (rule: at least {need})")
        held &= in_time >= need
    print(f"\nboth rules {'held' if held else 'DID NOT HOLD'}")


if __name__ == "__main__":
    main()
