"""The ceiling search: pure logic over an injected run_trial(batch_size) -> TrialOutcome callable.

Grow, then bisect, steered by a memory model (bytes = fixed + per_sample x batch) fitted to the peaks of
the trials that ran and by what the failures' errors say they needed (oom_reading.py), so it needs fewer
trials than doubling plus bisection. The ceiling is a band, not a number: the same size can fit in one
fresh process and fail in the next. So the search stops once the bracket [ceiling, first failing) is as
narrow as the resolution (default 1% of the ceiling), the ceiling must pass `confirm` times with the
next size up failing, and the safe batch must pass `confirm` fresh runs, stepping down until one does.
"""

from __future__ import annotations

import math
import shlex
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from mbtune.errors import BudgetTooSmallError, HarnessError, TrialFailedError, UnsafeBatchError, WorkloadBrokenError
from mbtune.probing.oom_reading import next_reading
from mbtune.probing.records import MemoryModel, TrialOutcome
from mbtune.records import ERROR, HARNESS_FAULT, KILLED, NONFINITE, OK, OOM

RunTrial = Callable[[int], TrialOutcome]

RESOLUTION_FRACTION = 0.01  # default resolution: 1% of the ceiling (at least one granule)
# A fitted slope counts only when it stands clear of its own scatter: above this many standard errors,
# and moving memory over the fitted range by more than peak memory's run-to-run noise (a few percent).
SLOPE_STDERRS = 3.0
GROWTH_NOISE_FRACTION = 0.02
# After a growth step to the model's ceiling ran, the model's new ceiling may move up by this share of
# that step and still count as the old one refined; further, the model underestimates.
REFINE_SHARE = 0.25
# A growth step aims this many standard errors below the model's ceiling (the slope's error grows with
# the distance extrapolated), so it lands just under the ceiling and the last steps are short; a step
# past it costs the trials of stepping back down through the band.
AIM_STDERRS = 2.0
# Without a model, the batch grows 4x a step, or 16x while the largest size that ran used under this
# share of the budget (memory still flat: a long way to go).
FLAT_SHARE = 1 / 8
# A guided step inside the bracket must at least halve it; otherwise the next step bisects.
GUIDED_SHRINK = 0.5
# Once a size has both run and failed, the default resolution widens to the band: twice itself, or
# what the memory model's scatter spans (this many scatters, in samples), at most this share of the ceiling.
BAND_RESOLUTIONS = 2
BAND_SCATTERS = 2.0
BAND_CAP_FRACTION = 0.05


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """What the search found; probe_workload() wraps it into a ProbeResult with the device and config."""

    trials: tuple[TrialOutcome, ...]
    ceiling: int
    first_failing: int | None
    safe_batch: int
    safe_batch_verified: bool
    memory_model: MemoryModel | None
    resolution: int = 1
    safe_batch_first: int | None = None  # the margin's safe batch, before any step down
    warnings: tuple[str, ...] = ()


@dataclass
class _State:
    granularity: int
    max_batch: int | None
    memory_budget_bytes: int | None
    resolution: int | None
    trials: list[TrialOutcome] = field(default_factory=list)
    passes: dict[int, int] = field(default_factory=dict)
    lo: int = 0  # largest size that ran, below every failing size
    hi: int | None = None  # smallest size that failed for memory
    guided_step: int = 0  # the length of the last growth step to the model's ceiling
    last_guess: float | None = None  # where the model put the ceiling then
    last_stderr: float = 0.0  # that guess's standard error, in samples (0 from a line through two sizes)
    strides: int = 0  # steps up from where the model put the ceiling, since the model was last trusted
    flipped: bool = False  # a size that ran failed on a later run: the band reaches down to it
    band_seen: bool = False  # some size both ran and failed: the ceiling is a band, not a size
    falls: int = 0  # trials that failed since the last one that ran
    guided_width: int | None = None  # the bracket's width when the last guided bracket step was chosen
    command: tuple[str, ...] = ()  # the user's own command the trials run, if they do

    def record(self, outcome: TrialOutcome) -> None:
        self.trials.append(outcome)
        size = outcome.batch_size
        self.falls = 0 if outcome.ok else self.falls + 1
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
                self.guided_width = None  # a flip, not a stalled model: the model may steer again
                self.flipped = self.band_seen = True

    def stop_width(self) -> int:
        """The bracket width at which the search stops, in whole granules."""
        g = self.granularity
        # 1% of the largest size that ran, or of the smallest ceiling a bracket that narrow could end
        # with below the first failing size: after a flip lo falls back, and before a size near the
        # ceiling ran the largest that ran is far below it; the band is up there.
        top = max(max(self.passes, default=self.lo), (self.hi or 0) / (1 + RESOLUTION_FRACTION))
        wanted: float = self.resolution or math.ceil(RESOLUTION_FRACTION * top)
        if self.resolution is None:
            # Before any size has flipped, peaks that scatter around the model by more than the
            # resolution say the band is at least that wide: bisecting inside it decides nothing.
            scatter = _model_scatter_samples(self)
            band = (max(BAND_RESOLUTIONS * wanted, BAND_SCATTERS * scatter) if self.band_seen
                    else BAND_SCATTERS * scatter if math.isfinite(scatter) and scatter > wanted else wanted)
            wanted = max(wanted, min(BAND_CAP_FRACTION * top, band))
        return max(g, math.ceil(wanted / g) * g)


