"""The planner: stage costs from block costs, link and data-parallel costs, memory against the ceiling,
ranking and the recommendation."""

from __future__ import annotations

import pytest

from mbtune.pipeline.point import SweepPoint
from mbtune.planning.planner import (
    Link,
    PlanGrid,
    deepen,
    grid_points,
    plan,
    predict,
    stage_costs,
    with_scatter,
)
from mbtune.planning.records import SCATTER_MEASURED, SCATTER_NONE, BlockCost, BlockFacts, CostModel, LinearCost, Spread

FORWARD_PER_SAMPLE_S = 1e-3  # per block
PARAMETERS = 1000  # per block
SAVED_BYTES = 100  # per block and sample


def model(num_blocks: int = 8, **changes) -> CostModel:
    forward = LinearCost(per_sample_s=FORWARD_PER_SAMPLE_S)
    cost = BlockCost(forward=forward, backward=forward.scaled(2), backward_input=forward, backward_weight=forward)
    facts = BlockFacts.uniform(num_blocks, parameters=PARAMETERS, output_bytes_per_sample=1000,
                               saved_bytes_per_sample=SAVED_BYTES)
    base = {"workload": "w", "blocks": (cost,) * num_blocks, "facts": facts, "loss": LinearCost(),
            "transfer": LinearCost(), "base_bytes": 1000.0, "state_bytes_per_parameter": 16.0}
    return CostModel(**{**base, **changes})


def point(schedule: str = "gpipe", p: int = 4, m: int = 8, mbs: int = 2, v: int = 1, dp: int = 1) -> SweepPoint:
    return SweepPoint(schedule=schedule, num_ranks=p, num_micro_batches=m, grad_accum_steps=1, micro_batch_size=mbs,
                      stages_per_rank=v, data_parallel_size=dp)


def test_stage_cost_is_the_sum_of_its_blocks() -> None:
    costs = stage_costs(model(), ((0, 1, 2), (3,)), micro_batch_size=4)
    assert costs[0].forward_s == pytest.approx(3 * 4e-3) and costs[1].forward_s == pytest.approx(4e-3)
    assert costs[0].backward_s == pytest.approx(2 * 3 * 4e-3)


def test_prediction_of_the_textbook_case() -> None:
    p, m, mbs = 4, 8, 2
    prediction = predict(model(), point(p=p, m=m, mbs=mbs))
    stage_f = 2 * FORWARD_PER_SAMPLE_S * mbs  # 8 blocks over 4 stages
    assert prediction.blocks_per_stage == (2, 2, 2, 2)
    assert prediction.pipeline_s == pytest.approx((m + p - 1) * 3 * stage_f)
    assert prediction.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert prediction.samples_per_s == pytest.approx(m * mbs / prediction.step_time_s)
    # GPipe holds every micro-batch's activations on every stage until its backward.
    assert prediction.peak_in_flight == (m,) * p
    assert prediction.stage_memory_bytes == pytest.approx((16 * 2 * PARAMETERS + m * mbs * 2 * SAVED_BYTES,) * p)
    assert prediction.memory_bytes == pytest.approx((1000 + 16 * 2 * PARAMETERS + m * mbs * 2 * SAVED_BYTES,) * p)
    looped = predict(model(), point("interleaved-1f1b", p=2, m=m, mbs=mbs, v=2))  # two stages on each rank
    assert looped.memory_bytes[0] == pytest.approx(1000 + looped.stage_memory_bytes[0] + looped.stage_memory_bytes[2])
    assert predict(model(), point("1f1b", p=p, m=m, mbs=mbs)).peak_in_flight == (4, 3, 2, 1)


