"""Calibration recovers known costs from synthetic timelines (made by the simulator from those costs, with the
ranks' clocks offset as real barriers leave them), and validation reports the errors it should."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mbtune.pipeline.point import SweepPoint
from mbtune.planning.accuracy import IN_SAMPLE, LEAVE_ONE_OUT, summarize, validate
from mbtune.planning.calibrate import calibrate
from mbtune.planning.fit import fit_line, quantiles, trimmed_mean
from mbtune.planning.memory import point_split
from mbtune.planning.planner import predict
from mbtune.planning.records import BlockCost, BlockFacts, CostModel, LinearCost, Spread
from mbtune.records import TimelineAction
from mbtune.sweeping.records import PointResult

FACTS = BlockFacts(num_blocks=4, parameters=(1000, 1000, 1000, 1000), weights=(1.0, 1.0, 1.0, 1.0),
                   weight_source="equal", output_bytes_per_sample=(64, 64, 64, 64),
                   saved_bytes_per_sample=(100, 100, 100, 100))
CLOCK_OFFSET_S = 0.0037  # rank 1 leaves the barrier this much later, so its clock reads less


def block(fixed_s: float, per_sample_s: float) -> BlockCost:
    forward = LinearCost(fixed_s=fixed_s, per_sample_s=per_sample_s)
    return BlockCost(forward=forward, backward=forward.scaled(2.0), backward_input=forward.scaled(0.8),
                     backward_weight=forward.scaled(1.4))


TRUTH = CostModel(
    workload="synthetic", blocks=(block(1e-4, 1e-3), block(2e-4, 2e-3), block(2e-4, 2e-3), block(0.0, 5e-4)),
    facts=FACTS, loss=LinearCost(per_sample_s=2e-5), transfer=LinearCost(fixed_s=4e-4), send_s=3e-4, gap_s=5e-5,
    start_s=8e-4, update_per_parameter_s=2e-6, base_bytes=5e8, state_bytes_per_parameter=16.0,
)


def measured(point: SweepPoint, model: CostModel = TRUTH) -> PointResult:
    """What the runner would report for this point if the world were the model."""
    p = predict(model, point, keep_timeline=True)
    shifted = tuple(replace(a, start_s=a.start_s - CLOCK_OFFSET_S * a.rank, end_s=a.end_s - CLOCK_OFFSET_S * a.rank)
                    for a in p.timeline)
    return PointResult(point=point, status="ok", step_times_s=(p.step_time_s,), step_time_median_s=p.step_time_s,
                       samples_per_s=p.samples_per_s, bubble_measured=p.bubble,
                       peak_memory_bytes=tuple(int(b) for b in p.memory_bytes), timeline=shifted,
                       allreduce_s=p.allreduce_s if point.data_parallel_size > 1 else None)


def points(schedules=("gpipe", "1f1b"), sizes=(4, 8), ms=(2, 4)) -> list[SweepPoint]:
    return [SweepPoint(schedule=s, num_ranks=2, num_micro_batches=m, grad_accum_steps=1, micro_batch_size=b,
                       stages_per_rank=2 if s in ("zero-bubble", "zbv", "interleaved-1f1b") else 1)
            for s in schedules for m in ms for b in sizes]


def assert_cost(found: LinearCost, expected: LinearCost) -> None:
    assert found.fixed_s == pytest.approx(expected.fixed_s, abs=1e-9)
    assert found.per_sample_s == pytest.approx(expected.per_sample_s, rel=1e-6)


def test_recovers_compute_overheads_transfer_update_and_memory() -> None:
    results = [measured(p) for p in points()]
    model = calibrate(results, FACTS, workload="synthetic")
    # gpipe and 1f1b at two stages split the blocks (0, 1) | (2, 3): each block's share follows its weight,
    # so blocks in one stage get the stage mean; the stage sums are exact.
    for stage in point_split(results[0].point, FACTS):
        for kind in ("forward", "backward"):
            assert_cost(_sum(model, stage, kind), _sum(TRUTH, stage, kind))
    assert_cost(model.loss, TRUTH.loss)
    assert model.send_s == pytest.approx(TRUTH.send_s)
    assert model.gap_s == pytest.approx(TRUTH.gap_s)
    assert_cost(model.transfer, TRUTH.transfer)  # the clock offset cancels
    assert model.start_s == pytest.approx(TRUTH.start_s)
    assert model.update_per_parameter_s == pytest.approx(TRUTH.update_per_parameter_s)
    assert model.base_bytes == pytest.approx(TRUTH.base_bytes, rel=1e-6)
    assert model.micro_batch_sizes == (4, 8) and model.num_points == 8
    assert not model.split_backward_measured
    # With no split-backward point, the input and weight parts are half the full backward each.
    assert_cost(model.blocks[0].backward_input, model.blocks[0].backward.scaled(0.5))


def test_the_all_reduce_is_calibrated_from_data_parallel_points_and_kept_out_of_the_update() -> None:
    truth = replace(TRUTH, allreduce_bytes_per_s=2e8)
    replicated = [replace(p, data_parallel_size=2) for p in points(sizes=(4,), ms=(2,))]
    results = [measured(p, truth) for p in points()] + [measured(p, truth) for p in replicated]
    assert all(r.allreduce_s for r in results[-2:])
    model = calibrate(results, FACTS, workload="synthetic")
    assert model.allreduce_points == 2 and model.allreduce_bytes_per_s == pytest.approx(2e8)
    assert model.update_per_parameter_s == pytest.approx(TRUTH.update_per_parameter_s)
    wide = replace(replicated[0], data_parallel_size=4)
    assert predict(model, wide).allreduce_s == pytest.approx(predict(truth, wide).allreduce_s)
    # 2 (d - 1) / d of one rank's fp32 gradients (2000 parameters) at the calibrated bandwidth.
    assert predict(model, wide).allreduce_s == pytest.approx(2 * 3 / 4 * 2000 * 4 / 2e8)
    assert calibrate(results[:-2], FACTS, workload="synthetic").allreduce_bytes_per_s is None


def test_recompute_points_calibrate_the_same_costs_and_predict_more_compute_and_less_memory() -> None:
    recomputed = [replace(p, recompute="full") for p in points()]
    model = calibrate([measured(p) for p in points()] + [measured(p) for p in recomputed], FACTS,
                      workload="synthetic")
    plain_only = calibrate([measured(p) for p in points()], FACTS, workload="synthetic")
    for block in range(FACTS.num_blocks):  # the forward a recomputed backward ran again is taken off it
        assert_cost(model.blocks[block].backward, plain_only.blocks[block].backward)
    point = points()[0]
    plain, full = predict(model, point), predict(model, replace(point, recompute="full"))
    assert full.pipeline_s > plain.pipeline_s
    # Per stage of blocks (0, 1), with 2 micro-batches held of 4 samples: 2 x 4 x (100 + 100) saved bytes
    # without recompute; with it 4 x (2 x 64 (block 1's input) + 100 (one block at a time)).
    assert [p - f for p, f in zip(plain.stage_memory_bytes, full.stage_memory_bytes)] == pytest.approx(
        [2 * 4 * 200 - 4 * (2 * 64 + 100), 2 * 4 * 200 - 4 * (2 * 128 + 100)])


def _sum(model: CostModel, blocks: tuple[int, ...], kind: str) -> LinearCost:
    total = LinearCost()
    for b in blocks:
        total = total.plus(getattr(model.blocks[b], kind))
    return total


def test_a_zero_bubble_point_measures_the_input_and_weight_parts() -> None:
    results = [measured(p) for p in points(schedules=("zero-bubble",), ms=(4,))]
    model = calibrate(results, FACTS, workload="synthetic")
    assert model.split_backward_measured
    for b in range(4):  # four stages of one block each: per-block costs are exact
        assert_cost(model.blocks[b].backward_input, TRUTH.blocks[b].backward_input)
        assert_cost(model.blocks[b].backward_weight, TRUTH.blocks[b].backward_weight)
        assert_cost(model.blocks[b].forward, TRUTH.blocks[b].forward)
    # The gradient a split backward hands back comes from its input part: those hand-overs are found too,
    # so the clock offset can be cancelled and transfer measured.
    assert model.transfer.at(4) > 0 and not any("hand-over" in note for note in model.notes)


def test_one_measured_size_is_taken_as_proportional_and_says_so() -> None:
    results = [measured(p) for p in points(sizes=(8,))]
    model = calibrate(results, FACTS, workload="synthetic")
    stage = point_split(results[0].point, FACTS)[0]
    assert _sum(model, stage, "forward").fixed_s == 0.0
    assert _sum(model, stage, "forward").at(8) == pytest.approx(_sum(TRUTH, stage, "forward").at(8))
    assert any("one micro-batch size measured (8)" in note for note in model.notes)


def test_calibrating_nothing_is_an_error() -> None:
    failed = PointResult(point=points()[0], status="oom")
    with pytest.raises(ValueError, match="no point with a measured timeline"):
        calibrate([failed], FACTS, workload="synthetic")


def test_fit_line_trimmed_mean_and_quantiles() -> None:
    assert quantiles(list(range(100)), count=4) == (12, 37, 62, 87)
    assert quantiles([5.0], count=3) == (5.0, 5.0, 5.0) and quantiles([]) == ()
    assert fit_line({4: 0.5, 8: 0.9}) == LinearCost(fixed_s=pytest.approx(0.1), per_sample_s=pytest.approx(0.1),
                                                    measured=((4, 0.5), (8, 0.9)))
    assert fit_line({4: 0.4}) == LinearCost(per_sample_s=0.1)
    assert fit_line({4: 0.4}, proportional_when_single=False) == LinearCost(fixed_s=0.4)
    flat = fit_line({4: 0.9, 8: 0.5})
    assert flat.fixed_s == pytest.approx(0.7) and flat.per_sample_s == 0.0  # noise: no negative slope


def test_a_cost_follows_what_was_measured_between_the_sizes_and_the_line_beyond() -> None:
    # Per sample 0.1 s at size 4 and 8, 0.2 s at 16 (past the caches): a line cannot follow both; the measured
    # seconds are kept and joined between sizes, and the fitted line carries on beyond them.
    cost = fit_line({4: 0.4, 8: 0.8, 16: 3.2})
    assert cost.at(4) == pytest.approx(0.4) and cost.at(8) == pytest.approx(0.8) and cost.at(16) == pytest.approx(3.2)
    assert cost.at(12) == pytest.approx(2.0)  # halfway between 0.8 and 3.2
    assert cost.at(32) == pytest.approx(cost.fixed_s + cost.per_sample_s * 32)
    both = cost.plus(fit_line({4: 0.1, 16: 0.4}))
    assert both.at(8) == pytest.approx(0.8 + 0.2) and cost.scaled(2.0).at(12) == pytest.approx(4.0)
    assert trimmed_mean([1.0] * 9 + [100.0]) == 1.0
    assert trimmed_mean([2.0, 4.0]) == 3.0


def test_validation_of_a_world_the_model_describes_has_no_error() -> None:
    results = [measured(p) for p in points()]
    for method in (IN_SAMPLE, LEAVE_ONE_OUT):
        check = validate(results, lambda runs: calibrate(runs, FACTS, workload="synthetic"), method=method)
        assert check.method == method and len(check.rows) == 8
        assert check.median_step_error == pytest.approx(0.0, abs=1e-9)
        assert check.worst_bubble_error == pytest.approx(0.0, abs=1e-9)


def test_validation_reports_relative_step_and_absolute_bubble_errors() -> None:
    truth = [measured(p) for p in points(sizes=(8,), ms=(2, 4))]
    slow = replace(truth[0], step_time_median_s=truth[0].step_time_median_s * 1.25, bubble_measured=0.5)
    check = validate([slow, *truth[1:]], lambda runs: calibrate(truth, FACTS, workload="synthetic"), method=IN_SAMPLE)
    assert check.rows[0].step_error == pytest.approx(1 / 1.25 - 1)
    assert check.worst_step_error == pytest.approx(0.2)
    assert check.rows[0].bubble_error == pytest.approx(check.rows[0].predicted_bubble - 0.5)
    assert summarize([], IN_SAMPLE).median_step_error is None


def test_timelines_from_the_runner_have_the_loss_as_its_own_action() -> None:
    timeline = measured(points()[0]).timeline
    assert {a.kind for a in timeline} == {"forward", "backward", "loss"}
    assert all(isinstance(a, TimelineAction) for a in timeline)


def test_timelines_without_scatter_give_a_spread_of_ones() -> None:
    model = calibrate([measured(p) for p in points()], FACTS, workload="synthetic")
    for spread in (model.spread.compute, model.spread.transfer, model.spread.gap):
        assert spread and all(q == pytest.approx(1.0, abs=1e-6) for q in spread)


def test_the_spread_of_measured_actions_is_recovered() -> None:
    """Actions that ran at 0.8x or 1.2x their cost come back as a spread from about 0.8 to about 1.2 (measured
    against a fit to those same scattered actions, so not exactly: the more actions, the closer; over the
    eight smallest points the recovered range moved from 1.65x to 2.06x between draws)."""
    scattered = replace(TRUTH, spread=Spread(compute=(0.8, 1.2)))
    model = calibrate([measured(p, scattered) for p in points(sizes=(4, 8, 16), ms=(2, 4, 8))], FACTS,
                      workload="synthetic")
    compute = model.spread.compute
    assert min(compute) == pytest.approx(0.8, abs=0.1) and max(compute) == pytest.approx(1.2, abs=0.15)
    assert max(compute) / min(compute) == pytest.approx(1.5, abs=0.3)
    assert sorted(compute) == list(compute)
    # Both halves are drawn about equally often, so about half the quantiles are above 1.
    assert 0.3 < sum(q > 1.0 for q in compute) / len(compute) < 0.7


def test_hand_overs_across_nodes_are_calibrated_apart_and_planned_where_the_nodes_meet() -> None:
    from mbtune.planning.planner import Link

    truth = replace(TRUTH, inter_node_transfer=LinearCost(fixed_s=3e-3, per_sample_s=1e-4))
    across = Link(ranks_per_node=2)  # ranks 0-1 on one node, 2-3 on the other: boundary 1 -> 2 crosses
    nodes = ("node 0 (a)", "node 0 (a)", "node 1 (b)", "node 1 (b)")
    four = [SweepPoint(schedule=s, num_ranks=4, num_micro_batches=m, grad_accum_steps=1, micro_batch_size=b)
            for s in ("gpipe", "1f1b") for m in (4, 8) for b in (2, 4)]
    results = []
    for point in four:
        p = predict(truth, point, link=across, keep_timeline=True)
        results.append(PointResult(point=point, status="ok", step_times_s=(p.step_time_s,),
                                   step_time_median_s=p.step_time_s, samples_per_s=p.samples_per_s,
                                   peak_memory_bytes=tuple(int(b) for b in p.memory_bytes), timeline=p.timeline,
                                   rank_nodes=nodes))
    assert results[0].crosses_nodes(1, 2) and not results[0].crosses_nodes(0, 1)
    model = calibrate(results, FACTS, workload="synthetic")
    assert model.inter_node_transfer is not None and model.inter_node_samples > 0
    assert_cost(model.inter_node_transfer, truth.inter_node_transfer)
    # Within a node, what the hand-overs there cost (at four stages read less exactly than at two), not
    # an average with the ones across.
    assert all(abs(model.transfer.at(b) / truth.transfer.at(b) - 1) < 0.3 for b in (2, 4))
    assert any("across nodes" in note for note in model.notes)
    # Planned with the nodes where they were, each step is near the measured one; as if on one node, shorter.
    for point, result in zip(four, results):
        planned = predict(model, point, link=across).step_time_s
        assert planned == pytest.approx(result.step_time_median_s, rel=0.06)
        assert predict(model, point).step_time_s < planned