def fit_memory_model(trials: list[TrialOutcome] | tuple[TrialOutcome, ...]) -> MemoryModel | None:
    """Least-squares fit of budget_used_bytes against batch size over the trials that ran; `resolved`
    says whether the slope stands clear of the fit's own scatter (else there is no per-sample memory)."""
    points = [(t.batch_size, t.budget_used_bytes) for t in trials if t.ok and t.budget_used_bytes is not None]
    if len({b for b, _ in points}) < 2:
        return None
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var_b = sum((b - mean_b) ** 2 for b, _ in points)
    slope = sum((b - mean_b) * (m - mean_m) for b, m in points) / var_b
    fixed = mean_m - slope * mean_b
    residual = sum((fixed + slope * b - m) ** 2 for b, m in points)
    stderr = math.sqrt(residual / (n - 2) / var_b) if n > 2 else None
    span = max(b for b, _ in points) - min(b for b, _ in points)
    resolved = (slope > 0 and slope * span > GROWTH_NOISE_FRACTION * mean_m
                and (stderr is None or slope > SLOPE_STDERRS * stderr))
    # Unresolved, memory is flat over these trials as far as they can tell: its mean is the fixed part.
    return MemoryModel(fixed_bytes=fixed if resolved else mean_m, per_sample_bytes=slope if resolved else None,
                       fit_error_pct=100.0 * math.sqrt(residual / n) / mean_m if mean_m else 0.0, num_points=n,
                       per_sample_stderr_bytes=stderr, resolved=resolved)


