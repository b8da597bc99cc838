"""A raced sweep of a real workload, screened by the real simulator (sweeping/screen.py through
planning/api.grid_predictor): every grid point is either measured or shown as predicted, never lost; what
was left out says its predicted figure, its error and why; the answer carries a decision; and --measure-all measures every point."""

from __future__ import annotations

import pytest

import mbtune
from mbtune.sweeping.equivalence import DECIDED, EQUIVALENT, NOT_DECIDED
from mbtune.sweeping.screen import MIN_ERROR

pytestmark = pytest.mark.integration

GRID = dict(workload="mlp", options={"layers": 4, "width": 64}, device="cpu", stages=2,
            schedules="gpipe,1f1b", micro_batches="2,4,8", accum="1,2", global_batch=64, steps=2,
            repeats=None, time_budget="20s", pin_cpus=False)


def test_a_screened_race_measures_or_predicts_every_point_and_decides_on_what_it_measured(monkeypatch):
    monkeypatch.delenv("MBTUNE_REPEATS", raising=False)
    report = mbtune.sweep(**GRID)
    measured = {r.point for r in report.results}
    predicted = {p.point for p in report.predicted}
    assert not measured & predicted
    assert len(measured) + len(predicted) + len(report.skipped) == report.num_grid_points == 12
    assert report.decision is not None and report.decision.state in (DECIDED, EQUIVALENT, NOT_DECIDED)
    assert report.decision.size == pytest.approx(0.03)
    assert report.best is not None and report.best.samples_per_s
    for left in report.predicted:  # an error stated, never below the floor, and why
        assert left.error >= MIN_ERROR and left.reason.endswith("not on the throughput-memory front")
        assert left.samples_per_s > 0
    assert any("predicted the grid from" in n or "measured every point" in n for n in report.notes)


def test_measure_all_measures_every_point(monkeypatch):
    monkeypatch.delenv("MBTUNE_REPEATS", raising=False)
    report = mbtune.sweep(**{**GRID, "time_budget": "5s"}, measure_all=True)
    assert not report.predicted and len(report.results) == 12
    assert report.decision is not None
