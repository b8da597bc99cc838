"""The slowdown knob (workloads/slowdown.py): extra arithmetic in proportion to each block's own time, the
model's arithmetic untouched."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from mbtune.errors import WorkloadError
from mbtune.workloads import load_workload
from mbtune.workloads import slowdown as knob


def ticking_clock(monkeypatch) -> list[float]:
    """The knob's clock reads 0, 1, 2, ... seconds; what it would spin is recorded, not spun."""
    ticks = itertools.count()
    monkeypatch.setattr(knob, "_now", lambda _like: float(next(ticks)))
    spun: list[float] = []
    monkeypatch.setattr(knob, "spin", lambda seconds, _like: spun.append(seconds))
    return spun


def test_the_extra_time_is_the_share_of_the_blocks_own_forward_and_backward(monkeypatch):
    spun = ticking_clock(monkeypatch)
    block = knob.slowed(lambda: nn.Linear(4, 4), 0.2)()
    x = torch.randn(2, 4, requires_grad=True)
    block(x).sum().backward()
    # The clock reads 0 at the forward's start, 1 at its end, 2 as the gradient reaches the output and 3 as
    # it leaves the input: one second each way; a fifth of the throughput taken away is a quarter more time.
    assert spun == [0.25, 0.25]


def test_a_block_whose_input_has_no_gradient_spins_twice_its_forwards_share_in_backward(monkeypatch):
    spun = ticking_clock(monkeypatch)
    block = knob.slowed(lambda: nn.Embedding(10, 4), 0.5)()  # half the throughput: as much time again
    block(torch.tensor([[1, 2, 3]])).sum().backward()
    assert spun == [1.0, 2.0]


def test_a_slowed_workload_computes_the_same_loss_and_gradients_under_the_same_names():
    plain = load_workload("mlp", (("layers", 2), ("width", 16)))
    slow = load_workload("mlp", (("layers", 2), ("width", 16), ("slowdown", 0.2)))
    torch.manual_seed(0)
    inputs, targets = plain.make_batch(4, torch.Generator().manual_seed(1))
    results = []
    for workload in (plain, slow):
        torch.manual_seed(0)
        blocks = [build() for build in workload.blocks]
        out = inputs
        for block in blocks:
            out = block(out)
        loss = workload.loss(out, targets)
        loss.backward()
        results.append((loss.item(), {f"{i}.{n}": p.grad.clone() for i, b in enumerate(blocks)
                                      for n, p in b.named_parameters()}))
    assert results[0][0] == results[1][0]
    assert results[0][1].keys() == results[1][1].keys()
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name])


@pytest.mark.parametrize("value", [-0.1, 0.95, 1, 11, "fast"])
def test_a_slowdown_out_of_range_is_refused(value):
    with pytest.raises(WorkloadError, match="slowdown"):
        load_workload("mlp", (("slowdown", value),))
