"""Benchmark: `mbtune serve` on the gpt workload on CPU: the throughput-latency table, the queueing
simulator's p99 and throughput errors against what was measured, and the noise floor they should be read
against (the winning configuration's loads measured a second time, in a fresh server); with --runs N, the
whole serve run N times: does the chosen configuration (or the group it names as tied) repeat?

Prints, per configuration and rate: throughput, p50, p99 measured, p99 predicted (leave one out) and the
error; then the median and worst p99 and throughput errors, the same loads' p99 and throughput run-to-run
differences (median and worst: the loads serve's second look measured twice, and the winner's loads again
in a fresh server), each run's choice and ties, and the wall time.

Run (a few minutes a run on two cores):   .venv/bin/python bench/serve.py [--p99 200ms] [--workload gpt] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

from mbtune.serving.config import ServeConfig
from mbtune.serving.load import POISSON
from mbtune.serving.run import model_spec, serve_workload
from mbtune.serving.server import LoadPlan, ServerSpec, run_config
from mbtune.units import parse_duration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("--p99", default="200ms")
    parser.add_argument("--strategy", default="grid")
    parser.add_argument("--runs", type=int, default=1, help="whole serve runs, for the choice's repeatability")
    parser.add_argument("--keep", type=Path, help="keep each run's report (json) in this folder")
    args = parser.parse_args()
    config = ServeConfig(p99_budget_s=parse_duration(args.p99, name="--p99"), workload=args.workload, device="cpu",
                         strategy=args.strategy)
    choices = []
    for index in range(args.runs):
        print(f"== run {index + 1} of {args.runs}, load average {os.getloadavg()[0]:.2f}", flush=True)
        choices.append(one_run(config, noise=index == 0, keep=args.keep / f"run-{index + 1}.json" if args.keep else None))
    if args.runs > 1:
        groups = [{best} | tied for best, tied in choices]
        held = sum(all(best in group for group in groups) for best, _ in choices)
        common, count = Counter(best for best, _ in choices).most_common(1)[0]
        print(f"every run's choice inside every run's chosen-or-tied group: {held} of {len(choices)}; distinct "
              f"choices: {sorted({best for best, _ in choices})}; the most common, {common}, chosen in {count} of "
              f"{len(choices)} runs and chosen or named tied in {sum(common in group for group in groups)}")


def one_run(config: ServeConfig, *, noise: bool, keep: Path | None = None) -> tuple[str, set[str]]:
    """One serve run, printed (its report kept as json at `keep`); its choice and the configurations it
    names as tied."""
    started = time.perf_counter()
    report = serve_workload(config)
    wall_s = time.perf_counter() - started
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        keep.write_text(json.dumps(report.to_dict()))
    print(f"{config.workload} on CPU, p99 budget {config.p99_budget_s * 1e3:g} ms, {report.threads} model thread(s); "
          f"inference ceiling {report.ceiling.ceiling}, safe batch {report.ceiling.safe_batch}")
    print(f"{'configuration':<34} {'rate/s':>8} {'thru/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'pred ms':>8} {'error':>7}")
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
              f"{_ms(load.p99_s):>8} {_ms(load.predicted_p99_s):>8} {error:>7} {again}")
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
        if noise:
            noise_floor(report, config)
    print(f"wall time: {wall_s:.0f} s for the run", flush=True)
    return (winner.config.label if winner else "none"), tied


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


def noise_floor(report, config: ServeConfig) -> None:
    """The winner's loads again, in a fresh server: how far the same point's p99 moves run to run."""
    run = next(r for r in report.runs if r.config == report.winner.config)
    rates = tuple((POISSON, load.rate_per_s) for load in run.loads if load.kind == POISSON)
    plan = LoadPlan(rules=run.config, loads=rates, budget_s=config.p99_budget_s, window_s=config.window_s,
                    max_windows=config.max_windows, queue_timeout_s=config.queue_timeout, seed=config.seed + 1,
                    stop_after_failure=False, cores=config.cores("cpu")[1])
    spec = ServerSpec(model=model_spec(config, "cpu"), rules=run.config, queue_timeout_s=config.queue_timeout)
    again = run_config(spec, plan, timeout_s=600)
    pairs = list(zip(run.loads, again.loads))
    differences = [abs(b.p99_s - a.p99_s) / a.p99_s for a, b in pairs if a.p99_s and b.p99_s]
    rates = [abs(b.throughput_per_s - a.throughput_per_s) / a.throughput_per_s for a, b in pairs if a.throughput_per_s]
    if differences:
        print(f"noise floor: the winner's {len(differences)} loads measured again differ in p99 by median "
              f"{statistics.median(differences):.0%}, worst {max(differences):.0%}; in throughput by median "
              f"{statistics.median(rates):.1%}, worst {max(rates):.1%}")


def _ms(value: float | None) -> str:
    return "lost" if value is None else f"{value * 1e3:.1f}"


if __name__ == "__main__":
    main()
