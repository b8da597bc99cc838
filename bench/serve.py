"""Benchmark: `mbtune serve` on the gpt workload on CPU: the throughput-latency table, the queueing
simulator's p99 and throughput errors against what was measured, and the noise floor they should be read
against (each run's winner measured again at each of its rates, in a fresh server with another draw of
arrivals); with --runs N, the whole serve run N times: does the chosen configuration (or the group it
names as tied) repeat, and how far does one load's p99 move over all the runs' second measurements?

Prints, per configuration and rate: throughput, p50, p99 measured with its 95% interval, p99 predicted
(leave one out) and the error; then the median and worst p99 and throughput errors, the same loads' p99
and throughput run-to-run differences (median and worst: the loads serve's second look measured twice,
and the winner's rates again: over those within the budget, split by how far the calibrated simulator says
their p99 moves when the machine serves DRIFT slower (steady loads, and those at the knee, near saturation,
where a few percent of the machine's speed moves the p99 by more than the target), and those past the
budget, whose queues grow), each run's choice and ties, and the wall time.

With --looks-after REPORT (a run kept by --keep), no serve run: that run's winner measured at each of its
rates --times more times, each in a fresh server, and how far the p99 moves between two of those looks,
none of which chose the winner, beside how far the first moved from the look that did.

Run (about fifteen minutes a run on two cores):   .venv/bin/python bench/serve.py [--p99 200ms] [--workload gpt] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections import Counter
from pathlib import Path

from mbtune.serving.config import ServeConfig
from mbtune.serving.records import ConfigRun, LoadResult, ServeReport
from mbtune.serving.run import AGAIN_SEED, serve_loads, serve_workload
from mbtune.serving.traffic import POISSON
from mbtune.units import parse_duration

# How much slower the machine may serve from one measurement to the next: the saturated loads' throughput
# (the model's capacity) moved by up to 4% between runs (404-438/s, bench runs of the release before).
DRIFT = 0.05
TARGET = 0.15  # the p99 repeat the bench is held to (median over its loads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("--p99", default="200ms")
    parser.add_argument("--strategy", default="grid")
    parser.add_argument("--runs", type=int, default=1, help="whole serve runs, for the choice's repeatability")
    parser.add_argument("--keep", type=Path, help="keep each run's report (json) in this folder")
    parser.add_argument("--looks-after", type=Path, metavar="REPORT",
                        help="no serve run: the winner of a report kept by --keep, measured --times more times")
    parser.add_argument("--times", type=int, default=4)
    args = parser.parse_args()
    config = ServeConfig(p99_budget_s=parse_duration(args.p99, name="--p99"), workload=args.workload, device="cpu",
                         strategy=args.strategy)
    if args.looks_after:
        print(f"== {args.looks_after}, {args.times} looks after the choice, load average {os.getloadavg()[0]:.2f}")
        looks_after(ServeReport.from_dict(json.loads(args.looks_after.read_text())), config, times=args.times)
        return
    choices = []
    for index in range(args.runs):
        print(f"== run {index + 1} of {args.runs}, load average {os.getloadavg()[0]:.2f}", flush=True)
        choices.append(one_run(config, keep=args.keep / f"run-{index + 1}.json" if args.keep else None))
    if args.runs > 1:
        summary = _floor_summary({name: [d for *_, floor in choices for d in floor[name]] for name in FLOORS})
        if summary:
            print(f"noise floor over the {args.runs} runs, the winners' loads measured again: {summary}")
        groups = [{best} | tied for best, tied, _ in choices]
        held = sum(all(best in group for group in groups) for best, *_ in choices)
        common, count = Counter(best for best, *_ in choices).most_common(1)[0]
        print(f"every run's choice inside every run's chosen-or-tied group: {held} of {len(choices)}; distinct "
              f"choices: {sorted({best for best, *_ in choices})}; the most common, {common}, chosen in {count} of "
              f"{len(choices)} runs and chosen or named tied in {sum(common in group for group in groups)}")


def one_run(config: ServeConfig, *, keep: Path | None = None) -> tuple[str, set[str], dict[str, list[float]]]:
    """One serve run, printed (its report kept as json at `keep`): its choice, the configurations it names
    as tied, and its noise floor (noise_floor)."""
    started = time.perf_counter()
    report = serve_workload(config)
    wall_s = time.perf_counter() - started
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        keep.write_text(json.dumps(report.to_dict()))
    print(f"{config.workload} on CPU, p99 budget {config.p99_budget_s * 1e3:g} ms, {report.threads} model thread(s); "
          f"inference ceiling {report.ceiling.ceiling}, safe batch {report.ceiling.safe_batch}")
    print(f"{'configuration':<34} {'rate/s':>8} {'thru/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'95% CI':>8} {'pred ms':>8} {'error':>7}")
    errors = []
    seen = set()
    for load in report.loads:
        if load.kind != POISSON:
            continue
        again = "again" if (load.config, load.rate_per_s) in seen else ""
        seen.add((load.config, load.rate_per_s))
        error = ""
        if load.p99_s and load.predicted_p99_s is not None:
            errors.append(abs(load.predicted_p99_s - load.p99_s) / load.p99_s)
            error = f"{errors[-1]:.0%}"
        print(f"{load.config.label:<34} {load.rate_per_s:>8g} {load.throughput_per_s:>8.1f} {_ms(load.p50_s):>8} "
              f"{_ms(load.p99_s):>8} {_half(load):>8} {_ms(load.predicted_p99_s):>8} {error:>7} {again}")
    if errors:
        print(f"simulator p99 error (leave one out): median {statistics.median(errors):.0%}, worst {max(errors):.0%} "
              f"over {len(errors)} loads")
    throughput = throughput_errors(report, config)
    if throughput:
        print(f"simulator throughput error (calibrated on every load): median {statistics.median(throughput):.1%}, "
              f"worst {max(throughput):.1%} over {len(throughput)} loads")
    second_look(report)
    winner = report.winner
    tied = {report.answers[i].config.label for i in report.ties}
    if winner is not None:
        print(f"winner: {winner.config.label}, {winner.max_rate_per_s:g} requests/s within the budget "
              f"(p99 {_ms(winner.p99_at_max_s)} ms); its highest rate lies in [{winner.bracket_low_per_s:g}, "
              f"{winner.bracket_high_per_s or 'above'}); tied with it: {', '.join(sorted(tied)) or 'none'}")
    print(f"wall time: {wall_s:.0f} s for the run", flush=True)
    floor = noise_floor(report, config) if winner is not None else {name: [] for name in FLOORS}
    return (winner.config.label if winner else "none"), tied, floor


def throughput_errors(report, config: ServeConfig) -> list[float]:
    """|predicted - measured| / measured throughput per Poisson load, the simulator calibrated as serve left it."""
    from mbtune.serving import simulate

    check = report.simulator
    if check is None:
        return []
    service = simulate.curve_sampler(report.curve, check.service_scale)
    errors = []
    for load in report.loads:
        if load.kind == POISSON and load.throughput_per_s > 0:
            guess = simulate.predict(load.config, load.rate_per_s, service, overhead_s=check.overhead_s,
                                     queue_timeout_s=config.queue_timeout, seed=config.seed)
            errors.append(abs(guess.throughput_per_s - load.throughput_per_s) / load.throughput_per_s)
    return errors


def second_look(report) -> None:
    """The loads serve itself measured twice (its second look, a fresh server each): how far their p99 and
    throughput moved."""
    p99s, rates = [], []
    for run in report.runs:
        seen = {}
        for load in run.loads:
            if load.kind != POISSON:
                continue
            first = seen.setdefault(load.rate_per_s, load)
            if first is load:
                continue
            if first.p99_s and load.p99_s:
                p99s.append(abs(load.p99_s - first.p99_s) / first.p99_s)
            if first.throughput_per_s:
                rates.append(abs(load.throughput_per_s - first.throughput_per_s) / first.throughput_per_s)
    if p99s:
        print(f"second look: {len(p99s)} loads measured twice in this run differ in p99 by median "
              f"{statistics.median(p99s):.0%}, worst {max(p99s):.0%}; in throughput by median "
              f"{statistics.median(rates):.1%}, worst {max(rates):.1%}")


STEADY, KNEE, PAST = "steady", "at the knee", "past the budget"
FLOORS = (STEADY, KNEE, PAST)


def noise_floor(report, config: ServeConfig) -> dict[str, list[float]]:
    """The winner's rates again, each once, in a fresh server with another draw of arrivals: how far one
    load's p99 moves from one measurement to the next, by kind of load (FLOORS, load_kind)."""
    run, first = first_looks(report)
    again = measure_again(report, config, sorted(first), seed=config.seed + 2 * AGAIN_SEED)
    floor: dict[str, list[float]] = {name: [] for name in FLOORS}
    rates = []
    for load in again.loads:
        before = first[load.rate_per_s]
        if not (before.p99_s and load.p99_s):
            continue
        difference = abs(load.p99_s - before.p99_s) / before.p99_s
        kind, moves = load_kind(report, config, before)
        floor[kind].append(difference)
        rates.append(abs(load.throughput_per_s - before.throughput_per_s) / before.throughput_per_s)
        print(f"  again {run.config.label} at {load.rate_per_s:g}/s: p99 {_ms(before.p99_s)} ms "
              f"{_half(before)} then {_ms(load.p99_s)} ms {_half(load)}: {difference:.0%} ({kind}: "
              f"{DRIFT:.0%} slower moves its simulated p99 by {moves:.0%})")
    summary = _floor_summary(floor)
    if summary:
        print(f"noise floor, the winner's loads measured again: {summary}; in throughput by median "
              f"{statistics.median(rates):.1%}")
    return floor


