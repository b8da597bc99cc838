"""Sweep planning and ranking: pure logic."""

from __future__ import annotations

import pytest

from mbtune.errors import ConfigError
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.timeline import ActionRecord, PipelineOutcome, StageReport
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.grid import default_micro_batch_size, plan_grid
from mbtune.sweeping.measured import median_step, summarize_point
from mbtune.sweeping.ranking import rank_results
from mbtune.sweeping.records import PointResult


def reasons(grid) -> dict[str, str]:
    return {s.point.label: s.reason for s in grid.skipped}


def test_grid_keeps_runnable_points_and_explains_the_rest():
    config = SweepConfig(workload="mlp", num_ranks=4, schedules=("gpipe", "1f1b", "interleaved-1f1b", "zbv"),
                         micro_batches=(2, 4, 9), grad_accum_steps=(1,), micro_batch_size=8)
    grid = plan_grid(config, num_blocks=16)
    ran = {(p.schedule, p.num_micro_batches) for p in grid.points}
    assert ("gpipe", 2) in ran and ("1f1b", 4) in ran and ("zbv", 2) in ran
    why = reasons(grid)
    assert "1f1b needs at least as many micro-batches as stages (4), got 2" in why["1f1b p=4 m=2 accum=1 mbs=8"]
    assert "divide" in why["interleaved-1f1b p=4 m=9 accum=1 mbs=8"]
    assert all(p.global_batch == 8 * p.num_micro_batches for p in grid.points)


def test_more_stages_than_blocks_is_skipped():
    config = SweepConfig(workload="mlp", num_ranks=4, schedules=("interleaved-1f1b",), micro_batches=(4,),
                         grad_accum_steps=(1,), micro_batch_size=1)
    grid = plan_grid(config, num_blocks=6)
    assert not grid.points
    assert "too few for 8 stages" in grid.skipped[0].reason


def test_micro_batch_size_above_safe_batch_is_skipped():
    config = SweepConfig(workload="mlp", num_ranks=2, schedules=("gpipe",), micro_batches=(2,), grad_accum_steps=(1,),
                         micro_batch_size=64, safe_batch=32)
    grid = plan_grid(config, num_blocks=6)
    assert grid.skipped[0].reason == "micro-batch size 64 is above the probed safe batch 32"


def test_global_batch_sets_micro_batch_size_or_skips():
    config = SweepConfig(workload="mlp", num_ranks=2, schedules=("gpipe",), micro_batches=(2, 3, 4),
                         grad_accum_steps=(1, 2), global_batch=16)
    grid = plan_grid(config, num_blocks=6)
    assert {(p.num_micro_batches, p.grad_accum_steps, p.micro_batch_size) for p in grid.points} == {
        (2, 1, 8), (2, 2, 4), (4, 1, 4), (4, 2, 2)}
    assert all(p.global_batch == 16 for p in grid.points)
    assert "global batch 16 does not divide into 3 micro-batches x 1 accumulation steps" in reasons(grid).values()


def test_defaults_derive_from_stages_and_safe_batch():
    config = SweepConfig(workload="mlp", num_ranks=2, safe_batch=100)
    assert config.micro_batch_counts == (2, 4, 8)
    assert default_micro_batch_size(config) == 12
    assert default_micro_batch_size(SweepConfig(workload="mlp")) == 4


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"schedules": ("pipedream",)}, "schedules=.pipedream. is out of range"),
    ({"micro_batch_size": 4, "global_batch": 16}, "both given"),
    ({"grad_accum_steps": (0,)}, "accum"),
    ({"num_ranks": 0}, "num_ranks"),
    ({"objective": "speed"}, "objective"),
])
def test_sweep_config_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SweepConfig(workload="mlp", **kwargs)


