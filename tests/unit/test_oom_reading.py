"""A search that reads the error: what an out-of-memory error says it needed (the bytes asked for and those the
budget held), carried by the trial's outcome and read by the search for its next size instead of stepping
down one granule at a time."""

from __future__ import annotations

import json

import pytest

from mbtune.device.oom_figures import oom_fields, oom_figures
from mbtune.probing.command import classify, oom_figures_of
from mbtune.probing.confirm import Capped
from mbtune.probing.oom_reading import next_reading, read_ceiling
from mbtune.probing.records import TrialOutcome
from mbtune.probing.search import search_ceiling
from mbtune.records import OOM

KIB, MIB, GIB = 2**10, 2**20, 2**30

# torch 2.x's caching allocator, word for word (c10/cuda/CUDACachingAllocator.cpp), under a per-process fraction.
CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 10.81 MiB is free. Including non-PyTorch memory, this process has 7.99 GiB memory in "
            "use. 8.00 GiB allowed; Of the allocated memory 7.48 GiB is allocated by PyTorch, and 15.90 MiB is reserved "
            "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
CPU_OOM = ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 17002496 bytes (aten.mm.default) with "
           "50193408 bytes (47.87 MiB) of the 64.00 MiB memory budget in live tensors")


def test_the_cpu_counts_message_names_both_figures_exactly() -> None:
    figures = oom_figures("torch.OutOfMemoryError: " + CPU_OOM)
    assert figures is not None
    assert (figures.requested_bytes, figures.live_bytes, figures.need_bytes) == (17002496, 50193408, 67195904)
    assert oom_fields(CPU_OOM) == {"oom_requested_bytes": 17002496, "oom_live_bytes": 50193408}


def test_cudas_message_is_read_at_the_low_end_of_what_it_rounds() -> None:
    figures = oom_figures(CUDA_OOM)
    assert figures is not None
    # Printed to two decimals: each figure is at most what was printed and within half a digit of it.
    assert 20 * MIB - 0.005 * MIB - 1 <= figures.requested_bytes <= 20 * MIB
    held = 7.48 * GIB + 15.90 * MIB  # allocated and reserved but unallocated: what the fraction counts
    assert held - 0.01 * GIB <= figures.live_bytes <= held
    graphs = CUDA_OOM.replace("by PyTorch, and", "by PyTorch, with 512.00 MiB allocated in private pools (e.g., "
                              "CUDA Graphs), and").replace("20.00 MiB", "512 bytes")
    with_pools = oom_figures(graphs)
    assert with_pools is not None and with_pools.requested_bytes == 512 and with_pools.live_bytes == figures.live_bytes


@pytest.mark.parametrize("message", [
    "CUDA error: out of memory", "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes. "
    "Error code 12 (Cannot allocate memory)", "RuntimeError: shape mismatch", ""])
def test_an_error_that_names_no_figures_gives_none(message: str) -> None:
    assert oom_figures(message) is None and oom_fields(message) == {}


def test_a_command_trial_carries_the_figures_its_processes_reported_or_printed() -> None:
    counted = {"peak_bytes": 10, "over_budget": CPU_OOM, "exception": "", "step_times_s": [],
               "oom_requested_bytes": 5, "oom_live_bytes": 7}
    raised = {"peak_bytes": 10, "over_budget": "CUDA out of memory under the per-process memory fraction",
              "exception": CUDA_OOM, "step_times_s": []}
    # Of several processes, the one that needed the most; the cap's numbers over its words.
    assert oom_figures_of(Capped(1, [counted, raised], "", 1.0, 60)) == oom_fields(CUDA_OOM)
    assert oom_figures_of(Capped(1, [counted], "", 1.0, 60)) == {"oom_requested_bytes": 5, "oom_live_bytes": 7}
    # A script that caught the error reported no exception: the line it printed still names the figures.
    caught = {"peak_bytes": 10, "over_budget": "CUDA out of memory under the per-process memory fraction",
              "exception": "", "step_times_s": []}
    printed = Capped(0, [caught], f"epoch 1\nskipping the batch: {CUDA_OOM}\n", 1.0, 60)
    outcome = classify(printed, 64, 3)
    assert outcome.status == OOM and outcome.oom_need_bytes == oom_figures(CUDA_OOM).need_bytes
    assert oom_figures_of(Capped(1, [caught], "", 1.0, 60)) == {}


def test_the_figures_are_saved_with_the_trial_and_only_a_failure_has_a_need() -> None:
    failed = TrialOutcome(status=OOM, batch_size=64, oom_requested_bytes=5, oom_live_bytes=7)
    assert TrialOutcome.from_dict(json.loads(json.dumps(failed.to_dict()))) == failed and failed.oom_need_bytes == 12
    assert TrialOutcome(status=OOM, batch_size=64, oom_requested_bytes=5).oom_need_bytes is None
    assert TrialOutcome(status="ok", batch_size=64, oom_requested_bytes=5, oom_live_bytes=7).oom_need_bytes is None
    assert TrialOutcome.from_dict({"status": OOM, "batch_size": 64}).oom_requested_bytes is None  # an older journal


def _ran(size: int, peak: int) -> TrialOutcome:
    return TrialOutcome(status="ok", batch_size=size, budget_used_bytes=peak)


def _failed(size: int, need: int | None) -> TrialOutcome:
    return TrialOutcome(status=OOM, batch_size=size, oom_requested_bytes=None if need is None else 100,
                        oom_live_bytes=None if need is None else need - 100)


