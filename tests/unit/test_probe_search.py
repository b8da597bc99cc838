"""The ceiling search against fake trial functions: exact answers and trial counts."""

from __future__ import annotations

import pytest

from mbtune.errors import BudgetTooSmallError, TrialFailedError, UnsafeBatchError, WorkloadBrokenError
from mbtune.probing.records import MemoryModel, TrialOutcome
from mbtune.probing.search import SearchResult, fit_memory_model, safe_batch_for, search_ceiling
from mbtune.recordio import RecordFieldError
from mbtune.report.probe import memory_model_text

FIXED, PER_SAMPLE = 1000, 10


def fake_trials(fits, *, fixed=FIXED, per_sample=PER_SAMPLE, used=None, status_on_fail="oom"):
    """run_trial(batch) that passes when fits(batch, attempt) and reports a memory peak: used(batch), or
    without it the linear fixed + per_sample x batch."""
    sizes: list[int] = []
    peak = used or (lambda batch: fixed + per_sample * batch)

    def run(batch: int) -> TrialOutcome:
        sizes.append(batch)
        ok = fits(batch, sizes.count(batch))
        return TrialOutcome(status="ok" if ok else status_on_fail, batch_size=batch,
                            budget_used_bytes=peak(batch) if ok else None)

    run.sizes = sizes  # type: ignore[attr-defined]
    return run


def below(limit):
    return lambda batch, attempt: batch <= limit


def budget_for(limit):
    return FIXED + PER_SAMPLE * limit + PER_SAMPLE // 2


def sublinear_search(exponent: float, resolution: int) -> tuple[SearchResult, list[int], list[int]]:
    """A search over memory that grows slower than linearly (1000 + 400 x batch^exponent) where every
    size up to 1000 fits: the result, every size tried, and those up to the first failure."""
    def used(batch: int) -> float:
        return 1000 + 400 * batch**exponent

    run = fake_trials(below(1000), used=used)
    result = search_ceiling(run, memory_budget_bytes=int(used(1000)) + 1, resolution=resolution)
    sizes = run.sizes
    return result, sizes, sizes[: next(i for i, b in enumerate(sizes) if b > 1000) + 1]


@pytest.mark.parametrize("limit", [1, 7, 100, 389, 1000])
def test_finds_exact_ceiling_with_next_size_failing(limit):
    run = fake_trials(below(limit))
    result = search_ceiling(run, memory_budget_bytes=budget_for(limit), resolution=1)
    assert result.ceiling == limit
    assert result.first_failing == limit + 1
    assert result.safe_batch == safe_batch_for(limit, 0.15, 1)
    assert result.safe_batch_verified
    assert run.sizes.count(limit) >= 2  # confirmed
    assert run.sizes[-1] == result.safe_batch  # verified by a final run


def test_trial_counts_are_pinned():
    run = fake_trials(below(100))
    search_ceiling(run, memory_budget_bytes=budget_for(100), resolution=1)
    # Growth goes to the model's ceiling, the next size up fails; the ceiling is confirmed and the safe
    # batch passes two fresh runs.
    assert run.sizes == [1, 4, 32, 100, 101, 100, 85, 85]


def test_model_needs_fewer_trials_than_doubling_and_bisection():
    guided = fake_trials(below(389))
    search_ceiling(guided, memory_budget_bytes=budget_for(389), resolution=1)
    plain = fake_trials(below(389))
    search_ceiling(plain, memory_budget_bytes=None, resolution=1)  # no budget: no model guess, grow and bisect
    assert len(guided.sizes) == 9
    assert len(guided.sizes) < len(plain.sizes)


def test_flaky_boundary_is_confirmed_not_trusted():
    # 389 always runs; 390 never; 391 runs once, then fails on repeat.
    def fits(batch, attempt):
        return batch <= 389 or (batch == 391 and attempt == 1)

    run = fake_trials(fits)
    result = search_ceiling(run, memory_budget_bytes=budget_for(391), resolution=1)
    assert result.ceiling == 389
    assert result.first_failing == 390
    assert run.sizes.count(389) == 2
    assert 391 in run.sizes and 390 in run.sizes


def test_granularity_and_max_batch():
    run = fake_trials(below(100))
    result = search_ceiling(run, granularity=8, memory_budget_bytes=budget_for(100), resolution=1)
    assert (result.ceiling, result.first_failing, result.safe_batch) == (96, 104, 80)
    assert all(size % 8 == 0 for size in run.sizes)

    capped = search_ceiling(fake_trials(below(100)), max_batch=50, memory_budget_bytes=budget_for(100))
    assert (capped.ceiling, capped.first_failing) == (50, None)