def looks_after(report, config: ServeConfig, *, times: int) -> None:
    """The winner's rates measured `times` times more, each in a fresh server after the choice: how far one
    load's p99 moves between two measurements that did not choose it, beside how far the first of them
    moved from the one that did (the winner's first look won against its rivals' on the same machine: the
    luckier of several, so a later look regresses from it, the winner's curse)."""
    run, first = first_looks(report)
    looks = [measure_again(report, config, sorted(first), seed=config.seed + (3 + index) * AGAIN_SEED)
             for index in range(times)]
    floor: dict[str, list[float]] = {name: [] for name in FLOORS}
    from_choice, between = [], []
    for rate, before in sorted(first.items()):
        p99s = [next((load.p99_s for load in look.loads if load.rate_per_s == rate), None) for look in looks]
        kind, moves = load_kind(report, config, before)
        pairs = [(a, b) for a, b in zip(p99s, p99s[1:]) if a and b]
        floor[kind] += [abs(b - a) / a for a, b in pairs]
        if kind != PAST:
            between += [b / a - 1 for a, b in pairs]
            from_choice += [p99s[0] / before.p99_s - 1] if p99s[0] and before.p99_s else []
        print(f"  {run.config.label} at {rate:g}/s ({kind}, {DRIFT:.0%} slower moves its simulated p99 by "
              f"{moves:.0%}): chosen on p99 {_ms(before.p99_s)} ms, then {', '.join(_ms(p) for p in p99s)} ms")
    summary = _floor_summary(floor, "pairs")
    if summary:
        print(f"noise floor after the choice, consecutive looks: {summary}")
    if from_choice and between:
        print(f"within the budget, the first look after the choice against the choice's own: median change "
              f"{statistics.median(from_choice):+.0%} ({len(from_choice)} loads); between later looks: "
              f"{statistics.median(between):+.0%} ({len(between)} pairs)")