def test_the_reading_is_where_the_line_from_the_largest_size_that_ran_to_the_need_meets_the_budget() -> None:
    trials = [_ran(8, 200), _ran(10, 400), _failed(20, 1100)]
    assert read_ceiling(trials, lo=10, memory_budget_bytes=1000) == pytest.approx(10 + 600 * 10 / 700)
    # The least over the failures; one that needed no more than the budget (the error was not the budget's)
    # says nothing, nor one that named no figures.
    more = [*trials, _failed(16, 1300), _failed(13, 990), _failed(12, None)]
    assert read_ceiling(more, lo=10, memory_budget_bytes=1000) == pytest.approx(10 + 600 * 6 / 900)
    assert read_ceiling([_ran(10, 400), _failed(13, 990)], lo=10, memory_budget_bytes=1000) is None
    assert read_ceiling(trials, lo=10, memory_budget_bytes=None) is None
    assert read_ceiling(trials, lo=9, memory_budget_bytes=1000) is None  # no peak at lo to draw the line from
    # A size that held exactly the budget is the ceiling: the line meets it there.
    assert read_ceiling([_ran(10, 1000), _failed(20, 1100)], lo=10, memory_budget_bytes=1000) == 10
    # From the third failure in a row on, twice as far below the smallest failing size, then four times.
    read = read_ceiling(trials, lo=10, memory_budget_bytes=1000)
    assert [next_reading(trials, lo=10, hi=20, falls=f, memory_budget_bytes=1000) for f in (1, 2)] == [read, read]
    assert next_reading(trials, lo=10, hi=20, falls=3, memory_budget_bytes=1000) == pytest.approx(20 - 2 * (20 - read))
    assert next_reading(trials, lo=10, hi=20, falls=9, memory_budget_bytes=1000) == 10  # never below lo


def blocks(size: int) -> int:
    """An allocation as CUDA's allocator (and the CPU count) hands it out: whole 512-byte blocks."""
    return -(-size // 512) * 512


def training_step(*, budget: int, read: bool):
    """run_trial(batch) of a training step under `budget`, from a granular allocator's counts: weights, their
    gradients and Adam's two moments (2 MiB, live throughout); the forward's 8 activations of 80 KiB a sample,
    live at its end; the optimizer step's 2 MiB of temporaries with the batch's inputs, live at its end. Small
    batches peak in the optimizer step, large ones at the end of the forward, so a line through small sizes
    puts the ceiling too high. Past the budget, the allocation that does not fit fails, and its error names it
    and what was live (with `read`)."""
    moments = [[(2 * MIB, 0), (0, 80 * KIB)], [(0, 80 * KIB)] * 8]  # (fixed bytes, bytes a sample) in order

    def run(batch: int) -> TrialOutcome:
        peak = 0
        for moment in moments:
            live = 2 * MIB
            for fixed, per_sample in moment:
                size = blocks(fixed + per_sample * batch)
                if live + size > budget:
                    figures = {"oom_requested_bytes": size, "oom_live_bytes": live} if read else {}
                    return TrialOutcome(status=OOM, batch_size=batch, **figures)
                live += size
            peak = max(peak, live)
        return TrialOutcome(status="ok", batch_size=batch, budget_used_bytes=peak)

    return run


def _search(budget: int, read: bool) -> tuple[int, int | None, list[int]]:
    sizes: list[int] = []
    step = training_step(budget=budget, read=read)

    def run(batch: int) -> TrialOutcome:
        sizes.append(batch)
        return step(batch)

    found = search_ceiling(run, memory_budget_bytes=budget, resolution=1, confirm=1)
    return found.ceiling, found.first_failing, sizes


BUDGET = 2 * MIB + 58 * 8 * 80 * KIB + 100 * KIB  # batch 58 fits, 59 does not


def test_reading_the_error_takes_at_most_5_trials_after_the_line_where_stepping_down_takes_8() -> None:
    # Sizes 1 and 16 draw the line, which puts the ceiling at 65; it is 58.
    ceiling, first_failing, stepping = _search(BUDGET, read=False)
    assert (ceiling, first_failing) == (58, 59)
    assert stepping == [1, 16, 65, 64, 63, 61, 57, 58, 59, 49]  # one granule down, one more, then 2, 4
    ceiling, first_failing, reading = _search(BUDGET, read=True)
    assert (ceiling, first_failing) == (58, 59)
    # 65 ran out of memory and said how much it needed: 58 next, then 59 to close the bracket, the safe batch.
    assert reading == [1, 16, 65, 58, 59, 49]
    assert len(reading[2:]) <= 5 < len(stepping[2:]) == 8


@pytest.mark.parametrize("fits", [20, 41, 58, 97, 150, 333])
def test_reading_the_error_still_ends_at_the_exact_ceiling(fits: int) -> None:
    budget = 2 * MIB + fits * 8 * 80 * KIB + 50 * KIB
    truth = max(b for b in range(1, 4 * fits) if training_step(budget=budget, read=False)(b).ok)
    ceiling, first_failing, sizes = _search(budget, read=True)
    assert (ceiling, first_failing) == (truth, truth + 1)
    assert sizes.count(truth) >= 1 and truth + 1 in sizes  # the ceiling ran and the next size up failed


def test_errors_that_say_the_budget_was_not_reached_change_nothing() -> None:
    # A failure whose figures stay within the budget (another process's memory, fragmentation) is no
    # reading: the search is the one without figures.
    def understated(batch: int) -> TrialOutcome:
        outcome = training_step(budget=BUDGET, read=False)(batch)
        return outcome if outcome.ok else TrialOutcome(status=OOM, batch_size=batch, oom_requested_bytes=1,
                                                       oom_live_bytes=1)

    sizes: list[int] = []
    search_ceiling(lambda b: sizes.append(b) or understated(b), memory_budget_bytes=BUDGET, resolution=1, confirm=1)
    assert sizes == _search(BUDGET, read=False)[2]
