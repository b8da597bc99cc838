"""The ceiling search: pure logic over an injected run_trial(batch_size) -> TrialOutcome callable.

Grow, then bisect, steered by a memory model (bytes = fixed + per_sample x batch) fitted to the peaks of
the trials that ran, so it needs fewer trials than doubling plus bisection. Near the ceiling results can
flip run to run, so the reported ceiling must pass `confirm` times, with the next size up failing, and
the safe batch is verified by a final run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from mbtune.errors import BudgetTooSmallError, TrialFailedError, WorkloadBrokenError
from mbtune.records import ERROR, OK, OOM, MemoryModel, TrialOutcome

RunTrial = Callable[[int], TrialOutcome]


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """What the search found; probe_workload() wraps it into a ProbeResult with the device and config."""

    trials: tuple[TrialOutcome, ...]
    ceiling: int
    first_failing: int | None
    safe_batch: int
    safe_batch_verified: bool
    memory_model: MemoryModel | None
    warnings: tuple[str, ...] = ()


@dataclass
class _State:
    granularity: int
    max_batch: int | None
    budget_bytes: int | None
    trials: list[TrialOutcome] = field(default_factory=list)
    passes: dict[int, int] = field(default_factory=dict)
    lo: int = 0  # largest size that ran, below every failing size
    hi: int | None = None  # smallest size that failed for memory
    growth: int = 0  # stride while the model says the ceiling is already behind us
    guided_step: int = 0  # length of the last unclamped model-guided step (the next is at least as long)

    def record(self, outcome: TrialOutcome) -> None:
        self.trials.append(outcome)
        size = outcome.batch_size
        if outcome.ok:
            self.passes[size] = self.passes.get(size, 0) + 1
            if self.hi is None or size < self.hi:
                self.lo = max(self.lo, size)
        else:
            self.hi = size if self.hi is None else min(self.hi, size)
            if self.lo >= size:
                # A size that ran before failed now: everything from here up is unreliable.
                below = [s for s in self.passes if s < size]
                self.lo = max(below, default=0)


def fit_memory_model(trials: list[TrialOutcome] | tuple[TrialOutcome, ...]) -> MemoryModel | None:
    """Least-squares fit of budget_used_bytes against batch size over the trials that ran."""
    points = [(t.batch_size, t.budget_used_bytes) for t in trials if t.ok and t.budget_used_bytes is not None]
    if len({b for b, _ in points}) < 2:
        return None
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var_b = sum((b - mean_b) ** 2 for b, _ in points)
    slope = sum((b - mean_b) * (m - mean_m) for b, m in points) / var_b
    fixed = mean_m - slope * mean_b
    rms = math.sqrt(sum((fixed + slope * b - m) ** 2 for b, m in points) / n)
    return MemoryModel(fixed_bytes=fixed, per_sample_bytes=slope,
                       fit_error_pct=100.0 * rms / mean_m if mean_m else 0.0, num_points=n)


def safe_batch_for(ceiling: int, margin: float, granularity: int) -> int:
    """floor(ceiling x (1 - margin)), rounded down to the granularity (never below one granule)."""
    safe = math.floor(ceiling * (1.0 - margin) + 1e-9)
    return max(granularity, safe // granularity * granularity)


def _round_down(value: float, granularity: int) -> int:
    return int(math.floor(value / granularity)) * granularity


def _next_size(state: _State) -> int | None:
    """The next batch size to try, or None when lo is bracketed (lo + granularity failed or max reached)."""
    g, lo, hi = state.granularity, state.lo, state.hi
    top = hi - g if hi is not None else None
    if state.max_batch is not None:
        top = state.max_batch if top is None else min(top, state.max_batch)
    if top is not None and lo >= top:
        return None
    model = fit_memory_model(state.trials)
    guess = model.batch_for(state.budget_bytes) if model and state.budget_bytes else None
    guess = _round_down(guess, g) if guess is not None and math.isfinite(guess) else None
    if hi is None:
        candidate = _grow(state, guess)
    else:
        # Trust the model while its guess lies inside the bracket and the bracket closes from both
        # sides; otherwise the model is off, and bisection guarantees progress.
        use_guess = (guess is not None and lo < guess < hi and len(state.trials) >= 2
                     and state.trials[-1].ok != state.trials[-2].ok)
        candidate = guess if use_guess else _round_down((lo + hi) / 2, g)
        candidate = min(max(candidate, lo + g), hi - g)
    return min(candidate, top) if top is not None else candidate


def _grow(state: _State, guess: int | None) -> int:
    """Next size while no size has failed yet: the model's guess (at most 8x the largest that ran), or
    4x without a model (small batches barely move memory, so early fits are often flat).

    A model that keeps underestimating must not creep up in shrinking steps: after a guided step that
    ran, the next step is at least as long; and when the model says we are already there but the size
    ran, the stride doubles. Either way an underestimating model costs logarithmically many trials."""
    g, lo = state.granularity, state.lo
    if guess is None:
        state.guided_step = 0
        return 4 * lo
    if guess > lo:
        state.growth = 0
        candidate = min(max(guess, lo + state.guided_step), 8 * lo)
        state.guided_step = candidate - lo if candidate == guess else 0
        return candidate
    state.guided_step = 0
    state.growth = max(g, 2 * state.growth)
    return lo + state.growth


def search_ceiling(run_trial: RunTrial, *, granularity: int = 1, max_batch: int | None = None,
                   budget_bytes: int | None = None, margin: float = 0.15, confirm: int = 2) -> SearchResult:
    """Find the largest batch (a multiple of granularity) that runs, with the next size up failing for
    memory; confirm it passed `confirm` times; verify the safe batch with a final run."""
    if max_batch is not None:
        max_batch = max(granularity, _round_down(max_batch, granularity))
    state = _State(granularity=granularity, max_batch=max_batch, budget_bytes=budget_bytes)
    size: int | None = granularity
    while size is not None:
        outcome = _run(run_trial, size, state)
        state.record(outcome)
        if not outcome.ok and not state.passes:
            raise BudgetTooSmallError(
                f"batch {size} runs out of memory already ({outcome.error.splitlines()[0] if outcome.error else 'OOM'})")
        size = _next_size(state)
        if size is None and state.lo and state.passes.get(state.lo, 0) < confirm:
            size = state.lo
    if not state.lo:
        raise BudgetTooSmallError(f"no batch size of {granularity} or more ran reliably")
    return _finish(run_trial, state, margin)


def _run(run_trial: RunTrial, size: int, state: _State) -> TrialOutcome:
    outcome = run_trial(size)
    if outcome.status not in (OK, OOM):
        state.trials.append(outcome)
        why = f"{(outcome.error or 'no error text').strip().splitlines()[-1]}"
        if outcome.status == ERROR and not state.passes:
            raise WorkloadBrokenError(f"the workload fails at batch {size} for a reason other than memory: {why}",
                                      detail=outcome.error)
        raise TrialFailedError(f"trial at batch {size} ended as {outcome.status}, not out of memory: {why}",
                               detail=outcome.error)
    return outcome


def _finish(run_trial: RunTrial, state: _State, margin: float) -> SearchResult:
    ceiling, first_failing = state.lo, state.hi
    model = fit_memory_model(state.trials)
    safe = min(safe_batch_for(ceiling, margin, state.granularity), ceiling)
    warnings = []
    if ceiling * (1.0 - margin) < state.granularity:
        warnings.append(f"the ceiling ({ceiling}) is so small that the safe batch is one granule ({safe})")
    verification = _run(run_trial, safe, state)
    state.trials.append(verification)
    if not verification.ok:
        warnings.append(f"the safe batch {safe} ran out of memory in its verification run: "
                        "memory here is unstable, consider a larger margin")
    return SearchResult(
        trials=tuple(state.trials), ceiling=ceiling, first_failing=first_failing, safe_batch=safe,
        safe_batch_verified=verification.ok, memory_model=model, warnings=tuple(warnings),
    )