def test_budget_too_small_for_the_first_size():
    with pytest.raises(BudgetTooSmallError, match="batch 1 runs out of memory"):
        search_ceiling(fake_trials(below(0)), memory_budget_bytes=100)


def test_non_memory_failure_is_never_counted_as_oom():
    run = fake_trials(below(10), status_on_fail="error")
    with pytest.raises(TrialFailedError, match="not out of memory"):
        search_ceiling(run, memory_budget_bytes=budget_for(10))
    with pytest.raises(WorkloadBrokenError, match="not for lack of memory"):
        search_ceiling(fake_trials(below(0), status_on_fail="error"), memory_budget_bytes=100)


def test_a_safe_batch_that_fails_verification_steps_down_until_it_passes_every_run():
    # The safe batch (85) fails its verification although 100 passed twice.
    def fits(batch, attempt):
        return batch <= 100 and batch != 85

    run = fake_trials(fits)
    result = search_ceiling(run, memory_budget_bytes=budget_for(100), resolution=1)
    assert result.ceiling == 100 and result.safe_batch_verified
    assert (result.safe_batch_first, result.safe_batch) == (85, safe_batch_for(85, 0.15, 1))
    assert run.sizes[-2:] == [result.safe_batch] * 2  # passed --confirm fresh runs
    assert any("stepped down through 85 to 72" in w for w in result.warnings)


def test_verification_needs_confirm_passes_not_one():
    # Every size passes its first run and fails its second (below the ceiling): nothing is safe.
    def fits(batch, attempt):
        return batch <= 100 and (attempt == 1 or batch == 100)

    with pytest.raises(UnsafeBatchError, match="no batch size above one granule"):
        search_ceiling(fake_trials(fits), memory_budget_bytes=budget_for(100), resolution=1)


def test_one_granule_left_is_no_safe_batch():
    # Only batch 1 survives its verification runs: stepping down to one granule is not an answer.
    def fits(batch, attempt):
        return batch <= 100 and (attempt == 1 or batch in (1, 100))

    run = fake_trials(fits)
    with pytest.raises(UnsafeBatchError, match="stepped down through 85, 72,") as raised:
        search_ceiling(run, memory_budget_bytes=budget_for(100), resolution=1)
    assert raised.value.exit_code == 3 and 1 not in run.sizes[run.sizes.index(85):]


def test_the_probe_stops_at_the_resolution():
    exact = fake_trials(below(10_000))
    search_ceiling(exact, memory_budget_bytes=budget_for(10_000), resolution=1)
    for resolution in (None, 100):  # None: 1% of the ceiling
        run = fake_trials(lambda batch, attempt: batch <= 10_000)
        result = search_ceiling(run, memory_budget_bytes=budget_for(10_000) + 60 * PER_SAMPLE, resolution=resolution)
        assert result.ceiling <= 10_000 < result.first_failing  # the bracket holds the truth
        assert result.first_failing - result.ceiling <= 100 == result.resolution
        assert run.sizes.count(result.ceiling) >= 2 and result.first_failing in run.sizes


def test_an_unresolved_memory_model_leaves_the_search_to_bisection():
    # Memory that does not grow with the batch: the fit cannot place a ceiling, so the search must
    # take exactly the steps it takes with no model at all.
    flat = fake_trials(below(389), per_sample=0)
    result = search_ceiling(flat, memory_budget_bytes=budget_for(389), resolution=1)
    plain = fake_trials(below(389))
    search_ceiling(plain, memory_budget_bytes=None, resolution=1)
    assert result.memory_model is not None and not result.memory_model.resolved
    assert result.memory_model.batch_for(10**9) is None
    assert flat.sizes == plain.sizes


@pytest.mark.parametrize(("ceiling", "margin", "granularity", "safe"), [
    (100, 0.15, 1, 85), (389, 0.15, 1, 330), (96, 0.15, 8, 80), (10, 0.10, 1, 9), (100, 0.0, 1, 100),
    (1, 0.15, 1, 1), (7, 0.5, 4, 4),
])
def test_safe_batch_arithmetic(ceiling, margin, granularity, safe):
    assert safe_batch_for(ceiling, margin, granularity) == safe


def test_memory_model_fit_recovers_linear_costs():
    trials = [TrialOutcome(status="ok", batch_size=b, budget_used_bytes=500 + 3 * b) for b in (1, 4, 32)]
    model = fit_memory_model(trials)
    assert model.fixed_bytes == pytest.approx(500)
    assert model.per_sample_bytes == pytest.approx(3)
    assert model.fit_error_pct == pytest.approx(0, abs=1e-9)
    assert model.batch_for(800) == pytest.approx(100)
    assert fit_memory_model(trials[:1]) is None
    assert model.resolved


