"""The simulator against real CPU pipelines: it follows the orders the ranks really ran, and its calibrated
predictions stay near the measured step times; plans, pictures and traces come out of a real sweep.

The bound. The target is a median error within 10% on a quiet machine, and this sweep usually lands there
(in-sample medians of 4-13% in six of eight runs while writing this). But the test machine is a shared
two-core VM: the same point measured in two sweeps a few minutes apart differed by a median of 7-33%, and
the two runs taken while another test suite ran beside them had median errors of 20% and 21% in-sample
(24% and 25% leave-one-out). The bounds below sit above that, so the test fails on a broken simulator or
calibration (errors of 50% and more: a wrong order, a lost transfer, costs off by a stage), not on a busy
neighbour. The structural checks (orders, monotone trends) do not depend on the machine at all.
"""

from __future__ import annotations

import json

import pytest

from mbtune.config import SweepConfig
from mbtune.jobs import sweep_workload
from mbtune.plan.api import (
    block_facts,
    calibrate_results,
    plan_from_profile,
    recommended_timeline,
    validate_results,
)
from mbtune.plan.calibrate import point_orders
from mbtune.plan.planner import predict
from mbtune.records import Metadata, Profile, SweepReport
from mbtune.report.plots import write_plan_plots, write_plots
from mbtune.report.trace import write_trace

pytestmark = pytest.mark.integration

OPTIONS = (("layers", 4), ("width", 512))
IN_SAMPLE_MEDIAN_BOUND = 0.30
LEAVE_ONE_OUT_MEDIAN_BOUND = 0.40


def sweep(schedules: tuple[str, ...], micro_batches: tuple[int, ...]) -> SweepReport:
    config = SweepConfig(workload="mlp", workload_options=OPTIONS, device="cpu", num_stages=2, schedules=schedules,
                         micro_batches=micro_batches, accum_steps=(1,), micro_batch_size=32, measured_steps=3,
                         threads=1)
    report = sweep_workload(config)
    assert all(r.ok for r in report.results), [r.error for r in report.results]
    return report


@pytest.fixture(scope="module")
def fill_drain() -> SweepReport:
    return sweep(("gpipe", "1f1b"), (2, 4, 8))


@pytest.fixture(scope="module")
def looped() -> SweepReport:
    return sweep(("interleaved-1f1b", "zero-bubble"), (4,))


def assert_ranks_ran_the_simulated_order(report: SweepReport) -> None:
    for result in report.results:
        for rank, order in enumerate(point_orders(result.point)):
            ran = [(a.stage, a.kind, a.microbatch) for a in sorted(result.timeline, key=lambda a: a.start_s)
                   if a.rank == rank and a.kind != "loss"]
            assert ran == [(a.stage, a.kind, a.microbatch) for a in order], (result.point.label, rank)


def test_ranks_run_exactly_the_orders_the_simulator_follows(fill_drain, looped) -> None:
    assert_ranks_ran_the_simulated_order(fill_drain)
    assert_ranks_ran_the_simulated_order(looped)  # torch's own pipeline_order, split backward included


def test_predicted_step_time_stays_within_the_stated_bound(fill_drain) -> None:
    in_sample = validate_results(fill_drain.results, workload="mlp", workload_options=dict(OPTIONS), method="in-sample")
    held_out = validate_results(fill_drain.results, workload="mlp", workload_options=dict(OPTIONS))
    figures = {v.method: (round(v.median_step_error, 3), round(v.worst_step_error, 3)) for v in (in_sample, held_out)}
    print(f"predicted vs measured step time (median, worst |error|): {figures}")
    assert len(in_sample.rows) == 6
    assert in_sample.median_step_error <= IN_SAMPLE_MEDIAN_BOUND, figures
    assert held_out.median_step_error <= LEAVE_ONE_OUT_MEDIAN_BOUND, figures
    for row in in_sample.rows:
        assert 0.0 <= row.predicted_bubble < 1.0 and row.measured_bubble is not None
    # More micro-batches take longer per step and less of it idles, in the simulator as in the measurement.
    for schedule in ("gpipe", "1f1b"):
        rows = sorted((r for r in in_sample.rows if r.point.schedule == schedule), key=lambda r: r.point.num_microbatches)
        assert [r.predicted_step_s for r in rows] == sorted(r.predicted_step_s for r in rows)
        assert [r.predicted_bubble for r in rows] == sorted((r.predicted_bubble for r in rows), reverse=True)


def test_split_backward_costs_are_measured_from_a_zero_bubble_run(fill_drain, looped) -> None:
    model = calibrate_results(fill_drain.results + looped.results, workload="mlp", workload_options=dict(OPTIONS))
    assert model.split_backward_measured
    zero_bubble = next(r for r in looped.results if r.point.schedule == "zero-bubble")
    predicted = predict(model, zero_bubble.point).step_time_s
    assert 0.5 < predicted / zero_bubble.step_time_median_s < 2.0


def test_plan_pictures_and_trace_from_a_real_profile(fill_drain, tmp_path) -> None:
    metadata = Metadata(mbtune_version="test", torch_version="", python_version="", host="", platform="",
                        command_line="", created_at="")
    profile = Profile(schema_version=1, metadata=metadata, sweep=fill_drain)
    profile = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))  # as saved and loaded
    report = plan_from_profile(profile, num_stages=8, micro_batches=(8, 16, 32), schedules=("gpipe", "1f1b", "zbv"),
                               data_parallel=4, link_bandwidth_bytes_per_s=25e9, link_latency_s=5e-6, num_blocks=24)
    assert report.num_blocks == 24 and report.validation is not None and len(report.validation.rows) == 6
    assert report.best is not None and len(report.predictions) == 9
    assert report.best.samples_per_s == max(p.samples_per_s for p in report.predictions)
    assert report.best.point.global_batch == 32 * report.best.point.num_microbatches * 4
    assert json.loads(json.dumps(report.to_dict()))["num_blocks"] == 24
    facts = block_facts("mlp", OPTIONS)
    assert facts.weight_source == "flops" and facts.output_bytes_per_sample[1] == 512 * 4

    pictures = write_plots(fill_drain, tmp_path / "sweep") + write_plan_plots(
        report, tmp_path / "plan", recommended=recommended_timeline(report))
    assert len(pictures) == 9 and all(p.stat().st_size > 1000 for p in pictures)
    trace = json.loads(write_trace(fill_drain.best, tmp_path / "best.json").read_text())
    tracks = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {(0, 0), (1, 1)}  # one track per stage
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == len(fill_drain.best.timeline)
