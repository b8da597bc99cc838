"""The hand-over audit's pure parts: a fingerprint equal exactly when two tensors are, and the pairing of what
each boundary sent with what the next stage received (pipeline/handover.py)."""

from __future__ import annotations

import pytest
import torch

from mbtune.pipeline.handover import BACKWARD, FORWARD, RECEIVED, SENT, Crossing, fingerprint, first_difference

KINDS = [torch.arange(6).reshape(2, 3), torch.arange(6, dtype=torch.int32), torch.tensor([True, False]),
         torch.randn(3, 4), torch.randn(3, 4).bfloat16(), torch.randn(3, 4).half(), torch.randn(4, 3).t(),
         torch.zeros(2, 0), torch.tensor(1.5)]


@pytest.mark.parametrize("tensor", KINDS, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}-{t.is_contiguous()}")
def test_a_fingerprint_is_the_tensor_dtype_shape_and_bytes(tensor):
    dtype, shape, digest = fingerprint(tensor)
    assert (dtype, shape) == (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
    assert fingerprint(tensor.contiguous().clone()) == (dtype, shape, digest)  # layout is not value
    if tensor.numel():
        changed = tensor.contiguous().clone()
        changed.view(-1)[0] = ~changed.view(-1)[0] if tensor.dtype == torch.bool else changed.view(-1)[0] + 1
        assert fingerprint(changed)[2] != digest


def _crossing(stage, direction, side, call, position, tensor):
    dtype, shape, digest = fingerprint(tensor)
    return Crossing(stage=stage, direction=direction, side=side, call=call, position=position, dtype=dtype,
                    shape=shape, digest=digest)


def test_every_sent_tensor_that_arrived_as_sent_is_counted_and_none_differs():
    ids, grad = torch.arange(4), torch.ones(2)
    crossings = [_crossing(0, FORWARD, SENT, c, 0, ids + c) for c in range(3)]
    crossings += [_crossing(1, FORWARD, RECEIVED, c, 0, ids + c) for c in range(3)]
    crossings += [_crossing(1, BACKWARD, SENT, c, 1, grad * c) for c in range(3)]
    crossings += [_crossing(0, BACKWARD, RECEIVED, c, 1, grad * c) for c in range(3)]
    assert first_difference(crossings) == (6, "")


def test_the_first_difference_is_named_by_boundary_direction_micro_batch_and_tensor():
    sent = torch.arange(4)
    crossings = [_crossing(0, FORWARD, SENT, 0, 0, sent), _crossing(1, FORWARD, RECEIVED, 0, 0, sent),
                 _crossing(0, FORWARD, SENT, 1, 0, sent), _crossing(1, FORWARD, RECEIVED, 1, 0, sent * 10**12),
                 _crossing(1, FORWARD, SENT, 1, 2, sent), _crossing(2, FORWARD, RECEIVED, 1, 2, sent.int())]
    compared, difference = first_difference(crossings)
    assert compared == 3
    assert difference == ("stage 0 sent int64 (4,) forward to stage 1 (forward 1, tensor 0) and it received "
                          "other values")


def test_a_changed_dtype_is_named_and_a_forward_that_never_arrived_is_a_difference():
    sent = torch.arange(4)
    changed = [_crossing(1, FORWARD, SENT, 0, 2, sent), _crossing(2, FORWARD, RECEIVED, 0, 2, sent.int())]
    assert first_difference(changed)[1].endswith("and it received int32 (4,)")
    lost = [_crossing(0, FORWARD, SENT, 0, 0, sent)]
    assert first_difference(lost) == (0, "stage 0 sent int64 (4,) forward (micro-batch 0, tensor 0) and stage 1 "
                                         "received nothing")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16])
def test_torch_shape_inference_runs_a_stage_on_zeros_not_on_an_uninitialised_buffer(dtype):
    import mbtune.pipeline.schedules  # noqa: F401 - importing it makes the buffers zeros

    utils = pytest.importorskip("torch.distributed.pipelining._utils")
    if not hasattr(utils, "_TensorMeta"):
        pytest.skip("this torch infers shapes without metadata buffers")
    meta = utils._TensorMeta.from_tensor(torch.ones(64, 33, dtype=dtype))
    for _ in range(20):  # memory just freed holds sevens: an uninitialised buffer in its place would too
        junk = torch.full((64, 33), 7, dtype=dtype)
        del junk
        assert not meta.to_tensor("cpu").any()
