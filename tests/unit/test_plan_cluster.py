"""plan --gpus N --global-batch G: every split enumerated, estimated, the best simulated and ranked."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mbtune.errors import ConfigError
from mbtune.pipeline.theory import SCHEDULE_NAMES, check_point
from mbtune.planning.calibrate import point_orders
from mbtune.planning.cluster import ClusterGrid, CostTable, cluster_points, divisors, estimate, plan_cluster, why_slower
from mbtune.planning.config import PlanConfig
from mbtune.planning.hardware import Link
from mbtune.planning.planner import deepen, predict
from mbtune.planning.records import BlockCost, BlockFacts, CostModel, LinearCost

FACTS = BlockFacts(num_blocks=16, parameters=(1000,) * 16, weights=(1.0,) * 16, weight_source="equal",
                   output_bytes_per_sample=(64,) * 16, saved_bytes_per_sample=(100,) * 16)


def _block(per_sample_s: float) -> BlockCost:
    forward = LinearCost(fixed_s=1e-4, per_sample_s=per_sample_s)
    return BlockCost(forward=forward, backward=forward.scaled(2.0), backward_input=forward.scaled(1.0),
                     backward_weight=forward.scaled(1.0))


MODEL = CostModel(workload="synthetic", blocks=(_block(1e-3),) * 16, facts=FACTS, loss=LinearCost(), transfer=LinearCost(),
                  update_per_parameter_s=1e-7,
                  base_bytes=1e6, state_bytes_per_parameter=16.0)


def test_every_split_of_the_gpus_and_the_batch_is_enumerated_once() -> None:
    grid = ClusterGrid(num_gpus=8, global_batch=32, schedules=SCHEDULE_NAMES, recompute=("none", "full"))
    points, left_out = cluster_points(grid, num_blocks=16)
    assert points and len(set(points)) == len(points)
    for point in points:
        assert point.num_ranks * point.data_parallel_size == 8 and point.global_batch == 32
        assert point.num_ranks * point.stages_per_rank <= 16
        assert check_point(point.schedule, point.num_ranks * point.stages_per_rank, point.num_ranks,
                           point.num_micro_batches) is None
    # Counted by brute force: every (p, b, m, a) with p x d = 8, b x m x a x d = 32, per schedule and v.
    expected = 0
    for p in (1, 2, 4, 8):
        d = 8 // p
        for b in divisors(32 // d):
            for m in divisors(32 // d // b):
                for schedule in SCHEDULE_NAMES:
                    vs = (2, 4) if schedule in ("interleaved-1f1b", "looped-bfs", "zero-bubble") else \
                        (2,) if schedule in ("zbv", "dualpipev") else (1,)
                    expected += 2 * sum(p * v <= 16 and check_point(schedule, p * v, p, m) is None for v in vs)
    assert len(points) == expected
    assert left_out > 0  # p=8 with v=4 needs 32 blocks


def test_the_estimate_is_the_simulated_step_where_the_textbook_holds() -> None:
    """Equal stages, free hand-overs and no scatter: a gpipe step is its closed form, which the estimate is."""
    grid = ClusterGrid(num_gpus=8, global_batch=64, schedules=("gpipe", "1f1b"), recompute=("none",))
    table = CostTable(MODEL)
    for point in cluster_points(grid, num_blocks=16)[0]:
        simulated = predict(MODEL, point)
        assert estimate(table, point, None).step_s == pytest.approx(simulated.step_time_s, rel=1e-9), point.label


def test_the_plan_ranks_what_fits_by_throughput_and_says_why_each_lost() -> None:
    grid = ClusterGrid(num_gpus=8, global_batch=64, schedules=SCHEDULE_NAMES, finalists=6)
    limit = 1.2e6
    ranked, skipped, enumerated, simulated = plan_cluster(MODEL, grid, link=Link(bandwidth_bytes_per_s=1e9),
                                                          memory_limit_bytes=limit, tokens_per_sample=None,
                                                          orders_of=point_orders)
    assert not skipped and enumerated > simulated >= len(ranked) >= 6
    assert {p.point.num_ranks for p in ranked} == {1, 2, 4, 8}  # the best of every depth is among them
    fitting = [p for p in ranked if p.fits]
    assert ranked[:len(fitting)] == fitting and all(p.max_memory_bytes <= limit for p in fitting)
    rates = [p.samples_per_s for p in fitting]
    assert rates == sorted(rates, reverse=True)
    assert ranked[0].lost_because == "" and all(p.lost_because for p in ranked[1:])
    assert all(p.lost_because.startswith("does not fit") for p in ranked if p.fits is False)


def test_why_a_runner_up_lost_names_the_part_of_its_step_that_grew_most() -> None:
    point = cluster_points(ClusterGrid(num_gpus=2, global_batch=8, schedules=("gpipe",), recompute=("none",)), 16)[0][0]
    best = predict(MODEL, point)
    idle = replace(best, pipeline_s=best.pipeline_s * 2, bubble=0.5 + best.bubble / 2)
    assert why_slower(idle, best).startswith("bubble +")
    slow_reduce = replace(best, allreduce_s=best.allreduce_s + 1.0, step_time_s=best.step_time_s + 1.0)
    assert why_slower(slow_reduce, best).startswith("all-reduce +1 s a step")
    assert why_slower(best, best) == "ties"
    assert why_slower(replace(best, fits=False), replace(best, fits=True)).startswith("does not fit: rank 0")


def test_a_cluster_plan_needs_a_global_batch_and_a_sane_size() -> None:
    with pytest.raises(ConfigError, match="global batch to split") as info:
        PlanConfig(num_gpus=8)
    assert info.value.field == "global_batch"
    with pytest.raises(ConfigError) as info:
        PlanConfig(num_gpus=0, global_batch=8)
    assert info.value.field == "num_gpus"
    config = PlanConfig(num_gpus=64, global_batch=1024, schedules=SCHEDULE_NAMES, recompute=("none", "full"))
    assert config.cluster_grid().stages_per_rank == (2, 4)
    assert deepen(MODEL, 64).facts.num_blocks == 64


def test_the_all_reduce_crosses_nodes_with_the_share_each_node_reduced_first() -> None:
    from mbtune.planning.hardware import allreduce_s

    params, inside, across = 10**6, 100e9, 10e9
    model = replace(MODEL, allreduce_bytes_per_s=inside)
    flat = allreduce_s(params, 16, Link(bandwidth_bytes_per_s=across), model)
    assert flat == pytest.approx(2 * 15 / 16 * 4 * params / across)
    # 8 GPUs a node, one pipeline rank per replica: 8 replicas reduce in a node, 2 nodes exchange an eighth.
    nodes = allreduce_s(params, 16, Link(bandwidth_bytes_per_s=across, ranks_per_node=8), model, num_ranks=1)
    assert nodes == pytest.approx(2 * 7 / 8 * 4 * params / inside + 2 * 1 / 2 * 4 * params / 8 / across)
    # A pipeline as long as a node: every replica on nodes of its own, all of it across.
    deep = allreduce_s(params, 16, Link(bandwidth_bytes_per_s=across, ranks_per_node=8), model, num_ranks=8)
    assert deep == pytest.approx(flat)
    assert nodes < flat


def test_counting_the_splits_agrees_with_making_them_and_stops_past_the_limit() -> None:
    from mbtune.planning.cluster import count_points

    assert divisors(1) == [1] and divisors(36) == [k for k in range(1, 37) if 36 % k == 0]
    assert divisors(97) == [1, 97]
    for gpus, batch in ((8, 32), (6, 36), (1, 7), (64, 3)):
        grid = ClusterGrid(num_gpus=gpus, global_batch=batch, schedules=SCHEDULE_NAMES)
        assert count_points(grid, 16, limit=10**6) == len(cluster_points(grid, 16)[0])
    big = ClusterGrid(num_gpus=5040, global_batch=8648640, schedules=SCHEDULE_NAMES)
    assert count_points(big, 1024, limit=1000) == 1001
    with pytest.raises(ConfigError, match="no way to split 64 GPUs for global batch 3"):
        PlanConfig(num_gpus=64, global_batch=3, num_blocks=16, schedules=("1f1b",))


def test_a_hierarchical_all_reduce_is_never_slower_than_the_flat_ring() -> None:
    from mbtune.planning.hardware import allreduce_s

    slow_here = replace(MODEL, allreduce_bytes_per_s=5e9)  # the profiled machine's, slower than the link
    link = Link(bandwidth_bytes_per_s=50e9, ranks_per_node=8)
    flat = allreduce_s(10**6, 16, Link(bandwidth_bytes_per_s=50e9), slow_here)
    for ranks in (1, 2, 4, 8):
        assert allreduce_s(10**6, 16, link, slow_here, num_ranks=ranks) <= flat