def first_looks(report) -> tuple[ConfigRun, dict[float, LoadResult]]:
    """The winner's run, and its first measurement at each of its Poisson rates."""
    run = next(r for r in report.runs if r.config == report.winner.config)
    first: dict[float, LoadResult] = {}
    for load in run.loads:
        if load.kind == POISSON and load.rate_per_s is not None:
            first.setdefault(load.rate_per_s, load)
    return run, first


def measure_again(report, config: ServeConfig, rates: list[float], *, seed: int) -> ConfigRun:
    """The winner at `rates`, every one of them, in a fresh server with the draw of arrivals `seed`."""
    return serve_loads(config, "cpu", report.winner.config, tuple((POISSON, rate) for rate in rates), seed=seed,
                       stop_after_failure=False)


def load_kind(report, config: ServeConfig, before: LoadResult) -> tuple[str, float]:
    """(its kind, how far DRIFT moves its simulated p99) of a load by its first look: within the budget and
    steady (the simulator's p99 moves less than TARGET when the machine serves DRIFT slower), within the
    budget at the knee (it moves more: near saturation a queue's wait grows like 1 / (1 - utilisation), and
    the machine's own drift decides the figure), or past the budget (a queue that grows has no p99 to
    repeat: its figure is how long it ran)."""
    moves = drift_sensitivity(report, config, before.config, before.rate_per_s)
    return (PAST if not before.meets(config.p99_budget_s) else STEADY if moves <= TARGET else KNEE), moves


def drift_sensitivity(report, config: ServeConfig, rules, rate_per_s: float) -> float:
    """How far the calibrated simulator's p99 at `rate_per_s` moves when every batch takes DRIFT longer
    (the same arrivals and draws: only the speed differs); inf where either loses requests."""
    from mbtune.serving import simulate

    check = report.simulator
    if check is None:
        return math.inf
    p99s = [simulate.predict(rules, rate_per_s, simulate.curve_sampler(report.curve, check.service_scale * slower),
                             overhead_s=check.overhead_s, queue_timeout_s=config.queue_timeout,
                             seed=config.seed).p99_s for slower in (1.0, 1.0 + DRIFT)]
    return abs(p99s[1] - p99s[0]) / p99s[0] if all(map(math.isfinite, p99s)) and p99s[0] > 0 else math.inf


def _floor_summary(floor: dict[str, list[float]], unit: str = "loads") -> str | None:
    """How far the p99 moved, over the loads within the budget and by kind (FLOORS); None without any."""
    sustained = floor[STEADY] + floor[KNEE]
    if not sustained:
        return None
    kinds = "; ".join(f"{name} ({len(values)} {unit}): {_median(values)}" for name, values in floor.items())
    return (f"{len(sustained)} {unit} within the budget differ in p99 by median {statistics.median(sustained):.0%} "
            f"(quartiles {_quartiles(sustained)}), worst {max(sustained):.0%}; {kinds}")


def _half(load) -> str:
    return f"(+-{load.p99_ci_half_pct:.0f}%)" if load.p99_ci_half_pct is not None else "(+-inf)"


def _quartiles(values: list[float]) -> str:
    low, _, high = statistics.quantiles(values, n=4) if len(values) > 1 else (values * 3)
    return f"{low:.0%}-{high:.0%}"


def _median(values: list[float]) -> str:
    return f"median {statistics.median(values):.0%}" if values else "none"


def _ms(value: float | None) -> str:
    return "lost" if value is None else f"{value * 1e3:.1f}"


if __name__ == "__main__":
    main()