@pytest.mark.parametrize("used", [
    [205_200_000, 197_900_000],  # measured: the larger batch used less (peak memory noise)
    [100_000_000, 100_500_000, 99_800_000],  # growth below the run-to-run noise of peak memory
    [100_000_000, 130_000_000, 101_000_000],  # a slope no larger than its own scatter
])
def test_a_slope_that_does_not_stand_clear_of_its_scatter_is_not_resolved(used):
    trials = [TrialOutcome(status="ok", batch_size=384 * (i + 1), budget_used_bytes=u) for i, u in enumerate(used)]
    model = fit_memory_model(trials)
    assert not model.resolved and model.batch_for(10**9) is None
    # No slope at all is kept, so neither the JSON nor the table can show a negative or meaningless one.
    assert model.per_sample_bytes is None and model.to_dict()["per_sample_bytes"] is None
    assert memory_model_text(model).startswith("not resolved (memory barely grows with the batch")


def test_a_profile_saved_with_an_unresolved_slope_reads_without_it():
    old = {"fixed_bytes": 2e8, "per_sample_bytes": -19146.7, "fit_error_pct": 1.0, "num_points": 2,
           "resolved": False}
    assert MemoryModel.from_dict(old).per_sample_bytes is None
    with pytest.raises(RecordFieldError, match="per_sample_bytes"):
        MemoryModel.from_dict({**old, "resolved": True, "per_sample_bytes": None})


def test_an_underestimating_model_does_not_creep_up_in_shrinking_steps():
    # Memory that grows slower than linearly (per-sample cost falls with the batch): every linear fit
    # predicts the ceiling a little above the last size that ran, and the true ceiling far beyond it.
    result, sizes, growing = sublinear_search(0.7, resolution=1)
    assert (result.ceiling, result.first_failing) == (1000, 1001)
    steps = [b - a for a, b in zip(growing, growing[1:])]
    # No creeping: once the model has been found short twice running, no step is shorter than the one
    # before it (the first underestimate may still be one a linear fit explains, and is trusted once).
    shrinks = [i for i in range(1, len(steps)) if steps[i] < steps[i - 1]]
    assert len(shrinks) <= 1, sizes
    assert len(sizes) <= 20, sizes


def test_within_two_resolutions_one_trial_closes_the_bracket():
    # The model overshoots (memory grows faster above 1000 than below), so 1200 fails with 1000 run:
    # a bracket 200 wide at resolution 100 must close in one trial, whichever way it goes.
    for limit in (1040, 1160):
        run = fake_trials(below(limit))
        result = search_ceiling(run, memory_budget_bytes=budget_for(1200), resolution=100)
        assert result.first_failing - result.ceiling <= 100
        assert result.ceiling <= limit < result.first_failing
        narrowing = run.sizes[run.sizes.index(1200) + 1:]
        assert narrowing[0] == 1100  # one resolution from both ends of [1024, 1200)
        assert set(narrowing[1:]) <= {result.ceiling, result.safe_batch}  # then only confirmation


def test_failures_under_a_model_that_overshoots_step_down_from_the_top():
    # Memory that the model reads as fitting up to ~1000 while everything above 900 fails: the search
    # steps down from the failing sizes (one resolution, then twice as far) instead of bisecting from
    # the growth phase's last size far below.
    run = fake_trials(below(900))
    result = search_ceiling(run, memory_budget_bytes=budget_for(1000), resolution=10)
    assert result.ceiling <= 900 < result.first_failing <= result.ceiling + 10
    failed = [s for s in run.sizes if s > 900]
    assert failed == sorted(failed, reverse=True)  # each try below the last failure
    after_first_failure = run.sizes[run.sizes.index(failed[0]):]
    assert min(after_first_failure) >= 800 or min(after_first_failure) == result.safe_batch
    assert not [s for s in after_first_failure if s < 800 and s != result.safe_batch]  # no step from far below


def test_a_flip_widens_the_default_resolution_to_the_band():
    # Sizes from 980 up run on their first try and fail on every later one: a band. With the default
    # resolution (1%) the search stops at a bracket of at least two resolutions once it has seen that.
    run = fake_trials(lambda batch, attempt: batch < 980 or (batch <= 1000 and attempt == 1))
    result = search_ceiling(run, memory_budget_bytes=budget_for(1000))
    assert result.ceiling < 980 and result.first_failing <= 1000
    assert result.resolution >= 2 * 10  # twice 1% of the ceiling
    assert run.sizes.count(result.ceiling) >= 2