def result(rate, memory, bubble=0.2, status="ok") -> PointResult:
    point = SweepPoint(schedule="gpipe", num_ranks=2, num_micro_batches=4, grad_accum_steps=1, micro_batch_size=1)
    return PointResult(point=point, status=status, samples_per_s=rate if status == "ok" else None,
                       peak_memory_bytes=(memory, memory // 2), bubble_measured=bubble)


def test_ranking_by_objective_and_pareto_front():
    results = [result(100, 50), result(200, 80, 0.1), result(150, 40, 0.3), result(90, 90), result(0, 1, status="oom")]
    ranking, pareto = rank_results(results, "throughput")
    assert ranking == (1, 2, 0, 3)
    assert set(pareto) == {1, 2}
    assert rank_results(results, "memory")[0] == (2, 0, 1, 3)
    assert rank_results(results, "bubble")[0][0] == 1


def test_the_timeline_kept_is_the_median_measured_step():
    steps = (0.30, 0.10, 0.20)  # the first step was slow; the median one is the third

    def report(rank: int) -> StageReport:
        actions = tuple(ActionRecord(step=step, accum=0, stage=rank, kind="forward", microbatch=0,
                                     start_s=0.01 * rank, end_s=0.01 * rank + steps[step] / 2)
                        for step in range(len(steps)))
        return StageReport(rank=rank, num_ranks=2, device="cpu", stage_indices=(rank,), block_indices=((rank,),),
                           num_parameters=1, step_times_s=steps, pipeline_times_s=steps, actions=actions)

    point = SweepPoint(schedule="gpipe", num_ranks=2, num_micro_batches=1, grad_accum_steps=1, micro_batch_size=4)
    outcome = PipelineOutcome(status="ok", reports=(report(0), report(1)))
    result = summarize_point(point, outcome, tokens_per_sample=None, flops_per_sample=None, peak_flops_total=None)
    assert result.timeline_step == 2 and result.step_time_median_s == pytest.approx(0.20)
    assert [a.end_s - a.start_s for a in result.timeline] == pytest.approx([0.10, 0.10])
    assert median_step((4.0, 1.0, 3.0, 2.0)) == 3 and median_step(()) == 0


def _measured(steps: tuple[float, ...], *, bubble: float = 0.25) -> PointResult:
    point = SweepPoint(schedule="gpipe", num_ranks=2, num_micro_batches=4, grad_accum_steps=1, micro_batch_size=2)
    median = sorted(steps)[len(steps) // 2]
    return PointResult(point=point, status="ok", step_times_s=steps, step_time_median_s=median,
                       samples_per_s=point.global_batch / median, bubble_measured=bubble, bubble_theoretical=0.2,
                       repeat_step_time_medians_s=(median,), peak_memory_bytes=(100, 50), timeline_step=1)


def test_a_single_run_states_its_spread_over_its_measured_steps():
    steps = (0.30, 0.10, 0.20)
    point = SweepPoint(schedule="gpipe", num_ranks=1, num_micro_batches=1, grad_accum_steps=1, micro_batch_size=4)
    report = StageReport(rank=0, num_ranks=1, device="cpu", stage_indices=(0,), block_indices=((0,),),
                         num_parameters=1, step_times_s=steps, pipeline_times_s=steps,
                         actions=tuple(ActionRecord(step=s, accum=0, stage=0, kind="forward", microbatch=0,
                                                    start_s=0.0, end_s=0.05) for s in range(3)))
    result = summarize_point(point, PipelineOutcome(status="ok", reports=(report,)), tokens_per_sample=None,
                             flops_per_sample=None, peak_flops_total=None)
    assert (result.samples_per_s_min, result.samples_per_s, result.samples_per_s_max) == pytest.approx((4 / 0.3, 20, 40))
    # per step: 1 - 0.05 / wall
    assert (result.bubble_measured_min, result.bubble_measured_max) == pytest.approx((1 - 0.05 / 0.1, 1 - 0.05 / 0.3))


def test_repeats_merge_into_a_median_with_the_range_over_the_repeats():
    from mbtune.sweeping.measured import merge_repeats

    runs = [_measured((0.2, 0.2, 0.2), bubble=0.3), _measured((0.1, 0.1, 0.1), bubble=0.1),
            _measured((0.4, 0.4, 0.4), bubble=0.2)]
    merged = merge_repeats(runs)
    assert merged.num_repeats == 3 and merged.step_times_s == (0.2,) * 3 + (0.1,) * 3 + (0.4,) * 3
    assert merged.repeat_step_time_medians_s == (0.2, 0.1, 0.4)
    assert merged.step_time_median_s == pytest.approx(0.2) and merged.samples_per_s == pytest.approx(40)
    assert (merged.samples_per_s_min, merged.samples_per_s_max) == pytest.approx((20, 80))
    assert (merged.bubble_measured_min, merged.bubble_measured, merged.bubble_measured_max) == pytest.approx((0.1, 0.2, 0.3))
    assert merged.timeline_step == 1  # the typical (median) repeat is the first one: its own step 1
    assert any("across 3 repeats" in w for w in merged.warnings)
    failed = merge_repeats([runs[0], PointResult(point=runs[0].point, status="timeout", error="rank 1 hung")])
    assert failed.status == "timeout" and failed.num_repeats == 2


def test_rows_whose_range_overlaps_the_best_are_tied_with_it():
    from dataclasses import replace

    from mbtune.sweeping.ranking import tied_with_best

    results = [replace(result(100, 50), samples_per_s_min=90, samples_per_s_max=110),
               replace(result(95, 50), samples_per_s_min=80, samples_per_s_max=92),  # overlaps [90, 110]
               replace(result(70, 50), samples_per_s_min=60, samples_per_s_max=89)]  # below it
    ranking, _ = rank_results(results, "throughput")
    assert tied_with_best(results, ranking, "throughput") == (1,)
    assert tied_with_best(results, ranking, "memory") == ()


def test_saved_limits_are_read_where_the_file_is_named_and_enter_the_config(tmp_path):
    from dataclasses import replace

    from mbtune.device.describe import describe
    from mbtune.errors import ProfileError
    from mbtune.saving.profiles import save_probe
    from mbtune.saving.session import with_saved_limits
    from tests.unit.test_records import sample_probe

    probe = replace(sample_probe(), device=describe("cpu"))
    path = save_probe(tmp_path, probe, "mbtune probe")
    config = SweepConfig(workload=probe.workload, workload_options=tuple(probe.workload_options.items()), device="cpu")
    assert with_saved_limits(config) == config  # no folder named, no file read
    bounded = with_saved_limits(config, profiles_dir=tmp_path)
    assert (bounded.safe_batch, bounded.ceiling) == (probe.safe_batch, probe.ceiling)
    assert bounded.extra_warnings == (f"micro-batch sizes are bounded by the safe batch {probe.safe_batch} "
                                      f"probed in {path}",)
    assert with_saved_limits(config, from_profile=path).safe_batch == probe.safe_batch
    with pytest.raises(ProfileError, match="probed precision 'fp32', this sweep runs 'bf16'"):
        with_saved_limits(replace(config, precision="bf16"), from_profile=path)


def test_settings_of_which_no_point_can_run_are_bad_input_naming_the_setting():
    from mbtune.sweeping.feasible import refuse_unrunnable

    with pytest.raises(ConfigError) as caught:
        refuse_unrunnable(SweepConfig(num_ranks=9), num_blocks=6)
    assert caught.value.field == "num_ranks" and "blocks (6)" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        refuse_unrunnable(SweepConfig(schedules=("gpipe",), global_batch=(7,), micro_batches=(2, 4),
                                      grad_accum_steps=(1,)), num_blocks=6)
    assert caught.value.field == "global_batch" and "such as 8" in str(caught.value)
    refuse_unrunnable(SweepConfig(num_ranks=2, global_batch=(7, 8), grad_accum_steps=(1,)), num_blocks=6)  # 8 runs


def test_points_skipped_for_what_the_probe_measured_are_not_bad_input():
    from mbtune.sweeping.feasible import refuse_unrunnable

    config = SweepConfig(schedules=("gpipe",), micro_batch_size=(64,), safe_batch=8)
    assert not plan_grid(config, num_blocks=6).points
    refuse_unrunnable(config, num_blocks=6)  # runs, and ends saying why no point could
