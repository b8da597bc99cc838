"""The hand-over contract and tied weights for real: several tensors (a dict, a tuple, a tensor without
gradient, a view, a transposed tensor whose gradient comes back transposed) cross stage boundaries, and a
weight tied across stages trains as one, in every schedule: the pipeline's update is the plain model's."""

from __future__ import annotations

import pytest

from mbtune.checking.config import CheckConfig
from mbtune.checking.run import PASS, check_update
from mbtune.pipeline.theory import SCHEDULE_NAMES, SINGLE, schedule_info
from mbtune.workloads import load_workload

pytestmark = pytest.mark.integration

HANDOVERS, TIED = "tests.fixtures.workloads:handovers", "tests.fixtures.workloads:tied"
TRANSPOSED = "tests.fixtures.workloads:transposed"
EVERY_DTYPE = "tests.fixtures.workloads:every_dtype"


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize("workload", [HANDOVERS, TIED, TRANSPOSED])
def test_several_tensors_and_tied_weights_cross_stages_in_every_schedule(workload, schedule):
    # TRANSPOSED: a transposed tensor crosses forward, and its gradient crosses back transposed.
    result = check_update(CheckConfig(workload=workload, device="cpu", schedule=schedule, num_ranks=2,
                                      num_micro_batches=4, grad_accum_steps=2, micro_batch_size=2))
    assert result.status == PASS, (result.cause, result.blocks)
    assert result.handovers_compared > 0 and not result.handover_difference


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_every_dtype_and_layout_arrives_as_it_was_sent_both_ways_in_every_schedule(schedule):
    # int64, int32, bool, float32, bfloat16, float16, transposed, empty and scalar tensors cross every boundary;
    # the receiving blocks index and compute with them, and check holds each one's bytes to what was sent.
    result = check_update(CheckConfig(workload=EVERY_DTYPE, device="cpu", schedule=schedule, num_ranks=2,
                                      num_micro_batches=4, grad_accum_steps=2, micro_batch_size=2))
    assert result.status == PASS, (result.cause, result.blocks)
    # Per boundary and micro-batch forward (4 micro-batches x 2 accumulation steps): 9 tensors forward, and
    # back the gradients of the 5 that have one (float32, bfloat16, float16, transposed, scalar).
    stages = 2 if schedule_info(schedule).layout == SINGLE else 4  # two virtual stages per rank by default
    assert result.handovers_compared == (stages - 1) * 8 * (9 + 5)
    assert not result.handover_difference


def test_targets_handed_over_with_the_inputs_reach_the_model_own_loss_as_sent():
    # The published minimal GPT computes its loss from targets that cross the stage boundary as int64 tokens:
    # they arrive as sent (before, torch's shape inference ran the loss on an uninitialised buffer).
    result = check_update(CheckConfig(workload="tests.fixtures.workloads:gpt_own_loss", device="cpu",
                                      schedule="1f1b", num_ranks=2, num_micro_batches=4, grad_accum_steps=1,
                                      micro_batch_size=2))
    assert result.status == PASS, (result.cause, result.blocks)
    assert result.handovers_compared == 4 * 2 + 4  # (tokens, hidden) forward, the hidden's gradient back


def test_a_tie_is_one_parameter_in_one_stage_and_counted_once():
    workload = load_workload(TIED, (("width", 16), ("layers", 2)))
    whole = workload.build()
    assert whole[0].weight is whole[3].weight
    assert workload.num_parameters() == sum(p.numel() for p in whole.parameters())  # the tie once
    alone = workload.build([3])  # a stage holding only the head starts from the embedding's value
    assert alone[0].weight.data.equal(whole[0].weight.data)


def test_tied_copies_with_data_parallel_replicas_sum_once_each():
    result = check_update(CheckConfig(workload=TIED, device="cpu", schedule="1f1b", num_ranks=2,
                                      num_micro_batches=2, grad_accum_steps=1, data_parallel_size=2, micro_batch_size=2))
    assert result.status == PASS, (result.cause, result.blocks)