def safe_batch_for(ceiling: int, margin: float, granularity: int) -> int:
    """floor(ceiling x (1 - margin)), rounded down to the granularity (never below one granule)."""
    safe = math.floor(ceiling * (1.0 - margin) + 1e-9)
    return max(granularity, safe // granularity * granularity)


def _round_down(value: float, granularity: int) -> int:
    return int(math.floor(value / granularity)) * granularity


def _next_size(state: _State) -> int | None:
    """The next batch size to try, or None when the bracket is as narrow as the resolution (or the
    largest allowed size ran)."""
    g, lo, hi = state.granularity, state.lo, state.hi
    top = hi - g if hi is not None else None
    if state.max_batch is not None:
        top = state.max_batch if top is None else min(top, state.max_batch)
    if (top is not None and lo >= top) or (hi is not None and hi - lo <= state.stop_width()):
        return None
    guess = _model_ceiling(state)
    candidate = _grow(state, guess) if hi is None else _narrow(state, guess)
    return min(candidate, top) if top is not None else candidate


def _model_ceiling(state: _State) -> float | None:
    """Where the memory model puts the ceiling, anchored at the largest size that ran: that size's own
    peak plus the fitted per-sample cost, so the extrapolation is as short as it can be."""
    model = fit_memory_model(state.trials)
    if model is None or not state.memory_budget_bytes or model.per_sample_bytes is None:
        return None
    used = [t.budget_used_bytes for t in state.trials if t.ok and t.batch_size == state.lo and t.budget_used_bytes]
    guess = (state.lo + (state.memory_budget_bytes - max(used)) / model.per_sample_bytes if used
             else model.batch_for(state.memory_budget_bytes))
    return guess if guess is not None and math.isfinite(guess) else None


def _guess_stderr_samples(state: _State, guess: float) -> float:
    """The standard error of the model's ceiling, in samples: the fitted slope's relative error times the
    distance extrapolated from the largest size that ran (0 while two sizes give an exact line)."""
    model = fit_memory_model(state.trials)
    if model is None or not model.per_sample_bytes or not model.per_sample_stderr_bytes:
        return 0.0
    return max(0.0, guess - state.lo) * model.per_sample_stderr_bytes / model.per_sample_bytes


def _model_scatter_samples(state: _State) -> float:
    """How far the peaks near the ceiling (from half the largest size that ran up) scatter around the
    memory model, in samples (inf without a model). The small sizes' misfit is left out: start-up
    allocations bend the line there, and that says nothing about the band near the ceiling."""
    model = fit_memory_model(state.trials)
    near = [(t.batch_size, t.budget_used_bytes) for t in state.trials
            if t.ok and t.budget_used_bytes and 2 * t.batch_size >= state.lo]
    if model is None or model.per_sample_bytes is None or not near:
        return math.inf
    residuals = [model.fixed_bytes + model.per_sample_bytes * size - used for size, used in near]
    return math.sqrt(statistics.fmean(r * r for r in residuals)) / model.per_sample_bytes


def _grow(state: _State, guess: float | None) -> int:
    """Next size while no size has failed yet.

    Without a model, 4x (16x while memory is still flat: small batches barely move it). With one, two
    standard errors below the model's ceiling (at most 8x the largest that ran). Once a step there ran
    and the model puts the ceiling no further, the search steps up from it by the resolution, doubling
    each step until a size fails. A model that underestimates (its ceiling moves up by more than a
    refinement, and by more than its own error) must not creep up in shrinking steps: each step is then
    at least as long as the last, so it costs logarithmically many trials. A guess from a line through
    two sizes has no error to judge it by and is trusted once: from batch 1 up such a line reads the
    fixed part's overhead as slope and puts the ceiling short, and a step as long as the last from
    there would overshoot the band."""
    g, lo, r = state.granularity, state.lo, state.stop_width()
    if guess is None:
        used = max((t.budget_used_bytes or 0 for t in state.trials if t.ok and t.batch_size == lo), default=0)
        flat = state.memory_budget_bytes is not None and used < FLAT_SHARE * state.memory_budget_bytes
        return (16 if flat else 4) * lo
    at = _round_down(guess, g)
    if at > lo + r and not state.strides:
        stderr = _guess_stderr_samples(state, guess)
        aim = _round_down(guess - AIM_STDERRS * stderr, g)
        candidate = max(aim, lo + r)  # a shorter step is dominated: failing, it closes no narrower bracket
        if (state.last_guess is not None and state.last_stderr
                and guess - state.last_guess > max(REFINE_SHARE * state.guided_step, AIM_STDERRS * state.last_stderr)):
            candidate = max(at, lo + state.guided_step)  # underestimating: no shorter step than the last
        candidate = min(candidate, 8 * lo)
        if candidate >= aim:
            state.guided_step, state.last_guess, state.last_stderr = candidate - lo, guess, stderr
        return candidate
    # The strides start at the resolution, or at what the peaks scatter around the model (in samples)
    # where that is wider: near the budget the peaks a trial reports stop rising with the batch (the
    # allocator makes do under the cap), and steps finer than that scatter only creep.
    scatter = _model_scatter_samples(state)
    unit = max(r, math.ceil(scatter / g) * g if math.isfinite(scatter) else r)
    state.strides += 1
    return lo + unit * 2 ** (state.strides - 1)


def _narrow(state: _State, guess: float | None) -> int:
    """Next size inside the bracket.

    The ceiling is where the failures' errors put it (what they needed, oom_reading.py), or the model's
    where a sharp model puts it lower. While that is at or above the smallest failing size less one
    resolution (the failures are the band, not the model's error), step down from that size: one
    resolution, one more, then twice as far after each further failure (1, 2, 4, 8 resolutions below the
    first failure), so the trials stay near the ceiling where they decide something instead of bisecting
    from far below. Otherwise that ceiling, while the errors put it or the model is sharper than the
    bracket (its scatter, in samples, under a quarter of the width), and while each step from a size
    that ran at least halves the bracket; else bisection, which guarantees progress."""
    g, lo, hi, r = state.granularity, state.lo, state.hi, state.stop_width()
    assert hi is not None
    width = hi - lo
    stalled = state.guided_width is not None and width > GUIDED_SHRINK * state.guided_width
    scatter = _model_scatter_samples(state)
    blurred = scatter > width / 4
    sharp = guess is not None and not (stalled or blurred or guess <= lo + scatter)  # within its scatter: no say
    read = next_reading(state.trials, lo=lo, hi=hi, falls=state.falls, memory_budget_bytes=state.memory_budget_bytes)
    if read is not None and (state.falls or not stalled):
        guess, sharp = (min(guess, read) if sharp and guess is not None else read), True
    if state.falls and (state.flipped or (guess is not None and guess >= hi - r)):
        state.flipped, state.guided_width = False, None
        candidate = _round_down(hi - r * 2 ** max(0, state.falls - 2), g)
    elif guess is None or not sharp:
        state.guided_width = None
        candidate = _round_down((lo + hi) / 2, g)
    else:
        state.guided_width = width
        candidate = _round_down(guess, g)
    if width <= 2 * r:
        # Within two resolutions a size at most one resolution from both ends closes the bracket
        # whichever way it goes: one trial, where a step next to an end may need two.
        return min(max(candidate, hi - r, lo + g), lo + r, hi - g)
    # A step within one resolution of either end would leave the bracket barely narrower if it went
    # the expected way; one resolution in from the ends closes it when it does.
    return min(max(candidate, lo + r), hi - r)


def search_ceiling(run_trial: RunTrial, *, granularity: int = 1, max_batch: int | None = None,
                   memory_budget_bytes: int | None = None, margin: float = 0.15, confirm: int = 2,
                   resolution: int | None = None, start: int | None = None,
                   command: tuple[str, ...] = ()) -> SearchResult:
    """Find the largest batch (a multiple of granularity) that runs, with the next size tried above it
    failing for memory no more than `resolution` above it; confirm it passed `confirm` times; find a safe
    batch that passes `confirm` fresh runs.

    `start`: a predicted ceiling. The search tries it first, then one resolution above it: where that
    fails, the prediction was right and the bracket is closed in two trials; otherwise the search goes on
    from what those two trials showed. `command`: the trials run the user's own command (written with
    {batch}), which an error names."""
    if max_batch is not None:
        max_batch = max(granularity, _round_down(max_batch, granularity))
    state = _State(granularity=granularity, max_batch=max_batch, memory_budget_bytes=memory_budget_bytes,
                   resolution=resolution, command=command)
    size: int | None = granularity
    if start is not None:
        size = max(granularity, _round_down(start, granularity))
        size = min(size, max_batch) if max_batch is not None else size
    while size is not None:
        outcome = _run(run_trial, size, state)
        state.record(outcome)
        if not outcome.ok and not state.passes and size == granularity:
            raise BudgetTooSmallError(
                f"batch {size} runs out of memory already ({outcome.error.splitlines()[0] if outcome.error else 'OOM'})")
        size = _above_the_prediction(state) if start is not None and len(state.trials) == 1 else _next_size(state)
        if size is None and state.lo and state.passes.get(state.lo, 0) < confirm:
            size = state.lo
    if not state.lo:
        raise BudgetTooSmallError(f"no batch size of {granularity} or more ran reliably")
    return _finish(run_trial, state, margin, confirm)


def _above_the_prediction(state: _State) -> int | None:
    """After the predicted ceiling was tried: one resolution above it where it ran (None where that is
    past max_batch); where it failed, the search's own next step down."""
    if not state.lo:
        return _next_size(state)
    if state.max_batch is not None and state.lo >= state.max_batch:
        return None
    size = state.lo + state.stop_width()
    return min(size, state.max_batch) if state.max_batch is not None else size


def _run(run_trial: RunTrial, size: int, state: _State) -> TrialOutcome:
    outcome = run_trial(size)
    if outcome.status not in (OK, OOM):
        state.trials.append(outcome)
        why = f"{(outcome.error or 'no error text').strip().splitlines()[-1]}"
        detail = outcome.error_tail or outcome.error
        if outcome.error_kind == HARNESS_FAULT:  # the worker's own words say what to do: the hint is never cut
            raise HarnessError(f"the trial at batch {size} could not start its worker process",
                               hint=why[:1].upper() + why[1:], detail=detail)
        if outcome.status == NONFINITE and not state.passes:  # no size has trained yet: the workload's own loss
            raise WorkloadBrokenError(f"the workload's loss is not finite in the first trial (batch {size}): "
                                      f"{why.split(': ')[0]}", detail=detail,
                                      hint="Make the workload's loss(outputs, targets) a finite mean over the batch: "
                                           "check it, the batch maker's data and the learning rate.")
        if outcome.status == NONFINITE:
            raise TrialFailedError(f"the trial at batch {size} stopped: {why.split(': ')[0]}", detail=detail,
                                   hint="Training diverged, or the workload computes a non-finite loss: check its "
                                           "loss function, data and learning rate (this is not a memory limit).")
        if outcome.status == ERROR and not state.passes and state.command:
            shown = shlex.join(arg.replace("{batch}", str(size)) for arg in state.command)
            raise WorkloadBrokenError(f"the command fails at batch {size} not for lack of memory: {why}",
                                      detail=outcome.error_tail or outcome.error,
                                      hint=f"Run it by hand to see the whole error: {shown}")
        if outcome.status == ERROR and not state.passes:
            raise WorkloadBrokenError(f"the workload fails at batch {size} not for lack of memory: {why}",
                                      detail=outcome.error)
        hint = ("It was killed from outside (often the kernel's OOM killer: see dmesg); --resume runs it again."
                if outcome.status == KILLED else None)
        raise TrialFailedError(f"trial at batch {size} ended as {outcome.status}, not out of memory: {why}",
                               detail=outcome.error, hint=hint)
    return outcome


def _finish(run_trial: RunTrial, state: _State, margin: float, confirm: int) -> SearchResult:
    ceiling, first_failing, g = state.lo, state.hi, state.granularity
    first = min(safe_batch_for(ceiling, margin, g), ceiling)
    warnings = []
    if ceiling * (1.0 - margin) < g:
        warnings.append(f"the ceiling ({ceiling}) is so small that the safe batch is one granule ({first})")
    safe, failed_at = _verified_safe_batch(run_trial, state, first, margin, confirm)
    model = fit_memory_model(state.trials)
    if failed_at:
        why = ("memory barely grows with the batch over these trials (the memory model is not resolved), so "
               "the margin buys little room" if model is None or not model.resolved else
               "sizes well below the ceiling ran out of memory: the band where one size both fits and fails is wide")
        warnings.append(f"the safe batch {first} failed a verification run; stepped down through "
                        f"{', '.join(map(str, failed_at))} to {safe}, which passed {confirm} fresh runs: {why}")
    return SearchResult(
        trials=tuple(state.trials), ceiling=ceiling, first_failing=first_failing, safe_batch=safe,
        safe_batch_verified=True, memory_model=model, resolution=state.stop_width(), safe_batch_first=first,
        warnings=tuple(warnings),
    )


def _verified_safe_batch(run_trial: RunTrial, state: _State, safe: int, margin: float,
                         confirm: int) -> tuple[int, list[int]]:
    """The first size, from `safe` down by the margin again, that passes `confirm` fresh runs (earlier
    passes of the same size count), and the sizes that failed on the way."""
    g = state.granularity
    failed_at: list[int] = []
    while True:
        passes = state.passes.get(safe, 0)
        while passes < confirm:
            outcome = _run(run_trial, safe, state)
            state.trials.append(outcome)
            if not outcome.ok:
                break
            passes += 1
        if passes >= confirm:
            return safe, failed_at
        failed_at.append(safe)
        below = min(safe_batch_for(safe, margin, g), safe - g)
        if below <= g:  # one granule is no batch to train at: the answer is that nothing is safe
            raise UnsafeBatchError(
                f"no batch size above one granule ({g}) passed {confirm} fresh runs: the safe batch stepped down "
                f"through {', '.join(map(str, failed_at))} and each failed")
        safe = below
