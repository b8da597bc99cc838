"""`mbtune serve`: the inference ceiling, the service-time curve, then real load on real server processes
for each dynamic-batching configuration, the queueing simulator calibrated on the curve and validated on
what ran, and the answer: per configuration the highest Poisson rate whose p99 stays within the budget.

With a store, every finished trial, the curve and every configuration's loads are journaled, and an
interrupted run resumes without measuring them again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mbtune.errors import ConfigError, Interrupted, TrialFailedError
from mbtune.probing.records import ProbeResult, TrialOutcome
from mbtune.records import OK
from mbtune.serving import simulate
from mbtune.serving.answers import answer, best_answer, decide, measured, tied_with_best, to_confirm
from mbtune.serving.config import DEFAULT_MAX_BATCH_SIZES, DEFAULT_RATE_SHARES, ServeConfig
from mbtune.serving.records import (
    BatchConfig,
    ConfigRun,
    LoadResult,
    ServeReport,
    ServiceCurve,
    SimulatorCheck,
)
from mbtune.serving.traffic import CLOSED, POISSON

if TYPE_CHECKING:
    from mbtune.journal import Journal
    from mbtune.progress import TrialProgress

log = logging.getLogger(__name__)
SERVICE_CURVE, SERVE_CONFIG, SERVE_AGAIN = "service_curve", "serve_config", "serve_again"  # journal kinds
AGAIN_SEED = 1000  # the second look's arrivals: another Poisson draw than the first's
QUICK_CONFIGS = 2  # --strategy quick measures the configurations the simulator ranks this high


def serve_workload(config: ServeConfig, progress: TrialProgress | None = None,
                   store: Journal | None = None) -> ServeReport:
    """Find the dynamic-batching configuration that sustains the highest Poisson rate within the p99
    budget, from real measurements (see the module docstring). Ctrl-C keeps what finished."""
    from mbtune.device import resolve_device
    from mbtune.probing.run import probe_workload
    from mbtune.workloads.facts import workload_facts

    workload_facts(config.workload, config.workload_options, timeout_s=config.load_timeout_s)
    device = resolve_device(config.device)
    ceiling = probe_workload(config.probe_config(), progress, store, on_trial=_budget_check(config))
    curve = _curve(config, device, ceiling, store)
    _check_batch_of_one(config, curve)
    warnings = [f"inference probe: {w}" for w in ceiling.warnings]
    skipped: list[str] = [curve.stopped] if curve.stopped else []
    rules = _configurations(config, ceiling, curve, skipped)
    if not rules:
        raise ConfigError(f"no configuration to run: {'; '.join(skipped)}",
                          hint="Give --max-batch-sizes within the safe batch whose batch fits in the budget.")
    generator = None
    if not config.rates:
        from mbtune.serving.generator import generator_capacity

        generator = generator_capacity(timeout_s=config.trial_timeout_s, cores=config.cores(device))
    rates = config.rates or _default_rates(curve, rules, generator, warnings)
    service = simulate.curve_sampler(curve)
    runs: list[ConfigRun] = []
    interrupted = False
    try:
        for rule, rule_rates in _to_run(config, rules, rates, service, skipped):
            runs.append(_run(config, device, rule, rule_rates, store, progress))
        if config.recheck:
            runs = _again(config, device, rules, rates, runs, store, progress)
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
    fit = calibrate(curve, [load for run in runs for load in run.loads])
    runs = _predicted(runs, curve, config)
    service = simulate.curve_sampler(curve, fit.service_scale)
    answers = tuple(answer(rule, runs, rates, service, fit.overhead_s, config) for rule in rules)
    warnings += _load_warnings(runs, config)
    best = best_answer(answers)
    if best is not None and answers[best].max_rate_per_s == max(rates):
        warnings.append(f"{answers[best].config.label} met the budget at the highest rate tried "
                        f"({max(rates):g}/s): it may sustain more (add higher --rates)")
    return ServeReport(
        workload=config.workload, workload_options=dict(config.workload_options), device=ceiling.device,
        precision=config.precision, p99_budget_s=config.p99_budget_s, ceiling=ceiling, curve=curve,
        runs=tuple(runs), answers=answers, best=best, ties=tied_with_best(answers, best),
        decision=decide(answers, best, config.equivalence), strategy=config.strategy,
        simulator=_validation(runs, curve, fit), skipped=tuple(skipped), warnings=tuple(warnings),
        threads=curve.threads, interrupted=interrupted, queue_timeout_s=config.queue_timeout,
        generator_capacity_per_s=generator)


# At the probe's first trial one warm pass is all there is, so a budget is refused there only when that
# pass took this many budgets; the curve's fastest of many passes decides the closer cases.
FIRST_TRIAL_BUDGETS = 2.0


def _budget_check(config: ServeConfig) -> Any:
    """Refuse, at the probe's first trial, a budget that one batch of the smallest size is far from
    meeting (before the probe spends minutes on larger ones)."""
    def check(outcome: TrialOutcome) -> None:
        warm = outcome.step_times_s[1:]  # the first pass pays for the first call's set-up
        if outcome.ok and outcome.batch_size == config.granularity and warm:
            _refuse_budget(config, outcome.batch_size, min(warm), over=FIRST_TRIAL_BUDGETS)

    return check


def _check_batch_of_one(config: ServeConfig, curve: ServiceCurve) -> None:
    first = min(curve.times, key=lambda t: t.batch_size)
    _refuse_budget(config, first.batch_size, first.min_s)


def _refuse_budget(config: ServeConfig, batch_size: int, fastest_s: float, over: float = 1.0) -> None:
    if fastest_s > over * config.p99_budget_s:
        raise ConfigError(f"--p99 {config.p99_budget_s * 1e3:g}ms is below the latency of one batch of {batch_size}: "
                          f"its fastest forward pass took {fastest_s * 1e3:.1f} ms",
                          hint=f"Give a --p99 above {fastest_s * 1e3:.0f}ms, a faster device or a smaller model.")


def _curve(config: ServeConfig, device: str, ceiling: ProbeResult, store: Journal | None) -> ServiceCurve:
    """The service-time curve up to the safe batch, measured in a fresh process (or replayed)."""
    from mbtune.serving.infer import CurveSpec, measure_curve
    from mbtune.worker import run_isolated

    replayed = store.replayed(SERVICE_CURVE) if store else []
    if replayed:
        return ServiceCurve.from_dict(replayed[0])
    limit = ceiling.safe_batch
    sizes = {1 << k for k in range(limit.bit_length()) if 1 << k <= limit} | {limit}
    sizes |= {s for s in (*config.preferred, *(config.max_batch_sizes or ())) if s <= limit}
    spec = CurveSpec(model=model_spec(config, device), sizes=tuple(sorted(sizes)), stop_above_s=config.p99_budget_s)
    result = run_isolated(measure_curve, spec, timeout_s=config.trial_timeout_s)
    if result.status != OK:
        raise TrialFailedError(f"the service-time curve could not be measured: {result.error}",
                               detail=result.error_tail)
    curve: ServiceCurve = result.value
    if store:
        store.record(SERVICE_CURVE, curve.to_dict())
    return curve


def model_spec(config: ServeConfig, device: str) -> Any:
    """The ModelSpec every serving process of this run holds."""
    from mbtune.serving.infer import ModelSpec

    return ModelSpec(workload=config.workload, workload_options=config.workload_options, device=device,
                     precision=config.precision, threads=config.threads, seed=config.seed,
                     cores=config.cores(device)[0])


def _configurations(config: ServeConfig, ceiling: ProbeResult, curve: ServiceCurve,
                    skipped: list[str]) -> tuple[BatchConfig, ...]:
    """Every (max batch size, queue delay) configuration to consider; sizes that cannot run are skipped."""
    measured = {t.batch_size: t.median_s for t in curve.times}
    if config.max_batch_sizes is None:
        fitting = [s for s, t in sorted(measured.items()) if s & (s - 1) == 0 and t <= config.p99_budget_s / 2]
        sizes = fitting[-DEFAULT_MAX_BATCH_SIZES:] or [min(measured)]
    else:
        sizes = []
        for size in sorted(config.max_batch_sizes):
            if size > ceiling.safe_batch:
                skipped.append(f"max batch size {size}: above the inference safe batch ({ceiling.safe_batch})")
            elif curve.median_s(size) > config.p99_budget_s:
                skipped.append(f"max batch size {size}: one batch takes {curve.median_s(size) * 1e3:.1f} ms, "
                               f"over the {config.p99_budget_s * 1e3:g} ms budget")
            else:
                sizes.append(size)
    return tuple(BatchConfig(max_batch_size=size, max_queue_delay_s=delay,
                             preferred=tuple(p for p in config.preferred if p <= size))
                 for size, delay in itertools.product(sizes, config.delays_s))


# The highest default rate is at most this share of what the load generator carries with a model that
# answers at once: beside a real model it has less of the machine.
GENERATOR_SHARE = 0.5


def _default_rates(curve: ServiceCurve, rules: Sequence[BatchConfig], generator_per_s: float | None = None,
                   warnings: list[str] | None = None) -> tuple[float, ...]:
    """Shares of the largest configuration's capacity, each the nearest E24 number; where the load
    generator cannot send that much here (`generator_per_s`, measured first), shares of what it can."""
    capacity = max((curve.capacity_per_s(r.max_batch_size) for r in rules), default=1.0)
    top = max(DEFAULT_RATE_SHARES)
    if generator_per_s is not None and capacity * top > GENERATOR_SHARE * generator_per_s:
        if warnings is not None:
            warnings.append(
                f"the model serves up to {capacity:,.0f} requests/s, more than the load generator can send on this "
                f"machine (about {generator_per_s:,.0f}/s with a model that answers at once): rates go up to "
                f"{GENERATOR_SHARE * generator_per_s:,.0f}/s, so the configurations' limits may lie above them; "
                "drive the server from a faster machine, or give --rates and --concurrency yourself")
        capacity = GENERATOR_SHARE * generator_per_s / top
    return tuple(sorted({preferred_rate(share * capacity) for share in DEFAULT_RATE_SHARES}))


# IEC 60063's E24 series: 24 numbers a decade, each about 10% above the last. Default rates are taken from it,
# so two runs whose measured capacities differ by a few percent run the same rates and their answers compare
# rung for rung (rounding to two figures gave each run a ladder of its own).
E24 = (1.0, 1.1, 1.2, 1.3, 1.5, 1.6, 1.8, 2.0, 2.2, 2.4, 2.7, 3.0, 3.3, 3.6, 3.9, 4.3, 4.7, 5.1, 5.6, 6.2, 6.8, 7.5,
       8.2, 9.1)


def preferred_rate(value: float) -> float:
    """The E24 number nearest `value` on a log scale (1.0 for nothing)."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    decade = 10.0 ** math.floor(math.log10(value))
    candidates: list[float] = [m * decade for m in E24] + [10.0 * decade]
    nearest: float = min(candidates, key=lambda c: abs(math.log(c / value)))
    return round(nearest, 10)