def test_no_growth_step_is_shorter_than_the_resolution():
    # A model that underestimates by a little each time (its ceiling a few samples above the last size
    # that ran): a step shorter than the resolution would buy less than a step of one resolution, which
    # closes the bracket as narrowly if it fails.
    result, sizes, growing = sublinear_search(0.9, resolution=20)
    assert result.ceiling <= 1000 < result.first_failing <= result.ceiling + 20
    growing = [b for b in growing if b >= 100]
    assert all(b - a >= 20 for a, b in zip(growing, growing[1:])), sizes  # from where 1% is below a step


def test_after_two_failures_at_the_top_the_step_down_is_two_resolutions_below_the_first():
    # The model puts the ceiling at 1000 and everything above 985 fails: 1000 and 990 fail, then 980
    # (two resolutions below the first failure, not three) runs and closes the bracket [980, 990).
    run = fake_trials(below(985))
    result = search_ceiling(run, memory_budget_bytes=budget_for(1000), resolution=10)
    top = run.sizes[run.sizes.index(1000):]
    assert top[:3] == [1000, 990, 980], run.sizes
    assert (result.ceiling, result.first_failing) == (980, 990)
    assert set(top[3:]) <= {980, result.safe_batch}  # then only confirmation and the safe batch


def test_peaks_that_scatter_widen_the_default_resolution_before_any_flip():
    # Peaks scatter about 30 samples' worth around the line (the allocator's steps), every size up to
    # 1000 fits: 1% (10) would bisect inside that scatter, so the default widens (at most 5%, 50);
    # an explicit resolution never does.
    def used(batch: int) -> int:
        return FIXED + PER_SAMPLE * batch + (batch * 2654435761) % 601 - 300  # fixed per size, any sign

    run = fake_trials(below(1000), used=used)
    result = search_ceiling(run, memory_budget_bytes=budget_for(1000))
    assert 10 < result.resolution <= 50
    assert result.ceiling <= 1000 < result.first_failing <= result.ceiling + result.resolution
    exact = search_ceiling(fake_trials(below(1000), used=used), memory_budget_bytes=budget_for(1000), resolution=1)
    assert (exact.ceiling, exact.first_failing, exact.resolution) == (1000, 1001, 1)


def test_a_misfit_at_small_sizes_does_not_widen_the_default_resolution():
    # Start-up allocations add 500 bytes at the smallest sizes, so the line fitted through every size
    # misses them; the peaks near the ceiling lie on it. The band is judged by the peaks near the ceiling,
    # so the default resolution stays at 1% of the ceiling and the bracket closes to it.
    def used(batch: int) -> int:
        return FIXED + PER_SAMPLE * batch + (500 if batch <= 16 else 0)

    run = fake_trials(below(1000), used=used)
    result = search_ceiling(run, memory_budget_bytes=budget_for(1000))
    assert result.resolution == 10
    assert result.ceiling <= 1000 < result.first_failing <= result.ceiling + 10


@pytest.mark.parametrize("limit", [7, 389, 1000])
def test_a_prediction_within_the_resolution_is_confirmed_in_three_trials(limit):
    run = fake_trials(below(limit))
    result = search_ceiling(run, memory_budget_bytes=budget_for(limit), confirm=1, start=limit)
    assert (result.ceiling, result.first_failing) == (limit, limit + result.resolution)
    assert run.sizes == [limit, limit + result.resolution, result.safe_batch]  # the top, above it, the safe batch


@pytest.mark.parametrize(("limit", "start"), [(389, 300), (389, 500), (389, 2000), (7, 100), (1000, 1)])
def test_a_wrong_prediction_still_ends_at_the_exact_ceiling(limit, start):
    run = fake_trials(below(limit))
    result = search_ceiling(run, memory_budget_bytes=budget_for(limit), resolution=1, start=start)
    assert (result.ceiling, result.first_failing) == (limit, limit + 1)


def test_a_prediction_past_max_batch_starts_at_max_batch_and_stops_there():
    run = fake_trials(below(1000))
    result = search_ceiling(run, memory_budget_bytes=budget_for(1000), max_batch=64, confirm=1, start=500)
    assert result.ceiling == 64 and result.first_failing is None and run.sizes[0] == 64


def test_a_first_size_that_fails_is_too_small_a_budget_only_at_one_granule():
    run = fake_trials(below(0))
    with pytest.raises(BudgetTooSmallError):
        search_ceiling(run, memory_budget_bytes=budget_for(0), start=50)
    assert run.sizes[0] == 50 and run.sizes[-1] == 1
