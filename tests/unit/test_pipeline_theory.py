"""Pure pipeline logic: block splits, which points can run, stage layouts, bubble formulas, the spec."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys

import pytest

from mbtune.errors import ConfigError
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.split import split_blocks
from mbtune.pipeline.theory import (
    SCHEDULE_NAMES,
    check_point,
    stage_to_rank,
    stages_of_rank,
    stages_per_rank_of,
    theoretical_bubble,
)
from mbtune.pipeline.timeline import ActionRecord, StageReport, bubble_from_reports, idle_shares, measured_bubble

# --- split ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("num_blocks", "num_model_stages", "expected"), [
    (6, 2, ((0, 1, 2), (3, 4, 5))),
    (7, 3, ((0, 1), (2, 3), (4, 5, 6))),
    (5, 5, ((0,), (1,), (2,), (3,), (4,))),
    (3, 1, ((0, 1, 2),)),
])
def test_unweighted_split_is_contiguous_and_even(num_blocks: int, num_model_stages: int, expected: tuple) -> None:
    assert split_blocks(num_blocks, num_model_stages) == expected


@pytest.mark.parametrize(("num_blocks", "num_model_stages"), [(n, s) for n in range(1, 13) for s in range(1, n + 1)])
def test_unweighted_split_sizes_differ_by_at_most_one(num_blocks: int, num_model_stages: int) -> None:
    stages = split_blocks(num_blocks, num_model_stages)
    assert [b for stage in stages for b in stage] == list(range(num_blocks))
    sizes = [len(stage) for stage in stages]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_more_stages_than_blocks_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot split 4 blocks over 5 stages") as info:
        split_blocks(4, 5)
    assert "at most 4 stages" in info.value.one_line()


def test_weighted_split_puts_heavy_ends_alone() -> None:
    assert split_blocks(6, 3, [10, 1, 1, 1, 1, 10]) == ((0,), (1, 2, 3, 4), (5,))
    assert split_blocks(6, 2, [10, 1, 1, 1, 1, 10]) == ((0, 1, 2), (3, 4, 5))


def test_weighted_split_with_all_zero_weights_falls_back_to_counts() -> None:
    assert split_blocks(4, 2, [0, 0, 0, 0]) == ((0, 1), (2, 3))


@pytest.mark.parametrize("weights", [
    [3, 1, 4, 1, 5, 9, 2, 6], [1, 1, 1, 8, 1, 1, 1], [5, 0, 0, 5, 0, 5], [2, 7, 1, 8, 2, 8],
])
@pytest.mark.parametrize("num_model_stages", [2, 3, 4])
def test_weighted_split_has_the_lightest_possible_heaviest_stage(weights: list[int], num_model_stages: int) -> None:
    stages = split_blocks(len(weights), num_model_stages, weights)
    heaviest = max(sum(weights[b] for b in stage) for stage in stages)
    assert heaviest == _brute_force_bottleneck(weights, num_model_stages)
    assert [b for stage in stages for b in stage] == list(range(len(weights)))
    assert all(stage for stage in stages)


def _brute_force_bottleneck(weights: list[int], num_model_stages: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), num_model_stages - 1):
        bounds = (0, *cuts, len(weights))
        worst = max(sum(weights[bounds[i]:bounds[i + 1]]) for i in range(num_model_stages))
        best = worst if best is None else min(best, worst)
    return best


def test_split_rejects_bad_weights() -> None:
    with pytest.raises(ValueError, match="3 block weights for 4 blocks"):
        split_blocks(4, 2, [1, 2, 3])
    with pytest.raises(ValueError, match="non-negative"):
        split_blocks(2, 2, [1, -1])


# --- check_point -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("schedule", "stages", "ranks", "microbatches"), [
    ("gpipe", 2, 2, 1),
    ("1f1b", 4, 4, 4),
    ("1f1b", 4, 4, 9),
    ("interleaved-1f1b", 4, 2, 1),
    ("interleaved-1f1b", 4, 2, 3),  # fewer than two rounds: one round of 3
    ("interleaved-1f1b", 8, 4, 10),  # 2 rounds of 5 (torch's flexible interleaving)
    ("interleaved-1f1b", 6, 2, 6),
    ("looped-bfs", 4, 2, 5),
    ("zero-bubble", 8, 4, 12),
    ("zbv", 4, 2, 1),
    ("zbv", 8, 4, 7),
])
def test_points_that_run(schedule: str, stages: int, ranks: int, microbatches: int) -> None:
    assert check_point(schedule, stages, ranks, microbatches) is None


@pytest.mark.parametrize(("schedule", "stages", "ranks", "microbatches", "reason"), [
    ("pipedream", 2, 2, 2, "unknown schedule 'pipedream'"),
    ("gpipe", 2, 2, 0, "micro-batches must be at least 1"),
    ("gpipe", 4, 2, 4, "gpipe runs one stage per rank, not 2"),
    ("1f1b", 4, 4, 3, r"1f1b needs at least as many micro-batches as stages \(4\), got 3"),
    ("interleaved-1f1b", 4, 2, 5, "groups 5 micro-batches into 2 rounds .* try 4 or 6"),
    ("zero-bubble", 4, 2, 7, "groups 7 micro-batches into 3 rounds .* try 6 or 8"),
    ("interleaved-1f1b", 2, 2, 4, "needs at least two stages per rank"),
    ("looped-bfs", 3, 3, 4, "needs at least two stages per rank"),
    ("zbv", 6, 2, 4, "zbv needs exactly two stages per rank"),
    ("zbv", 2, 2, 4, "zbv needs exactly two stages per rank"),
    ("interleaved-1f1b", 5, 2, 4, "5 stages do not spread evenly over 2 ranks"),
])
def test_points_that_cannot_run_say_why(schedule: str, stages: int, ranks: int, microbatches: int, reason: str) -> None:
    found = check_point(schedule, stages, ranks, microbatches)
    assert found is not None
    assert re.search(reason, found), found


def test_check_point_knows_the_block_count() -> None:
    assert check_point("zbv", 8, 4, 8, num_blocks=6) == (
        "the workload has 6 blocks, too few for 8 stages (one block at least each)"
    )
    assert check_point("zbv", 8, 4, 8, num_blocks=8) is None


# --- layout --------------------------------------------------------------------------------------------------

def test_stages_per_rank() -> None:
    assert [stages_per_rank_of(s) for s in SCHEDULE_NAMES] == [1, 1, 1, 2, 2, 2, 2, 2]
    assert stages_per_rank_of("interleaved-1f1b", 3) == 3
    assert stages_per_rank_of("zbv", 3) == 2
    with pytest.raises(ValueError, match="unknown schedule"):
        stages_per_rank_of("nope")


def test_looped_layout_is_round_robin_and_zbv_is_a_v() -> None:
    assert stage_to_rank("interleaved-1f1b", 3, 6) == (0, 1, 2, 0, 1, 2)
    assert stage_to_rank("zbv", 3, 6) == (0, 1, 2, 2, 1, 0)
    assert stages_of_rank("zbv", 3, 6, 0) == (0, 5)
    assert stages_of_rank("looped-bfs", 2, 6, 1) == (1, 3, 5)


# --- bubble --------------------------------------------------------------------------------------------------

def test_theoretical_bubble_values() -> None:
    assert theoretical_bubble("gpipe", num_ranks=4, num_micro_batches=4) == pytest.approx(3 / 7)
    assert theoretical_bubble("1f1b", num_ranks=4, num_micro_batches=12) == pytest.approx(3 / 15)
    assert theoretical_bubble("interleaved-1f1b", num_ranks=4, num_micro_batches=8) == pytest.approx(3 / 19)
    assert theoretical_bubble("looped-bfs", num_ranks=4, num_micro_batches=8, stages_per_rank=4) == pytest.approx(3 / 35)
    # m < p: each of the v-1 loop-backs waits p - m more slots.
    assert theoretical_bubble("interleaved-1f1b", num_ranks=4, num_micro_batches=2) == pytest.approx(5 / 9)
    assert theoretical_bubble("zero-bubble", num_ranks=4, num_micro_batches=8) == pytest.approx(3 / 51)
    assert theoretical_bubble("zbv", num_ranks=4, num_micro_batches=7) == pytest.approx(3 / 45)
    assert theoretical_bubble("zbv", num_ranks=2, num_micro_batches=1) == pytest.approx(2 / 3)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_one_rank_has_no_bubble_and_more_microbatches_shrink_it(schedule: str) -> None:
    assert theoretical_bubble(schedule, num_ranks=1, num_micro_batches=3) == 0.0
    values = [theoretical_bubble(schedule, num_ranks=4, num_micro_batches=m) for m in (4, 8, 16, 64)]
    assert values == sorted(values, reverse=True)
    assert all(0.0 <= v < 1.0 for v in values)


def test_interleaving_with_one_stage_per_rank_reduces_to_1f1b() -> None:
    assert theoretical_bubble("interleaved-1f1b", num_ranks=4, num_micro_batches=6, stages_per_rank=1) == (
        theoretical_bubble("1f1b", num_ranks=4, num_micro_batches=6)
    )


def test_measured_bubble() -> None:
    assert measured_bubble([1.0, 1.0], 2.0) == pytest.approx(0.5)
    assert measured_bubble([2.0], 2.0) == 0.0
    assert measured_bubble([2.1], 2.0) == 0.0  # clock skew never makes it negative
    with pytest.raises(ValueError):
        measured_bubble([], 1.0)


def test_bubble_from_reports_uses_the_pipeline_part_of_each_step() -> None:
    def report(rank: int, busy: list[tuple[float, float]]) -> StageReport:
        actions = tuple(ActionRecord(step=0, accum=0, stage=rank, kind="forward", microbatch=i, start_s=a, end_s=b)
                        for i, (a, b) in enumerate(busy))
        return StageReport(rank=rank, num_ranks=2, device="cpu", stage_indices=(rank,), block_indices=((rank,),),
                           num_parameters=1, step_times_s=(5.0,), pipeline_times_s=(4.0,), actions=actions)

    reports = [report(0, [(0.0, 1.0), (1.0, 2.0)]), report(1, [(1.0, 3.0)])]
    assert bubble_from_reports(reports) == pytest.approx(1 - 4.0 / 8.0)
    assert bubble_from_reports([]) is None


# --- spec ----------------------------------------------------------------------------------------------------

def test_spec_derives_batch_sizes_and_stage_counts() -> None:
    spec = PipelineSpec(workload="mlp", schedule="interleaved-1f1b", num_ranks=2, stages_per_rank=3,
                        num_micro_batches=4, micro_batch_size=8, grad_accum_steps=2)
    assert (spec.num_model_stages, spec.pipeline_batch_size, spec.global_batch) == (6, 32, 64)


def test_spec_refuses_points_that_cannot_run() -> None:
    with pytest.raises(ConfigError, match="1f1b needs at least as many micro-batches"):
        PipelineSpec(workload="mlp", schedule="1f1b", num_ranks=4, num_micro_batches=2)
    with pytest.raises(ConfigError, match="device='tpu'"):
        PipelineSpec(workload="mlp", device="tpu")
    with pytest.raises(ConfigError, match="unknown schedule"):
        PipelineSpec(workload="mlp", schedule="dualpipe")


def test_planning_modules_do_not_import_torch() -> None:
    code = "import sys, mbtune.pipeline, mbtune.pipeline.launch; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def two_rank_gpipe(*, late_s: float = 0.0, skew_s: float = 0.3, split: bool = False) -> list[StageReport]:
    """GPipe, 2 ranks, 2 micro-batches, forward 1 s, backward 2 s, hand-overs 0.5 s each way. Rank 1 starts its
    first backward `late_s` after it could (its own overhead) and its clock reads `skew_s` behind rank 0's.
    `split`: rank 1's backwards are input parts (which send the gradient), their weight parts (0.5 s each)
    run after both."""
    def act(kind: str, stage: int, mb: int, start: float, end: float, shift: float = 0.0) -> ActionRecord:
        return ActionRecord(step=0, accum=0, stage=stage, kind=kind, microbatch=mb, start_s=start - shift,
                            end_s=end - shift)

    b10 = 3.5 + late_s
    rank0 = (act("forward", 0, 0, 0.0, 1.0), act("forward", 0, 1, 1.0, 2.0),
             act("backward", 0, 0, b10 + 2.5, b10 + 4.5), act("backward", 0, 1, b10 + 4.5, b10 + 6.5))
    backward = "backward_input" if split else "backward"
    weights = (("backward_weight", 1, 0, b10 + 4.0, b10 + 4.5), ("backward_weight", 1, 1, b10 + 4.5, b10 + 5.0))
    rank1 = tuple(act(*a, shift=skew_s) for a in (("forward", 1, 0, 1.5, 2.5), ("forward", 1, 1, 2.5, 3.5),
                                                  (backward, 1, 0, b10, b10 + 2.0),
                                                  (backward, 1, 1, b10 + 2.0, b10 + 4.0),
                                                  *(weights if split else ())))
    wall = b10 + 6.5
    return [StageReport(rank=rank, num_ranks=2, device="cpu", stage_indices=(rank,), block_indices=((rank,),),
                        num_parameters=1, step_times_s=(wall + 0.1,), pipeline_times_s=(wall,), actions=actions)
            for rank, actions in ((0, rank0), (1, rank1))]


@pytest.mark.parametrize("skew_s", [0.0, 0.3, -0.2])
def test_idle_splits_into_schedule_transfer_and_overhead_whatever_the_clock_skew(skew_s: float) -> None:
    # Rank 0 waits 3.5 s for rank 1's backward then 0.5 s for its gradient; rank 1 waits 1 s for rank 0's first
    # forward, 0.5 s for it to arrive, and 2.5 s of drain at the end: 7 s schedule and 1 s transfer of 20.
    shares = idle_shares(two_rank_gpipe(skew_s=skew_s))
    assert (shares.schedule, shares.transfer, shares.overhead) == pytest.approx((7.0 / 20, 1.0 / 20, 0.0), abs=1e-9)
    # 0.2 s of rank 1's own time before a backward that needs nothing remote is overhead, and delays the rest.
    late = idle_shares(two_rank_gpipe(late_s=0.2, skew_s=skew_s))
    assert (late.schedule, late.transfer, late.overhead) == pytest.approx((7.2 / 20.4, 1.0 / 20.4, 0.2 / 20.4))
    reports = two_rank_gpipe(late_s=0.2, skew_s=skew_s)
    assert late.schedule + late.transfer + late.overhead == pytest.approx(bubble_from_reports(reports))
    assert idle_shares([]) is None


@pytest.mark.parametrize("skew_s", [0.0, 0.3])
def test_the_gradient_of_a_split_backward_comes_from_its_input_part(skew_s: float) -> None:
    # As above, with rank 1's weight parts filling 1 s of its drain: rank 0 still waits on rank 1's input parts.
    shares = idle_shares(two_rank_gpipe(skew_s=skew_s, split=True))
    assert (shares.schedule, shares.transfer, shares.overhead) == pytest.approx((6.0 / 20, 1.0 / 20, 0.0), abs=1e-9)