def _to_run(config: ServeConfig, rules: Sequence[BatchConfig], rates: Sequence[float],
            service: simulate.ServiceSampler, skipped: list[str]) -> list[tuple[BatchConfig, tuple[float, ...]]]:
    """(configuration, Poisson rates to run, ascending) for each configuration measured: every one, or with
    --strategy quick the QUICK_CONFIGS the simulator predicts sustain the highest rates."""
    ordered = tuple(sorted(rates))
    if config.strategy != "quick":
        return [(rule, ordered) for rule in rules]
    predicted = {rule: simulate.predicted_max_rate(rule, ordered, service, config.p99_budget_s,
                                                   queue_timeout_s=config.queue_timeout, seed=config.seed)[0]
                 for rule in rules}
    ranked = sorted(rules, key=lambda r: -(predicted[r] or 0.0))
    chosen = ranked[:QUICK_CONFIGS]
    for rule in ranked[QUICK_CONFIGS:]:
        skipped.append(f"{rule.label}: not run (--strategy quick: predicted to sustain "
                       f"{_rate_text(predicted[rule])}, below the {QUICK_CONFIGS} best)")
    return [(rule, ordered) for rule in chosen]


def _rate_text(rate: float | None) -> str:
    return f"{rate:g}/s" if rate is not None else "no rate"