def test_link_and_data_parallel_costs() -> None:
    p, m, mbs, latency, bandwidth = 4, 8, 2, 1e-3, 1e6
    base = predict(model(), point(p=p, m=m, mbs=mbs))
    linked = predict(model(), point(p=p, m=m, mbs=mbs), link=Link(bandwidth_bytes_per_s=bandwidth, latency_s=latency))
    hand_over = latency + 1000 * mbs / bandwidth
    assert linked.pipeline_s - base.pipeline_s == pytest.approx(2 * (p - 1) * hand_over)
    replicated = predict(model(), point(p=p, m=m, mbs=mbs, dp=8), link=Link(bandwidth_bytes_per_s=bandwidth,
                                                                          latency_s=latency))
    gradients = 2 * PARAMETERS * 4  # two blocks per rank, fp32
    assert replicated.allreduce_s == pytest.approx(2 * 7 / 8 * gradients / bandwidth + 2 * 7 * latency)
    assert replicated.point.global_batch == 8 * m * mbs
    assert replicated.samples_per_s == pytest.approx(replicated.point.global_batch / replicated.step_time_s)


def test_update_charges_the_busiest_rank_parameters() -> None:
    prediction = predict(model(update_per_parameter_s=1e-6), point(p=2))
    assert prediction.update_s == pytest.approx(4 * PARAMETERS * 1e-6)


def test_plan_ranks_fitting_points_first_and_recommends_the_fastest_that_fits() -> None:
    grid = PlanGrid(num_ranks=4, micro_batches=(4, 8, 16), schedules=("gpipe", "1f1b"), micro_batch_size=2)
    unlimited = plan(model(), grid)
    assert unlimited.recommended == 0 and all(p.fits is None for p in unlimited.predictions)
    rates = [p.samples_per_s for p in unlimited.predictions]
    assert rates == sorted(rates, reverse=True)
    # GPipe at m=16 holds 16 micro-batches, 1F1B at most 4: a limit between them rules GPipe's deep points out.
    limit = 1000 + 16 * 2 * PARAMETERS + 8 * 2 * 2 * SAVED_BYTES
    limited = plan(model(), grid, memory_limit_bytes=limit, memory_limit_source="test ceiling")
    fits = [p.fits for p in limited.predictions]
    assert fits == sorted(fits, reverse=True)  # True before False
    best = limited.best
    assert best is not None and best.fits and best.max_memory_bytes <= limit
    assert all(p.samples_per_s <= best.samples_per_s for p in limited.predictions if p.fits)
    assert {(p.point.schedule, p.point.num_micro_batches) for p in limited.predictions if not p.fits} == {("gpipe", 16)}
    assert limited.memory_limit_source == "test ceiling"


def test_nothing_fits_means_no_recommendation() -> None:
    grid = PlanGrid(num_ranks=2, micro_batches=(4,), schedules=("gpipe",), micro_batch_size=2)
    report = plan(model(), grid, memory_limit_bytes=10.0)
    assert report.recommended is None and report.best is None and report.predictions[0].fits is False


def test_points_that_cannot_run_are_skipped_with_the_reason() -> None:
    grid = PlanGrid(num_ranks=16, micro_batches=(8, 16), schedules=("1f1b", "interleaved-1f1b"), global_batch=40)
    points, skipped = grid_points(grid, num_blocks=20)
    assert points == []
    reasons = [s.reason for s in skipped]
    assert any("1f1b needs at least as many micro-batches as stages (16), got 8" in r for r in reasons)
    assert any("global batch 40 does not divide into 16 micro-batches" in r for r in reasons)
    assert any("too few for 32 stages" in r and "--blocks" in r for r in reasons)


def test_a_deeper_model_repeats_the_interior_blocks() -> None:
    edge = BlockCost(forward=LinearCost(per_sample_s=5.0), backward=LinearCost(), backward_input=LinearCost(),
                     backward_weight=LinearCost())
    shallow = model(4)
    shallow = CostModel(**{**shallow.__dict__, "blocks": (edge, *shallow.blocks[1:3], edge)})
    deep = deepen(shallow, 10)
    assert deep.facts.num_blocks == 10 and len(deep.blocks) == 10
    assert deep.blocks[0] == edge and deep.blocks[-1] == edge and deep.blocks[5] == shallow.blocks[1]
    assert deep.facts.parameters == (PARAMETERS,) * 10
    report = plan(shallow, PlanGrid(num_ranks=8, micro_batches=(8,), schedules=("1f1b",), micro_batch_size=1,
                                    num_blocks=10))
    assert report.num_blocks == 10 and report.predictions[0].blocks_per_stage == (2, 2, 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="need at least 3"):
        deepen(model(2), 10)


