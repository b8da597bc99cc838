"""The memory plan's lines: each moment of a rank's step as a line in the micro-batch size, and the largest
size whose every moment fits."""

from __future__ import annotations

import numpy as np
import pytest

from mbtune.pipeline.rank_memory import RankTrace
from mbtune.planning.memory_plan import _Line


def _line(at_one: list[int], at_two: list[int]) -> _Line:
    return _Line.of(RankTrace(peak_bytes=max(at_one), timeline=np.array(at_one)),
                    RankTrace(peak_bytes=max(at_two), timeline=np.array(at_two)))


def _fits(at_one: list[int], at_two: list[int], size: int, memory: int) -> bool:
    """By brute force: every moment at `size`, on its line."""
    return all(a + (size - 1) * (b - a) <= memory for a, b in zip(at_one, at_two, strict=True))


@pytest.mark.parametrize("memory", [100, 250, 1000, 4096])
def test_the_largest_size_fits_every_moment_and_one_more_does_not(memory):
    rng = np.random.default_rng(memory)
    at_one = list(rng.integers(10, 90, 40))
    at_two = [a + int(g) for a, g in zip(at_one, rng.integers(0, 30, 40), strict=True)]
    largest = _line(at_one, at_two).largest(memory)
    assert largest >= 1 and _fits(at_one, at_two, largest, memory)
    assert not _fits(at_one, at_two, largest + 1, memory)


def test_a_peak_that_moves_with_the_size_binds_where_it_moves_to():
    # At size 1 the first moment is the peak (a fixed 80); the second grows 30 a sample and overtakes it.
    line = _line([80, 40], [80, 70])
    assert line.largest(100) == 3  # 40 + 2 * 30 = 100; the peaks alone (80, 80) would say no growth at all


def test_nothing_fits_when_one_sample_is_over_and_anything_fits_when_nothing_grows():
    assert _line([50, 120], [60, 140]).largest(100) == 0
    assert _line([50, 60], [50, 60]).largest(100) == 2**30


def test_steps_that_differ_between_the_sizes_fall_back_to_their_peaks():
    line = _Line.of(RankTrace(peak_bytes=60, timeline=np.array([10, 60])),
                    RankTrace(peak_bytes=80, timeline=np.array([10, 20, 80])))
    assert line.largest(100) == 3  # 60 + 2 * 20


class _Truth:
    """Traces whose peaks run a little over their lines (as rounding does), growing with the size."""

    def __init__(self, at: int, grows: int) -> None:
        self.at, self.grows, self.traced = at, grows, []

    def peak(self, size: int) -> int:
        return self.at + (size - 1) * self.grows + size // 10

    def run(self, specs):
        self.traced += [spec.micro_batch_size for spec in specs]

    def peaks(self, spec, size):
        return (self.peak(size),)

    def seconds(self, spec):
        return 0.0


def test_where_the_lines_were_optimistic_the_size_steps_down_by_what_they_missed_not_by_one():
    from mbtune.planning.memory_plan import MemoryPlanConfig, _row

    config = MemoryPlanConfig(workload="mlp", device_memory_bytes=100_000, num_ranks=1, schedules=("gpipe",),
                              micro_batches=(1,))
    [(schedule, m, recompute, spec, why)] = config.specs()
    truth = _Truth(at=100, grows=10)
    line = _Line(np.array([truth.at]), np.array([truth.grows]))
    size = line.largest(config.device_memory_bytes)
    assert truth.peak(size) > config.device_memory_bytes  # the line alone would be a little over
    row = _row(schedule, m, recompute, spec, why, config, truth, [line], size)
    assert truth.peak(row.micro_batch_size) <= config.device_memory_bytes
    missed = truth.peak(size) - (truth.at + (size - 1) * truth.grows)
    assert row.micro_batch_size >= size - missed // truth.grows - 1  # gave up no more than the miss spans
    assert len(truth.traced) == 1  # one step down: the size the lines give in the memory less what they missed


def test_ranks_are_traced_in_this_process_once_cuda_has_started_here(monkeypatch):
    # A forked child cannot use the CUDA its parent started (a workload's library may start it while loading).
    from mbtune.planning import memory_plan

    class Predict:
        def rank(self, prepared, rank, *, timeline):
            return RankTrace(peak_bytes=10 * rank + prepared)

    def no_fork(_method):
        raise AssertionError("forked after CUDA started")

    monkeypatch.setattr(memory_plan, "_cuda_started", lambda: True)
    monkeypatch.setattr(memory_plan.multiprocessing, "get_context", no_fork)
    traces = memory_plan._fork_map(Predict(), [(1, 0, False), (1, 1, False), (2, 1, False)], workers=2)
    assert [t.peak_bytes for t in traces] == [1, 11, 12]