def _again(config: ServeConfig, device: str, rules: Sequence[BatchConfig], rates: Sequence[float],
           runs: list[ConfigRun], store: Journal | None, progress: TrialProgress | None) -> list[ConfigRun]:
    """The second look: the loads that decide the choice (answers.to_confirm) measured again, each
    configuration in a fresh server with another draw of arrivals; each run then holds both looks' loads."""
    answers = [measured(rule, runs, rates, config.p99_budget_s) for rule in rules]
    again = {rules[i]: chosen for i, chosen in to_confirm(answers, best_answer(answers), rates).items()}
    merged = []
    for run in runs:
        if run.config in again and not run.error:
            second = _run(config, device, run.config, again[run.config], store, progress, kind=SERVE_AGAIN,
                          concurrency=False)
            run = dataclasses.replace(run, loads=run.loads + second.loads, error=second.error)
        merged.append(run)
    return merged


def _run(config: ServeConfig, device: str, rule: BatchConfig, rates: tuple[float, ...], store: Journal | None,
         progress: TrialProgress | None, *, kind: str = SERVE_CONFIG, concurrency: bool = True) -> ConfigRun:
    """One configuration's server under its loads (or its journaled run); `kind` SERVE_AGAIN: the second
    look (another draw of arrivals)."""
    from mbtune.journal import REPLAYED

    if progress:
        progress.start_trial(rule.label + (", again" if kind == SERVE_AGAIN else ""))
    done = [ConfigRun.from_dict(r) for r in store.replayed(kind)] if store else []
    run = next((r for r in done if r.config == rule), None)
    detail = REPLAYED
    if run is None:
        closed = config.concurrency if concurrency else ()
        loads = tuple((POISSON, rate) for rate in rates) + tuple((CLOSED, float(c)) for c in closed)
        run = serve_loads(config, device, rule, loads, seed=config.seed + (AGAIN_SEED if kind == SERVE_AGAIN else 0))
        if store:
            store.record(kind, run.to_dict())
        detail = run.error or _run_detail(run, config.p99_budget_s)
    if progress:
        progress.end_trial("error" if run.error else OK, detail)
    return run


