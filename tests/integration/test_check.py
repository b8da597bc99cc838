"""`mbtune check`: the real pipeline's update against the plain model's, on the same samples and seed."""

from __future__ import annotations

import json

import pytest

from mbtune.checking.config import CheckConfig
from mbtune.checking.run import PASS, VARYING_MEAN, check_update
from mbtune.pipeline.theory import SCHEDULE_NAMES
from tests.unit.test_cli import mbtune

pytestmark = pytest.mark.integration

MLP = (("layers", 2), ("width", 32))
GPT = (("layers", 2), ("d_model", 32), ("heads", 2), ("seq_len", 8), ("vocab", 64))


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize(("workload", "options", "num_blocks"), [("mlp", MLP, 4), ("gpt", GPT, 4)])
def test_check_passes_where_the_pipeline_is_right(workload, options, num_blocks, schedule):
    result = check_update(CheckConfig(workload=workload, workload_options=options, device="cpu", schedule=schedule,
                                      num_ranks=2, num_micro_batches=4, grad_accum_steps=2, micro_batch_size=2))
    assert result.status == PASS, (result.cause, result.blocks)
    assert len(result.blocks) == num_blocks and all(b.ok for b in result.blocks) and not result.cause


def test_data_parallel_replicas_all_reduce_to_the_plain_models_gradients():
    # Each replica sees half of every step's samples: only the all-reduce makes the gradients whole.
    result = check_update(CheckConfig(workload="gpt", workload_options=GPT, device="cpu", schedule="1f1b",
                                      num_ranks=2, num_micro_batches=2, grad_accum_steps=2, data_parallel_size=2,
                                      global_batch=16))
    assert result.point.micro_batch_size == 2 and result.point.data_parallel_size == 2
    assert result.status == PASS, (result.cause, result.blocks)
    assert abs(result.loss_pipeline - result.loss_plain) <= 1e-4 * abs(result.loss_plain)


def test_check_passes_on_gpt_with_accumulation():
    result = check_update(CheckConfig(workload="gpt", workload_options=GPT, device="cpu", schedule="1f1b",
                                      num_ranks=2, num_micro_batches=2, grad_accum_steps=2, global_batch=8))
    assert result.status == PASS and result.point.micro_batch_size == 2, (result.cause, result.blocks)


def test_a_loss_averaged_over_a_varying_count_fails_and_says_how_to_fix_it():
    result = mbtune("check", "-w", "tests.fixtures.workloads:masked_mean", "-d", "cpu", "--stages", "2",
                    "--schedule", "1f1b", "-m", "4", "--micro-batch-size", "2", "--format", "json")
    assert result.returncode == 1, result.stderr
    found = json.loads(result.stdout)
    assert found["status"] == "FAIL" and found["cause"] == VARYING_MEAN
    assert "one count for the whole global batch" in found["hint"]
    assert max(b["max_rel_diff"] for b in found["blocks"]) > 0.01  # far beyond fp32's tolerance