def test_warnings_say_what_was_not_charged_or_checked() -> None:
    grid = PlanGrid(num_ranks=2, micro_batches=(4,), schedules=("gpipe",), micro_batch_size=2, data_parallel_size=4)
    warnings = plan(model(), grid).warnings
    assert any("all-reduce taken as free" in w for w in warnings)
    assert any("not checked" in w for w in warnings)


def test_a_point_is_predicted_the_same_whatever_else_is_listed() -> None:
    """The model a point is predicted with depends only on that point: gpipe at 8 ranks gets 8 blocks whether
    or not an interleaved schedule (which needs 16) is listed beside it. Same model, same seeds: equal."""
    scattered = model(4, spread=Spread(compute=(0.5, 1.0, 2.5), gap=(1.0,), transfer=(1.0,)))
    alone = plan(scattered, PlanGrid(num_ranks=8, micro_batches=(16,), schedules=("gpipe",), micro_batch_size=2))
    listed = plan(scattered, PlanGrid(num_ranks=8, micro_batches=(16,), schedules=("gpipe", "interleaved-1f1b"),
                                      micro_batch_size=2))
    gpipe = [p for p in listed.predictions if p.point.schedule == "gpipe"]
    assert gpipe == list(alone.predictions) and gpipe[0].num_blocks == 8
    interleaved = next(p for p in listed.predictions if p.point.schedule == "interleaved-1f1b")
    assert interleaved.num_blocks == 16
    assert alone.num_blocks == listed.num_blocks == 4  # the model's own depth; rows say theirs
    assert any("interleaved-1f1b as 16 blocks" in w and "--blocks" in w for w in listed.warnings)
    chosen = plan(scattered, PlanGrid(num_ranks=8, micro_batches=(16,), schedules=("gpipe", "interleaved-1f1b"),
                                      micro_batch_size=2, num_blocks=16))
    assert {p.num_blocks for p in chosen.predictions} == {16}  # --blocks: one depth for every point


def test_without_scatter_predictions_use_the_average_costs() -> None:
    p, m, mbs = 4, 8, 2
    scattered = model(spread=Spread(compute=(0.5, 1.0, 3.0)))
    grid = PlanGrid(num_ranks=p, micro_batches=(m,), schedules=("gpipe",), micro_batch_size=mbs)
    average = plan(scattered, grid, scatter=SCATTER_NONE)
    [prediction] = average.predictions
    stage_f = 2 * FORWARD_PER_SAMPLE_S * mbs
    assert prediction.pipeline_s == pytest.approx((m + p - 1) * 3 * stage_f)  # the textbook step, scatter-free
    assert prediction == predict(model(), point(p=p, m=m, mbs=mbs))
    assert average == plan(scattered, grid, scatter=SCATTER_NONE)  # deterministic
    assert average.scatter == SCATTER_NONE and not average.model.spread.known
    drawn = plan(scattered, grid)
    assert drawn.scatter == SCATTER_MEASURED and drawn.predictions[0].pipeline_s != prediction.pipeline_s
    assert with_scatter(scattered, SCATTER_MEASURED) is scattered
    with pytest.raises(ValueError, match="unknown scatter mode"):
        plan(scattered, grid, scatter="sometimes")


def test_without_per_sample_memory_a_rank_holds_its_base_and_parameter_state() -> None:
    grid = PlanGrid(num_ranks=4, micro_batches=(8,), schedules=("gpipe",), micro_batch_size=2)
    report = plan(model(), grid, per_sample_memory=False)
    assert not report.per_sample_memory and report.model.facts.saved_bytes_per_sample == ()
    assert report.predictions[0].memory_bytes == pytest.approx((1000 + 16 * 2 * PARAMETERS,) * 4)