def serve_loads(config: ServeConfig, device: str, rule: BatchConfig, loads: tuple[tuple[str, float], ...], *,
                seed: int, **plan: Any) -> ConfigRun:
    """One fresh server holding the model by `rule`, under `loads` ((kind, rate or concurrency), in order)
    with the draw of arrivals `seed`, measured by the config's settings (`plan`: LoadPlan fields to set
    otherwise)."""
    from mbtune.serving.server import LoadPlan, ServerSpec, run_config

    settings = dict(rules=rule, loads=loads, budget_s=config.p99_budget_s, window_s=config.window_s,
                    max_windows=config.max_windows, min_requests=config.min_requests,
                    queue_timeout_s=config.queue_timeout, seed=seed, ready_timeout_s=config.load_timeout_s,
                    cores=config.cores(device)[1])
    load_plan = LoadPlan(**{**settings, **plan})
    spec = ServerSpec(model=model_spec(config, device), rules=rule, queue_timeout_s=config.queue_timeout)
    return run_config(spec, load_plan, timeout_s=_run_timeout(load_plan))


def _run_timeout(plan: Any) -> float:
    """Enough for the server to start and every load to run all its windows and drain."""
    drain = (plan.queue_timeout_s or 10 * plan.budget_s) + 2 * plan.budget_s + 2.0
    return plan.ready_timeout_s + sum(plan.windows_of(kind, amount) * plan.window_of(kind, amount) + drain
                                      for kind, amount in plan.loads)


