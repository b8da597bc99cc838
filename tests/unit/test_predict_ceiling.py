"""The predicted ceiling's search over predicted peaks (pure: the peaks here are functions)."""

from __future__ import annotations

import pytest

from mbtune.probing.ceiling_prediction import MAX_CHECKS, _largest_fitting


def _counted(peak):
    calls: list[int] = []

    def counted(size: int) -> int:
        calls.append(size)
        return peak(size)

    return counted, calls


@pytest.mark.parametrize("peak", [
    lambda b: 30_000 + 5_500 * b,  # a line
    lambda b: 30_000 + 5_000 * b + 4 * b * b,  # growing faster than the line from small sizes says
    lambda b: 30_000 + (20_000 * b if b < 10 else 180_000 + 5_500 * b),  # bent: small sizes overstate the slope
])
@pytest.mark.parametrize("granularity", [1, 8])
def test_it_finds_the_largest_size_that_fits_in_few_predictions(peak, granularity):
    budget = 3_000_000
    counted, calls = _counted(peak)
    found = _largest_fitting(counted, budget, granularity, granularity, 9 * granularity, None)
    assert found % granularity == 0 and peak(found) <= budget < peak(found + granularity)
    assert len(set(calls)) <= MAX_CHECKS + 2


def test_it_stops_at_the_top_it_is_given():
    found = _largest_fitting(lambda b: b, 10**9, 1, 1, 9, 64)
    assert found == 64
