"""Models as their users wrote them (examples/: a minimal GPT with a tied head and its own loss, a ResNet in
torchvision's style), split by mbtune: the pipelined update is the plain model's, in real pipelines."""

from __future__ import annotations

import pytest

from mbtune.checking.config import CheckConfig
from mbtune.checking.run import BATCH_STATISTICS_FIX, FAIL, PASS, check_update

pytestmark = pytest.mark.integration

GPT = (("n_layer", 2), ("n_embd", 32), ("n_head", 2), ("block_size", 16), ("vocab_size", 64))
RESNET = (("image", 16), ("width", 8))


@pytest.mark.parametrize(("workload", "options", "schedule"), [
    ("examples.nanogpt.workload:gpt", GPT, "1f1b"),  # the tied embedding and head on different ranks
    ("examples.nanogpt.workload:gpt", GPT, "zbv"),  # the backward split in input and weight parts
    ("examples.resnet.workload:resnet", RESNET, "interleaved-1f1b"),  # four stages of residual blocks, two ranks
])
def test_the_pipelined_update_of_a_model_as_written_is_the_plain_models(workload, options, schedule):
    result = check_update(CheckConfig(workload=workload, workload_options=options, device="cpu", schedule=schedule,
                                      num_ranks=2, num_micro_batches=4, grad_accum_steps=2, micro_batch_size=2))
    assert result.status == PASS, (result.cause, result.blocks)


def test_batch_norm_is_named_as_the_cause_not_the_loss():
    # The same ResNet with BatchNorm: each micro-batch has its own statistics, by design of micro-batching.
    result = check_update(CheckConfig(workload="examples.resnet.workload:resnet", device="cpu", schedule="gpipe",
                                      workload_options=(*RESNET, ("norm", "batch")), num_ranks=2,
                                      num_micro_batches=2, micro_batch_size=2))
    assert result.status == FAIL and result.hint == BATCH_STATISTICS_FIX
    assert "batch statistics: 0.bn1, 1.layer1.0.bn1" in result.cause, result.cause
