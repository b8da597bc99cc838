"""The training step of trials and ranks: optimizer state exists before the first step, and changes nothing."""

from __future__ import annotations

import pytest
import torch

from mbtune.training import create_optimizer_state, make_optimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_optimizer_state_exists_before_the_first_step_and_grads_are_freed(name):
    model = _model()
    optimizer = make_optimizer(name, list(model.parameters()), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    create_optimizer_state(list(model.parameters()), optimizer)
    for param, was in zip(model.parameters(), before):
        state = optimizer.state[param]
        moments = ["exp_avg", "exp_avg_sq"] if name == "adamw" else ["momentum_buffer"]
        for moment in moments:
            assert state[moment].shape == param.shape and not state[moment].any()  # zero gradients' moments
        assert param.grad is None  # the zero gradients are not kept
        assert torch.equal(param, was)  # no weight moved, weight decay included


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_training_after_the_state_is_created_is_a_fresh_optimizers_bit_for_bit(name):
    fresh, early = _model(), _model()
    fresh_optimizer = make_optimizer(name, list(fresh.parameters()), lr=1e-2)
    early_optimizer = make_optimizer(name, list(early.parameters()), lr=1e-2)
    create_optimizer_state(list(early.parameters()), early_optimizer)
    _train(fresh, fresh_optimizer, 3)
    _train(early, early_optimizer, 3)
    for a, b in zip(fresh.parameters(), early.parameters()):
        assert torch.equal(a, b)


def test_a_module_of_fake_tensors_moves_tensor_by_tensor_with_its_ties():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mbtune.training import on_device

    with FakeTensorMode():
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight  # tied, as a language model's head and embedding
        model.register_buffer("scale", torch.ones(1))
        moved = on_device(model, torch.device("meta"))
    assert {t.device.type for t in [*moved.parameters(), *moved.buffers()]} == {"meta"}
    assert moved[0].weight is moved[1].weight and len(list(moved.parameters())) == 1
