"""Pictures, traces, the terminal timeline and the plan tables, from small hand-made records."""

from __future__ import annotations

import io
import json
import sys

import pytest
from rich.console import Console

from mbtune.errors import ConfigError
from mbtune.pipeline.point import SweepPoint
from mbtune.planning.accuracy import IN_SAMPLE, summarize
from mbtune.planning.planner import PlanGrid, plan
from mbtune.planning.records import PlanReport
from mbtune.records import DeviceInfo, TimelineAction
from mbtune.report.plan import (
    plan_dict,
    predictions_table,
    print_plan,
    validation_table,
)
from mbtune.report.plots import rank_idle_spans, write_plan_plots, write_plots
from mbtune.report.timeline import timeline_renderable, timeline_rows
from mbtune.report.trace import trace_events, write_trace
from mbtune.sweeping.ranking import rank_results
from mbtune.sweeping.records import SweepReport
from tests.unit.test_plan_calibrate import FACTS, TRUTH, measured
from tests.unit.test_plan_planner import model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def render(renderable, width: int = 120) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def action(rank, stage, kind, mb, start, end) -> TimelineAction:
    return TimelineAction(rank=rank, stage=stage, kind=kind, microbatch=mb, accum=0, start_s=start, end_s=end)


# Two ranks, three stages (rank 0 holds stages 0 and 2), times in seconds.
TINY = (action(0, 0, "forward", 0, 0.0, 2.0), action(1, 1, "forward", 0, 2.0, 4.0), action(0, 2, "forward", 0, 4.0, 6.0),
        action(0, 2, "backward_input", 0, 6.0, 8.0), action(1, 1, "backward", 0, 8.0, 10.0),
        action(0, 2, "backward_weight", 0, 8.0, 10.0))


def sweep_report() -> SweepReport:
    points = [SweepPoint(schedule=s, num_ranks=2, num_micro_batches=m, grad_accum_steps=1, micro_batch_size=4)
              for s in ("gpipe", "1f1b") for m in (2, 4)]
    results = tuple(measured(p) for p in points)
    results = tuple(r.__class__(**{**r.__dict__, "bubble_theoretical": 1 / (r.point.num_micro_batches + 1)})
                    for r in results)
    ranking, pareto = rank_results(results, "throughput")
    return SweepReport(workload="synthetic", device=DeviceInfo(backend="cpu", name="Test CPU"), objective="throughput",
                       results=results, ranking=ranking, pareto=pareto, ceiling=40,
                       ceiling_peak_memory_bytes=int(TRUTH.base_bytes * 1.2))


def test_terminal_timeline_rows_show_kinds_idle_and_the_other_stage() -> None:
    rows = timeline_rows(TINY, width=10)
    # Blank: the stage's rank is busy with its other stage; dot: the rank computes nothing.
    assert rows == {0: "FF··      ", 1: "··FF····BB", 2: "  ··FFIIWW"}
    text = render(timeline_renderable(TINY, width=10, title="tiny"))
    assert "stage 2 (rank 0)   ··FFIIWW" in text and "10.00 s" in text
    assert "F forward" in text and "· idle" in text
    assert "no timeline recorded" in render(timeline_renderable(()))


def test_trace_has_one_track_per_stage_and_microsecond_events(tmp_path) -> None:
    path = write_trace(TINY, tmp_path / "sub" / "trace.json", label="tiny")
    document = json.loads(path.read_text())
    events = document["traceEvents"]
    threads = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert sorted((e["pid"], e["tid"], e["args"]["name"]) for e in threads) == [
        (0, 0, "stage 0"), (0, 2, "stage 2"), (1, 1, "stage 1")]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(TINY)
    first = next(e for e in complete if e["tid"] == 1 and e["cat"] == "forward")
    assert (first["ts"], first["dur"], first["pid"]) == (2_000_000.0, 2_000_000.0, 1)
    assert {e["tid"] for e in complete} == {0, 1, 2}
    assert trace_events((), label="x")["traceEvents"] == []


def test_trace_of_a_trial_result(tmp_path) -> None:
    result = measured(SweepPoint(schedule="1f1b", num_ranks=2, num_micro_batches=4, grad_accum_steps=1,
                                 micro_batch_size=4))
    document = json.loads(write_trace(result, tmp_path / "t.json").read_text())
    assert document["otherData"]["label"] == result.point.label
    assert len([e for e in document["traceEvents"] if e["name"] == "thread_name"]) == 2


