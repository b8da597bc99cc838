"""A serve run's answers: per configuration the highest Poisson rate whose p99 stayed within the budget and
where its true highest rate lies on the evidence (a bracket on the ladder of rates, widened where a p99 lay
within the noise of the budget), the best configuration, and those tied with it (brackets that overlap the
best one's: a second run could name either), and which loads decide the choice, to measure a second time
(`to_confirm`): a rate measured twice counts as met only where both looks met it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from mbtune.records import Decision
from mbtune.serving import simulate
from mbtune.serving.config import ServeConfig
from mbtune.serving.records import BatchConfig, ConfigAnswer, ConfigRun, LoadResult
from mbtune.serving.traffic import POISSON


def answer(rule: BatchConfig, runs: Sequence[ConfigRun], rates: Sequence[float], service: simulate.ServiceSampler,
           overhead_s: float, config: ServeConfig) -> ConfigAnswer:
    """measured()'s answer, with the simulator's highest rate over the same rates beside it."""
    predicted, _ = simulate.predicted_max_rate(rule, rates, service, config.p99_budget_s, overhead_s=overhead_s,
                                               queue_timeout_s=config.queue_timeout, seed=config.seed)
    return dataclasses.replace(measured(rule, runs, rates, config.p99_budget_s), predicted_max_rate_per_s=predicted)


def measured(rule: BatchConfig, runs: Sequence[ConfigRun], rates: Sequence[float], budget_s: float) -> ConfigAnswer:
    """The highest rate that met the budget every time it was measured, every lower rate measured having
    met it too (a rate measured twice, by the second look at the deciding loads, counts as passing only if
    both met it), and where the true highest rate lies (bracket)."""
    run = next((r for r in runs if r.config == rule), None)
    if run is None:
        return ConfigAnswer(config=rule, max_rate_per_s=None, ran=False, note="predicted only")
    passing: LoadResult | None = None
    failing: LoadResult | None = None
    mixed = False  # the first failing rate also met the budget once: the highest rate may be that one
    for _, loads in sorted(_by_rate(run.loads).items()):
        over = [x for x in loads if not x.meets(budget_s)]
        if over:
            failing, mixed = over[0], len(over) < len(loads)
            break
        passing = max(loads, key=lambda x: x.p99_s or 0.0)  # the worse of its measurements
    note = run.error or ("" if passing else "no rate it ran met the budget")
    ladder = sorted({*rates, *_by_rate(run.loads)})
    low, high = bracket(ladder, passing, failing, budget_s, mixed=mixed)
    return ConfigAnswer(
        config=rule, max_rate_per_s=passing.rate_per_s if passing else None,
        p99_at_max_s=passing.p99_s if passing else None,
        throughput_at_max_per_s=passing.throughput_per_s if passing else None,
        first_failing_rate_per_s=failing.rate_per_s if failing else None,
        stable=passing.stable if passing else True, note=note, bracket_low_per_s=low, bracket_high_per_s=high)


def _by_rate(loads: Sequence[LoadResult]) -> dict[float, list[LoadResult]]:
    """The Poisson loads by rate, each rate's measurements in the order they ran."""
    found: dict[float, list[LoadResult]] = {}
    for load in loads:
        if load.kind == POISSON and load.rate_per_s is not None:
            found.setdefault(load.rate_per_s, []).append(load)
    return found


# A load's p99 counts as within the noise of the budget where it lies within this share of it, or within its
# own 95% interval where that is wider (its windows' spread where it has none): the share by which one
# load's p99 moves between measurements.
P99_NOISE = 0.15


def near_budget(load: LoadResult, budget_s: float) -> bool:
    """Whether a second measurement of this load could land on the budget's other side."""
    if load.p99_s is None:
        return False  # over 1% of its requests lost: over the budget by far
    if load.p99_ci_half_pct is not None:
        own = load.p99_ci_half_pct / 100
    else:
        own = math.inf if load.window_spread is None else load.window_spread
    return abs(load.p99_s - budget_s) <= max(P99_NOISE, own) * budget_s


