"""check.compare: the verdict and its cause from gradients alone (no processes)."""

from __future__ import annotations

import numpy as np

from mbtune.checking.config import CheckConfig
from mbtune.checking.run import FAIL, PASS, VARYING_MEAN, compare

CONFIG = CheckConfig(workload="mlp", device="cpu", schedule="gpipe", num_ranks=2, num_micro_batches=2)
GRADS = {"0.weight": np.array([[1.0, -2.0]]), "0.bias": np.array([0.5]), "1.weight": np.array([[3.0]])}


def _plain(grads=GRADS, summed=GRADS, loss=1.0):
    return {"loss": loss, "grads": grads, "summed_grads": summed}


def test_equal_gradients_pass_and_differences_within_the_tolerance_pass():
    assert compare(CONFIG, GRADS, 1.0, _plain()).status == PASS
    nudged = {**GRADS, "1.weight": GRADS["1.weight"] * (1 + 1e-6)}
    assert compare(CONFIG, nudged, 1.0, _plain()).status == PASS


def test_a_block_beyond_the_tolerance_fails_and_is_named():
    wrong = {**GRADS, "1.weight": GRADS["1.weight"] * 1.01}
    result = compare(CONFIG, wrong, 1.0, _plain())
    assert result.status == FAIL and [b.block for b in result.blocks if not b.ok] == [1]
    assert result.cause and result.cause != VARYING_MEAN


def test_a_pipeline_that_matches_the_per_micro_batch_mean_is_the_varying_count_trap():
    pipelined = {**GRADS, "0.weight": GRADS["0.weight"] * 1.3}
    result = compare(CONFIG, pipelined, 1.1, _plain(summed=pipelined))
    assert result.status == FAIL and result.cause == VARYING_MEAN and "one count" in result.hint


def test_a_parameter_only_one_side_has_fails():
    result = compare(CONFIG, {k: v for k, v in GRADS.items() if k != "0.bias"}, 1.0, _plain())
    assert result.status == FAIL and "0.bias" in result.cause