def test_rank_idle_spans() -> None:
    assert rank_idle_spans(TINY) == {0: [(2.0, 4.0)], 1: [(0.0, 2.0), (4.0, 8.0)]}


def test_sweep_plots_are_png_files(tmp_path) -> None:
    written = write_plots(sweep_report(), tmp_path / "plots")
    assert [p.name for p in written] == ["timeline.png", "throughput.png", "bubble.png", "memory.png"]
    for path in written:
        assert path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_plan_plots_are_png_files(tmp_path) -> None:
    report = plan(model(), PlanGrid(num_ranks=4, micro_batches=(4, 8), schedules=("gpipe", "1f1b"), micro_batch_size=2),
                  memory_limit_bytes=1e6, validation=summarize([], IN_SAMPLE))
    from mbtune.planning.planner import predict

    best = predict(report.model, report.best.point, keep_timeline=True)
    written = write_plan_plots(report, tmp_path, recommended=best)
    assert [p.name for p in written] == ["plan_throughput.png", "plan_bubble.png", "plan_memory.png",
                                         "plan_timeline.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in written)


def test_pictures_without_matplotlib_say_how_to_get_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ConfigError, match="need matplotlib") as info:
        write_plots(sweep_report(), tmp_path)
    assert "pip install matplotlib" in info.value.one_line()


