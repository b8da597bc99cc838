"""The hand-over contract in one process: how a block's output reaches the next, what a stage sends, and the
errors that name the block at fault."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mbtune.errors import WorkloadError
from mbtune.workloads import Workload
from mbtune.workloads.chain import Chain, StageModule, as_received, handover_keys


class _Pair(nn.Module):
    def forward(self, x):
        return {"b": x * 2, "a": x.detach() + 1}


class _Take(nn.Module):
    def forward(self, a, b):
        return a, b


class _Sum(nn.Module):
    def forward(self, a, b):
        return a + b


def _workload(blocks, ties=()):
    return Workload(name="t", blocks=blocks, make_batch=lambda n, g: (torch.ones(n, 3), torch.zeros(n)),
                    loss=lambda out, y: out.sum(), ties=ties)


def test_a_dict_goes_by_keyword_a_tuple_positionally_and_stages_send_key_order():
    chain = Chain(_Pair(), _Take(), _Sum())
    x = torch.ones(2, 3)
    assert torch.equal(chain(x), x * 2 + x + 1)
    assert handover_keys(_workload([_Pair, _Take, _Sum])) == (("a", "b"), None, None)
    first = StageModule(Chain(_Pair()), in_keys=None, last=False, out_keys=("a", "b"))
    sent = first(x)
    assert torch.equal(sent[0], x + 1) and torch.equal(sent[1], x * 2)  # values in key order
    second = StageModule(Chain(_Take(), _Sum()), in_keys=("a", "b"), last=True)
    assert torch.equal(second(*sent), x * 2 + x + 1)


def test_a_block_that_cannot_take_its_input_or_an_unexpected_dict_is_named():
    with pytest.raises(WorkloadError, match=r"block 2 cannot take block 1's output \(a tensor\)"):
        Chain(_Pair(), _Sum(), _Sum())(torch.ones(2, 3)).sum()
    with pytest.raises(WorkloadError, match="last block returns a dict"):
        StageModule(Chain(_Pair()), in_keys=None, last=True)(torch.ones(2, 3))
    with pytest.raises(WorkloadError, match="trace at batch size 1 saw a tensor or a tuple"):
        StageModule(Chain(_Pair()), in_keys=None, last=False, out_keys=None)(torch.ones(2, 3))


def test_received_hand_overs_keep_whether_they_need_a_gradient():
    x = torch.ones(2, 3, requires_grad=True)
    got = as_received({"needs": x * 2, "mask": torch.ones(2, 3), "ids": torch.arange(3)})
    assert got["needs"].requires_grad and not got["mask"].requires_grad and not got["ids"].requires_grad


def test_ties_are_kept_in_block_order_so_the_first_member_names_the_tensor():
    blocks = [lambda: nn.Linear(3, 3), lambda: nn.Linear(3, 3), lambda: nn.Linear(3, 3)]
    workload = _workload(blocks, ties=[[(2, "weight"), (0, "weight")]])
    assert workload.ties == (((0, "weight"), (2, "weight")),) and workload.tied_copies() == {(2, "weight")}
    whole = workload.build()
    assert whole[0].weight is whole[2].weight and "0.weight" in dict(whole.named_parameters())
    with pytest.raises(WorkloadError, match="must name"):
        _workload(blocks, ties=(((0, "weight"),),))
