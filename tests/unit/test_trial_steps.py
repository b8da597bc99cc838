"""The probe trial's training step: optimizer state exists before the first step."""

from __future__ import annotations

import pytest
import torch

from mbtune.training import _create_optimizer_state, make_optimizer


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_optimizer_state_exists_before_the_first_step_and_grads_are_freed(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = make_optimizer(name, list(model.parameters()), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    _create_optimizer_state(model, optimizer)
    for param, was in zip(model.parameters(), before):
        state = optimizer.state[param]
        moments = ["exp_avg", "exp_avg_sq"] if name == "adamw" else ["momentum_buffer"]
        for moment in moments:
            assert state[moment].shape == param.shape and not state[moment].any()  # zero gradients' moments
        assert param.grad is None  # the zero gradients are not kept
        if name == "sgd":
            assert torch.equal(param, was)  # no weight moved
        else:
            assert torch.allclose(param, was, rtol=1e-3)  # only weight decay's 1 - lr x decay