def test_plan_tables_and_json() -> None:
    results = [measured(SweepPoint(schedule="gpipe", num_ranks=2, num_micro_batches=m, grad_accum_steps=1,
                                   micro_batch_size=4)) for m in (2, 4)]
    from mbtune.planning.accuracy import validate
    from mbtune.planning.calibrate import calibrate

    validation = validate(results, lambda runs: calibrate(runs, FACTS, workload="synthetic"), method=IN_SAMPLE)
    text = render(validation_table(validation), 140)
    assert "gpipe p=2 m=2 accum=1 mbs=4" in text and "+0.0%" in text and "median 0.0%" in text
    report = plan(model(), PlanGrid(num_ranks=4, micro_batches=(4, 8), schedules=("gpipe", "1f1b"), micro_batch_size=2),
                  validation=validation)
    table = render(predictions_table(report), 140)
    lines = [line for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert len(lines) == 4 and lines[0].split()[1] in ("gpipe", "1f1b") and "unchecked" in lines[0]
    assert PlanReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report  # lossless, as profiles are
    data = json.loads(json.dumps(plan_dict(report)))
    assert data["summary"]["recommended"] == report.best.point.label
    assert data["summary"]["median_step_error"] == pytest.approx(0.0, abs=1e-9)
    assert data["summary"]["scatter"] == "measured" and data["summary"]["noise_floor_median"] is None
    console = Console(file=io.StringIO(), width=140, color_system=None)
    print_plan(console, report, "table")
    out = console.file.getvalue()
    assert "Recommendation" in out and "Simulator against the measured sweep (in-sample, scatter: measured)" in out
    assert "(scatter: measured)" in out and "no noise floor to compare the error against" in out


def test_the_validation_shows_the_noise_floor_and_the_verdict() -> None:
    from dataclasses import replace

    from mbtune.planning.accuracy import validate
    from mbtune.planning.calibrate import calibrate

    results = [replace(measured(SweepPoint(schedule="gpipe", num_ranks=2, num_micro_batches=m, grad_accum_steps=1,
                                           micro_batch_size=4)), num_repeats=2, repeat_step_time_medians_s=(1.0, 1.1))
               for m in (2, 4)]
    validation = validate(results, lambda runs: calibrate(runs, FACTS, workload="synthetic"), method=IN_SAMPLE,
                          scatter="none")
    text = render(validation_table(validation), 140)
    assert "(in-sample, scatter: none)" in text
    assert "noise floor: median 9.5%, worst 9.5% over 2 point(s), between repeats of the same point" in text
    assert "median error 0.0% is within the noise floor 9.5% (between runs)" in text
    within_run = replace(validation, median_step_error=0.2,
                         noise_floor=replace(validation.noise_floor, kind="within-run", median=0.05))
    text = " ".join(render(validation_table(within_run), 140).split())  # the caption wraps at the table's width
    assert "within one run; sweep with --repeats 2 for the between-run floor" in text
    assert "median error 20.0% is above the noise floor 5.0% (within one run)" in text
    report = plan(model(4), PlanGrid(num_ranks=4, micro_batches=(8,), schedules=("gpipe", "interleaved-1f1b"),
                                     micro_batch_size=2), validation=validation, scatter="none")
    summary = json.loads(json.dumps(plan_dict(report)))["summary"]
    assert summary["scatter"] == "none" and summary["noise_floor_kind"] == "between-run"
    assert summary["noise_floor_median"] == pytest.approx(0.1 / 1.05)
    assert summary["median_step_error_within_noise_floor"] is True
    table = render(predictions_table(report), 140)
    assert "4-8 blocks" in table and "(scatter: none)" in table
    rows = {line.split()[1]: line.split()[2] for line in table.splitlines() if line.strip()[:1].isdigit()}
    assert rows == {"gpipe": "4", "interleaved-1f1b": "8"}  # the blocks column: each row's depth


def test_plan_artifacts_print_the_kept_timeline_and_simulate_nothing(tmp_path, monkeypatch) -> None:
    from dataclasses import replace

    from mbtune.planning import planner
    from mbtune.planning.planner import predict
    from mbtune.report.plan import write_plan_artifacts

    report = plan(model(), PlanGrid(num_ranks=4, micro_batches=(4, 8), schedules=("gpipe",), micro_batch_size=2))
    kept = replace(report, recommended_timeline=predict(report.model, report.best.point, keep_timeline=True).timeline)

    def no_simulation(*args, **kwargs):
        raise AssertionError("report/ ran the simulator")

    monkeypatch.setattr(planner, "simulate_point", no_simulation)
    console = Console(file=io.StringIO(), width=140, color_system=None)
    write_plan_artifacts(console, kept, plot_dir=tmp_path / "plots", trace_path=tmp_path / "plan.json")
    assert (tmp_path / "plots" / "plan_timeline.png").read_bytes()[:8] == PNG_MAGIC
    tracks = {e["tid"] for e in json.loads((tmp_path / "plan.json").read_text())["traceEvents"] if e["ph"] == "X"}
    assert tracks == {0, 1, 2, 3} and "wrote" in console.file.getvalue()
    assert "recommended_timeline" not in plan_dict(kept)  # the trace's data, not the plan's
    write_plan_artifacts(console, report, plot_dir=None, trace_path=tmp_path / "none.json")
    assert "no trace written: the plan kept no simulated timeline" in console.file.getvalue()
    assert not (tmp_path / "none.json").exists()


def test_the_memory_plan_prints_every_stages_peak_and_largest_micro_batch(capsys) -> None:
    from mbtune.planning.memory_plan import NO_LIMIT, MemoryPlan, MemoryPlanRow
    from mbtune.report.plan import print_memory_plan

    rows = (MemoryPlanRow(schedule="1f1b", num_micro_batches=8, recompute="none", micro_batch_size=2, global_batch=16,
                          binding_rank=0, peak_bytes=(2**30, 2**29, 2**28), limits=(2, 5, NO_LIMIT), seconds=1.5),
            MemoryPlanRow(schedule="zbv", num_micro_batches=8, recompute="none", micro_batch_size=0, global_batch=0,
                          binding_rank=None, skipped="zbv takes two stages per rank"))
    plan = MemoryPlan(workload="gpt", workload_options={}, device_memory_bytes=2**31, num_ranks=3,
                      data_parallel_size=1, grad_accum_steps=1, precision="fp32", optimizer="adamw", rows=rows,
                      seconds=2.0)
    console = Console(record=True, width=300, file=io.StringIO())
    print_memory_plan(console, plan, "table")
    text = console.export_text()
    assert "largest micro-batch per stage" in text and "2 5 any" in text and "rank 0" in text
    assert "zbv takes two stages per rank" in text
    print_memory_plan(console, plan, "csv")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(",")[7] == "limits" and lines[1].split(",")[7] == f"2 5 {NO_LIMIT}"
