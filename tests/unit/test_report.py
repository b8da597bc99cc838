"""Reports at pinned widths: exact content, columns that give way, machine formats."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from mbtune.pipeline.point import SweepPoint
from mbtune.records import DeviceInfo
from mbtune.report.probe import summary_panel, trials_table
from mbtune.report.sweep import best_panel, results_table, skipped_table
from mbtune.sweeping.ranking import rank_results
from mbtune.sweeping.records import PointResult, SkippedPoint, SweepReport
from tests.unit.test_records import sample_probe


def render(renderable, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def sweep_report() -> SweepReport:
    def result(schedule, m, rate, memory, status="ok"):
        point = SweepPoint(schedule=schedule, num_ranks=2, num_micro_batches=m, grad_accum_steps=1, micro_batch_size=4)
        if status != "ok":
            return PointResult(point=point, status=status, error="rank 1: still running after 8 s")
        return PointResult(point=point, status="ok", samples_per_s=rate, tokens_per_s=rate * 64,
                           step_time_median_s=point.global_batch / rate, step_time_cv_pct=3.0,
                           bubble_measured=0.3, bubble_theoretical=1 / (m + 1), peak_memory_bytes=(memory, memory))
    results = (result("gpipe", 2, 100.0, 300 * 2**20), result("1f1b", 4, 150.0, 250 * 2**20),
               result("gpipe", 8, 0, 0, status="timeout"))
    ranking, pareto = rank_results(results, "throughput")
    skipped = (SkippedPoint(point=SweepPoint(schedule="1f1b", num_ranks=2, num_micro_batches=1, grad_accum_steps=1,
                                             micro_batch_size=4), reason="1f1b needs at least as many micro-batches"),)
    return SweepReport(workload="gpt", device=DeviceInfo(backend="cpu", name="Test CPU"), objective="throughput",
                       results=results, skipped=skipped, ranking=ranking, pareto=pareto, ceiling=40, safe_batch=34,
                       ceiling_peak_memory_bytes=500 * 2**20)


def test_probe_tables_list_every_trial_and_the_summary():
    text = render(trials_table(sample_probe().trials), 100)
    assert "│ 1 │     1 │ ok     │        10 B │         5 B │  200.0 ms │       5.0 │" in text
    assert "│ 2 │     8 │ oom    │         n/a │         n/a │           │           │" in text
    summary = render(summary_panel(sample_probe()), 100)
    for line in ("ceiling        4", "first failing  5", "safe batch     3 (passed 2 fresh runs)", "bracket        [4, 5)", "margin         15%"):
        assert line in summary


def test_sweep_table_ranks_best_first_and_marks_pareto():
    report = sweep_report()
    lines = render(results_table(report, console=Console(width=160)), 160).splitlines()
    rows = [line for line in lines if line.strip()[:1].isdigit()]
    assert rows[0].split()[:2] == ["1*", "1f1b"] and rows[1].split()[:2] == ["2", "gpipe"]
    assert "timeout" in rows[2]
    assert "tokens/s" in lines[2] and "MFU: peak FLOPs unknown" in " ".join(" ".join(lines).split())


def test_narrow_terminal_hides_the_least_important_columns_and_says_so():
    report = sweep_report()
    text = render(results_table(report, console=Console(width=80)), 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "tokens/s" not in text.splitlines()[2] and "samples/s" in text
    assert "hidden to fit the terminal: tokens/s" in " ".join(text.split())


def test_best_panel_and_skipped_points():
    report = sweep_report()
    panel = render(best_panel(report), 120)
    assert "schedule            1f1b" in panel
    assert "global batch        16 (= 4 x 4 x 1 x 1 data-parallel)" in panel
    assert "50% below the probed ceiling's peak" in panel
    assert "1f1b needs at least as many micro-batches" in render(skipped_table(report), 120)


def test_the_sweeps_frame_is_ranked_as_its_table_with_si_units_a_column_per_stage_and_nan_for_missing():
    import math

    report = sweep_report()
    frame = report.to_frame()
    assert list(frame["schedule"]) == ["1f1b", "gpipe", "gpipe"]
    assert list(frame["rank"][:2]) == [1, 2] and frame["pareto"].tolist() == [True, False, False]
    assert frame.iloc[0]["peak_memory_bytes_max"] == 250 * 2**20
    best = report.results[report.ranking[0]]
    for stage, peak in enumerate(best.peak_memory_bytes):
        assert frame.iloc[0][f"peak_memory_bytes_stage{stage}"] == peak
    assert "peak_memory_bytes" not in frame.columns and "bubble_measured" not in frame.columns
    assert frame.iloc[0]["bubble_theoretical_pct"] == pytest.approx(100 * best.bubble_theoretical)
    for column in ("mfu_pct", "tokens_per_s", "allreduce_s", "lr", "samples_per_s_ci_half_pct"):
        assert frame[column].dtype == float, column
    assert math.isnan(frame.iloc[0]["allreduce_s"])
    # Every column is a number, a flag or text: arithmetic on a figure never meets a list.
    assert not any(isinstance(v, list | tuple) for column in frame.columns for v in frame[column])