def _run_detail(run: ConfigRun, budget_s: float) -> str:
    met = [load.rate_per_s for load in run.loads
           if load.kind == POISSON and load.rate_per_s is not None and load.meets(budget_s)]
    return f"up to {max(met):g}/s within the budget" if met else "no rate within the budget"


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the loads that ran teach the simulator beyond the service-time curve."""

    service_scale: float = 1.0  # a batch's service under load over the curve's median at its size
    overhead_s: float = 0.0  # per request: latency beyond its queue wait and its batch's service


def calibrate(curve: ServiceCurve, loads: Sequence[LoadResult]) -> Calibration:
    """Medians over the loads (none: the curve alone)."""
    scales, extra = [], []
    for load in loads:
        if not load.completed or load.mean_latency_s is None or load.mean_service_s is None:
            continue
        alone = curve.median_s(max(1, round(load.mean_batch_size)))
        scales.append(load.mean_service_s / alone)
        extra.append(load.mean_latency_s * (1 - load.queue_share) - load.mean_service_s)
    if not scales:
        return Calibration()
    return Calibration(service_scale=max(1.0, statistics.median(scales)), overhead_s=max(0.0, statistics.median(extra)))


def _predicted(runs: Sequence[ConfigRun], curve: ServiceCurve, config: ServeConfig) -> list[ConfigRun]:
    """Each Poisson load's predicted p99, the simulator calibrated on every other load (leave one out), so
    the comparison with what was measured is not in-sample."""
    every = [load for run in runs for load in run.loads]
    predicted = []
    for run in runs:
        loads = []
        for load in run.loads:
            if load.kind == POISSON and load.rate_per_s is not None:
                fit = calibrate(curve, [other for other in every if other is not load])
                guess = simulate.predict(load.config, load.rate_per_s, simulate.curve_sampler(curve, fit.service_scale),
                                         overhead_s=fit.overhead_s, queue_timeout_s=config.queue_timeout,
                                         seed=config.seed)
                load = dataclasses.replace(load, predicted_p99_s=guess.p99_s if math.isfinite(guess.p99_s) else None)
            loads.append(load)
        predicted.append(dataclasses.replace(run, loads=tuple(loads)))
    return predicted


def _load_warnings(runs: Sequence[ConfigRun], config: ServeConfig) -> list[str]:
    from mbtune.device.machine_load import busy_warning

    found = [f"{run.config.label}: {run.error}" for run in runs if run.error]
    found += [w for run in runs if (w := busy_warning(run.config.label, run.machine))]
    behind = [f"{run.config.label} at {load.label} ({load.not_sent} of {load.not_sent + load.sent} never sent)"
              for run in runs for load in run.loads if load.not_sent > 0.01 * (load.sent + load.not_sent)]
    if behind:
        found.append("the load generator could not deliver these loads (it fell behind; the unsent requests "
                     f"count as lost): {', '.join(behind)}; give lower --rates, or --concurrency for closed-loop load")
    unstable = [f"{run.config.label} at {load.label}" for run in runs for load in run.loads
                if not load.stable and load.meets(config.p99_budget_s)]
    if unstable:
        found.append(f"unstable (windows disagreed by more than 10%) though within the budget: {', '.join(unstable)}")
    return found


def _validation(runs: Sequence[ConfigRun], curve: ServiceCurve, fit: Calibration) -> SimulatorCheck:
    """Predicted (leave one out) against measured p99 over the Poisson loads where both are finite."""
    poisson = [load for run in runs for load in run.loads if load.kind == POISSON]
    errors = [abs(load.predicted_p99_s - load.p99_s) / load.p99_s * 100 for load in poisson
              if load.p99_s and load.predicted_p99_s is not None]
    misses = sum(1 for load in poisson if (load.p99_s is None) != (load.predicted_p99_s is None))
    noise = [(t.max_s / t.min_s - 1) * 100 for t in curve.times if t.min_s > 0]
    return SimulatorCheck(points=len(errors), misses=misses,
                          median_error_pct=statistics.median(errors) if errors else None,
                          worst_error_pct=max(errors) if errors else None, overhead_s=fit.overhead_s,
                          service_scale=fit.service_scale,
                          noise_pct=statistics.median(noise) if noise else None)