def bracket(ladder: Sequence[float], passing: LoadResult | None, failing: LoadResult | None,
            budget_s: float, *, mixed: bool = False) -> tuple[float, float | None]:
    """Where a configuration's highest rate within the budget lies: [highest passing rate, first failing
    rate), each end moved one rung of the ladder outwards where its p99 was near the budget, or (the high
    end) where the first failing rate also met the budget once (`mixed`). None: no rate above failed."""
    low = (passing.rate_per_s or 0.0) if passing else 0.0
    high = failing.rate_per_s if failing else None
    if passing is not None and near_budget(passing, budget_s):
        low = max((rate for rate in ladder if rate < low), default=0.0)
    if failing is not None and high is not None and (mixed or near_budget(failing, budget_s)):
        high = min((rate for rate in ladder if rate > high), default=None)
    return low, high


def best_answer(answers: Sequence[ConfigAnswer]) -> int | None:
    """The configuration that sustains the highest rate. Among those sustaining the same rate: the one that
    waits least (the shortest queue delay), then holds least (the smallest max batch), and only then a
    stable measurement there and the lower p99 there: near saturation two configurations' p99s at one rate
    differ by less than one configuration's p99 moves between measurements (P99_NOISE), and whether its
    windows agreed is as much chance, so those would pick at random where the settings pick the same one
    every run."""
    measured = [i for i, a in enumerate(answers) if a.max_rate_per_s is not None]
    if not measured:
        return None
    return max(measured, key=lambda i: (answers[i].max_rate_per_s or 0.0, -answers[i].config.max_queue_delay_s,
                                        -answers[i].config.max_batch_size, answers[i].stable,
                                        -(answers[i].p99_at_max_s or 0.0)))


def to_confirm(answers: Sequence[ConfigAnswer], best: int | None, rates: Sequence[float]) -> dict[int, tuple[float, ...]]:
    """The loads that decide the choice, to measure a second time in a fresh server: for the best
    configuration and every other that ran and could be first on a second look (its bracket reaches the
    rung below the best's highest rate), the rates from that rung to the rung above the best's highest
    rate. {answer index: rates, ascending}."""
    if best is None or answers[best].max_rate_per_s is None:
        return {}
    ladder = sorted(set(rates))
    top = answers[best].max_rate_per_s or 0.0
    below = max((r for r in ladder if r < top), default=top)
    above = min((r for r in ladder if r > top), default=top)
    chosen = {}
    for index, found in enumerate(answers):
        reaches = found.bracket_high_per_s is None or found.bracket_high_per_s > below
        if found.ran and (index == best or (found.max_rate_per_s is not None and reaches)):
            chosen[index] = tuple(r for r in ladder if below <= r <= above)
    return chosen


def tied_with_best(answers: Sequence[ConfigAnswer], best: int | None) -> tuple[int, ...]:
    """The configurations (that ran) whose bracket overlaps the best one's: their highest rates could be the
    same, so a second run could name either."""
    if best is None:
        return ()
    top = answers[best]

    def below(a: float, b: float | None) -> bool:
        return b is None or a < b

    return tuple(i for i, a in enumerate(answers) if i != best and a.ran
                 and below(a.bracket_low_per_s, top.bracket_high_per_s)
                 and below(top.bracket_low_per_s, a.bracket_high_per_s))


def decide(answers: Sequence[ConfigAnswer], best: int | None, size: float) -> Decision | None:
    """serve's decision by the sweep's rule (equal within a declared size is an answer): `decided` where no
    configuration is tied with the best (tied_with_best), `equivalent` where every tied one sustained a highest
    rate within `size` of the best one's (every arrival sequence the same, seed for seed, so the rates compare
    configuration for configuration), listed least waiting, then least holding first; `not decided` where a
    tied one's highest rate lies further below. None where nothing met the budget."""
    if best is None or answers[best].max_rate_per_s is None:
        return None
    top = answers[best].max_rate_per_s or 0.0
    tied = tied_with_best(answers, best)
    group = tuple(sorted((i for i in tied if (answers[i].max_rate_per_s or 0.0) >= top * (1 - size)),
                         key=lambda i: (answers[i].config.max_queue_delay_s, answers[i].config.max_batch_size)))
    still = tuple(i for i in tied if i not in group)
    state = "not decided" if still else "equivalent" if group else "decided"
    return Decision(state=state, size=size, group=group, open=still,
                    why="a tied configuration's highest rate lies further below the best one's than the size; "
                        "more --rates between them, or a second look, would settle it" if still else "")
