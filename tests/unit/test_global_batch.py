"""A fixed global batch, split every way the grid allows; the default rule; ranking within a global batch;
the trade-off rows and the cross-batch padding pair."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mbtune.pipeline.point import SweepPoint
from mbtune.sweeping.config import SweepConfig, default_global_batch
from mbtune.sweeping.grid import plan_grid
from mbtune.sweeping.ranking import rank_results, recompute_pairs, tied_with_best, tradeoff
from mbtune.sweeping.records import PointResult


@pytest.mark.parametrize("sizes", [(16,), (12, 48), (64, 7)])
def test_every_point_multiplies_to_its_global_batch_and_the_rest_say_why(sizes):
    config = SweepConfig(workload="mlp", num_ranks=2, schedules=("gpipe", "1f1b"), micro_batches=(2, 3, 4),
                         grad_accum_steps=(1, 2, 3), global_batch=sizes, safe_batch=16)
    grid = plan_grid(config, num_blocks=6)
    made = [p.micro_batch_size * p.num_micro_batches * p.grad_accum_steps * p.data_parallel_size for p in grid.points]
    assert made == [p.global_batch for p in grid.points] and set(made) <= set(sizes)
    assert all(p.micro_batch_size <= 16 for p in grid.points)
    for skipped in grid.skipped:
        assert "does not divide" in skipped.reason or "above the probed safe batch 16" in skipped.reason
    assert len(grid.points) + len(grid.skipped) == len(sizes) * 2 * 3 * 3


@pytest.mark.parametrize(("safe", "counts", "accum", "expected"), [
    (68, (2, 4, 8), (1, 2), 128), (100, (2, 4, 8), (1, 2), 128), (27, (2,), (1,), 32), (1, (1,), (1,), 1)])
def test_the_default_global_batch_is_the_largest_power_of_two_the_smallest_split_holds(safe, counts, accum, expected):
    size = default_global_batch(safe, counts, accum)
    assert size == expected and size & (size - 1) == 0
    assert size // (min(counts) * min(accum)) <= safe < 2 * size // (min(counts) * min(accum))


def test_a_probed_sweep_holds_the_default_global_batch_and_a_fixed_micro_batch_size_lets_it_vary():
    probed = SweepConfig(workload="mlp", num_ranks=2, safe_batch=68)
    assert probed.global_batches == (128,)
    grid = plan_grid(probed, num_blocks=6)
    assert {p.global_batch for p in grid.points} == {128} and grid.points
    fixed = SweepConfig(workload="mlp", num_ranks=2, safe_batch=68, micro_batch_size=4)
    assert fixed.global_batches == () and len({p.global_batch for p in plan_grid(fixed, num_blocks=6).points}) > 1
    assert SweepConfig(workload="mlp", global_batch=32).global_batch == (32,)  # one, as before lists


def _result(m, accum, mbs, rate, *, schedule="1f1b", bubble=0.2, memory=100):
    point = SweepPoint(schedule=schedule, num_ranks=2, num_micro_batches=m, grad_accum_steps=accum,
                       micro_batch_size=mbs)
    return PointResult(point=point, status="ok", samples_per_s=rate, samples_per_s_min=rate, samples_per_s_max=rate,
                       bubble_measured=bubble, peak_memory_bytes=(memory,), step_time_median_s=point.global_batch / rate)


def test_rows_are_ranked_within_their_global_batch_in_the_order_given():
    results = [_result(2, 1, 8, 500.0), _result(2, 1, 32, 900.0), _result(4, 1, 4, 400.0)]  # G 16, 64, 16
    ranking, _ = rank_results(results, "throughput", (16, 64))
    assert ranking == (0, 2, 1)  # 64's faster row comes after every row of 16
    assert rank_results(results, "throughput")[0] == (1, 0, 2)  # without fixed batches: across them
    tied = [_result(2, 1, 8, 500.0), _result(2, 1, 32, 500.0)]
    assert tied_with_best(tied, (0, 1), "throughput", same_global_batch=True) == ()
    assert tied_with_best(tied, (0, 1), "throughput") == (1,)


def test_the_tradeoff_rows_are_the_best_and_its_neighbours_and_padding_is_found():
    results = [_result(4, 1, 8, 900.0, bubble=0.20), _result(2, 2, 8, 700.0, bubble=0.33),
               _result(8, 1, 4, 600.0), _result(2, 1, 16, 650.0), _result(1, 1, 32, 300.0),
               _result(4, 1, 8, 100.0, schedule="gpipe")]
    ranking, _ = rank_results(results, "throughput", (32,))
    assert ranking[0] == 0
    rows, padding = tradeoff(results, ranking)
    assert rows == (2, 0, 3)  # micro-batch sizes 4, 8 (the best), 16: same schedule and global batch
    assert padding == (0, 1)  # 4 x 1 beat 2 x 2 at micro-batch size 8
    assert tradeoff(results[1:2], (0,)) == ((0,), None)
    # A row with recompute or other replicas is another trade-off: never a neighbour of the best.
    other = [replace(results[2], point=replace(results[2].point, recompute="full")),
             replace(results[3], point=replace(results[3].point, data_parallel_size=2, micro_batch_size=8))]
    assert tradeoff([results[0], *other], (0, 1, 2)) == ((0,), None)


def test_data_parallel_points_multiply_to_the_global_batch_and_need_a_rank_each():
    config = SweepConfig(workload="mlp", num_ranks=2, schedules=("1f1b",), micro_batches=(2, 4), grad_accum_steps=(1, 2),
                         data_parallel_size=(1, 2, 3), global_batch=(48,))
    grid = plan_grid(config, num_blocks=6, max_processes=4)
    assert {p.data_parallel_size for p in grid.points} == {1, 2}
    assert all(p.micro_batch_size * p.num_micro_batches * p.grad_accum_steps * p.data_parallel_size == 48
               for p in grid.points)
    too_many = [s for s in grid.skipped if s.point.data_parallel_size == 3]
    assert too_many and all("need 6 GPUs, 4 visible" in s.reason for s in too_many)
    assert SweepConfig(workload="mlp", data_parallel_size=2).data_parallel_size == (2,)  # one, as a flag gives it
    assert default_global_batch(16, (2,), (1,), (2,)) == 64  # the replicas hold their share too


def test_fixed_micro_batch_sizes_each_make_points_whose_global_batch_varies():
    config = SweepConfig(workload="mlp", num_ranks=2, schedules=("gpipe",), micro_batches=(2,), grad_accum_steps=(1,),
                         micro_batch_size=(2, 8))
    grid = plan_grid(config, num_blocks=6)
    assert [(p.micro_batch_size, p.global_batch) for p in grid.points] == [(2, 4), (8, 16)]
    assert config.global_batches == ()


def test_recompute_points_take_the_probes_safe_batch_with_recompute_and_pair_with_their_twins():
    config = SweepConfig(workload="mlp", num_ranks=2, schedules=("gpipe",), micro_batches=(2,), grad_accum_steps=(1,),
                         global_batch=(32, 48), recompute=("none", "full"), safe_batch=16, recompute_safe_batch=24)
    grid = plan_grid(config, num_blocks=6)
    assert [(p.global_batch, p.recompute) for p in grid.points] == [(32, "none"), (32, "full"), (48, "full")]
    [skipped] = grid.skipped
    assert skipped.point.recompute == "none" and "above the probed safe batch 16" in skipped.reason
    results = [PointResult(point=p, status="ok", samples_per_s=1.0) for p in grid.points]
    assert recompute_pairs(results) == ((0, 1),)
    assert SweepConfig(workload="mlp", recompute="full").recompute == ("full",)
