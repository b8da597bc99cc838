"""Learning-rate advice: linear for SGD, square root for AdamW, from the recipe's batch or the smallest."""

from __future__ import annotations

import math

import pytest

from mbtune.errors import ConfigError
from mbtune.probing.config import ProbeConfig, TrialConfig
from mbtune.settings import lr_for
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.lr import LINEAR, SQUARE_ROOT, lr_advice


def test_sgd_scales_linearly_and_adamw_by_the_square_root_from_the_recipe():
    sgd = lr_advice("sgd", [64, 16, 32, 16], lr=0.1, reference_batch=16)
    assert [a.global_batch for a in sgd] == [16, 32, 64]  # one per batch, smallest first
    assert [a.lr for a in sgd] == pytest.approx([0.1, 0.2, 0.4]) and {a.rule for a in sgd} == {LINEAR}
    adam = lr_advice("adamw", [64], lr=3e-4, reference_batch=16)
    assert adam[0].rule == SQUARE_ROOT and adam[0].lr == pytest.approx(3e-4 * 2) and adam[0].scale == 2


def test_without_the_recipe_the_factor_is_from_the_smallest_batch_run():
    advice = lr_advice("adamw", [8, 32])
    assert [(a.reference_batch, a.lr) for a in advice] == [(8, None), (8, None)]
    assert [a.scale for a in advice] == pytest.approx([1.0, math.sqrt(4)])
    assert lr_advice("sgd", []) == ()


def test_the_learning_rate_trained_with_is_the_given_one_or_the_optimizers_default():
    assert lr_for("adamw", None) == 1e-4 and lr_for("sgd", None) == 1e-3 and lr_for("sgd", 0.5) == 0.5
    assert ProbeConfig(workload="mlp", device="cpu", lr=0.02).trial(batch_size=1, device="cpu").lr == 0.02


@pytest.mark.parametrize("lr", [0.0, -1e-3, math.nan, math.inf])
def test_a_learning_rate_that_trains_nothing_is_refused(lr):
    for make in (lambda: TrialConfig(workload="mlp", lr=lr), lambda: SweepConfig(workload="mlp", device="cpu", lr=lr)):
        with pytest.raises(ConfigError, match="lr"):
            make()
    with pytest.raises(ConfigError, match="reference_batch"):
        SweepConfig(workload="mlp", device="cpu", reference_batch=0)
