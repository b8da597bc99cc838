"""The CPU budget's count: live tensor storages, as CUDA's allocator counts them, past the budget an OOM."""

from __future__ import annotations

import pytest
import torch

from mbtune.device.tensor_bytes import BLOCK_BYTES, TensorBytes, block_bytes, paused


def test_sizes_round_up_to_cudas_blocks():
    assert [block_bytes(n) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]


def test_a_storage_counts_once_while_it_lives_and_goes_when_it_does():
    with TensorBytes() as count:
        x = torch.empty(1000, dtype=torch.float32)  # 4000 bytes: 4096 counted
        assert count.live_bytes == 4096
        view = x[10:20].view(5, 2)  # a view: no new storage
        x.add_(1)  # in place: nothing new
        assert count.live_bytes == 4096
        y = x * 2
        assert count.live_bytes == 2 * 4096
        del y
        assert count.live_bytes == 4096
        del x
        assert count.live_bytes == 4096  # the view keeps the storage alive
        del view
        assert count.live_bytes == 0
    assert count.peak_bytes == 2 * 4096


def test_only_the_counted_device_type_counts_and_paused_creates_nothing_counted():
    with TensorBytes(device_type="meta") as count:
        torch.empty(10_000)  # a CPU tensor
        kept = torch.empty(256, device="meta")
        assert count.live_bytes == 1024
        with paused(count):
            also = torch.empty(256, device="meta")
        assert count.live_bytes == 1024 and also.numel() == 256
        del kept
        assert count.live_bytes == 0


def test_past_the_budget_an_operator_raises_torchs_out_of_memory_error_forward_or_backward():
    weight = torch.randn(256, 256, requires_grad=True)  # made before counting: not counted
    inputs = torch.randn(64, 256)
    with TensorBytes(memory_budget_bytes=3 * 64 * 256 * 4) as count:
        hidden = (inputs @ weight).relu()  # 2 activations of 64 KiB: within
        loss = hidden.sum()
        with pytest.raises(torch.OutOfMemoryError, match="can't allocate memory") as raised:
            loss.backward()  # the weight's gradient (256 KiB) goes past it
    assert "memory budget" in str(raised.value) and count.over_budget == str(raised.value)
    assert count.peak_bytes <= count.memory_budget_bytes  # the failed allocation is not a peak it held


def test_the_out_of_memory_error_names_the_bytes_asked_for_and_those_live_and_keeps_them_as_numbers():
    from mbtune.device.oom_figures import oom_figures

    with TensorBytes(memory_budget_bytes=4 * BLOCK_BYTES) as count:
        kept = torch.empty(3 * 128)  # 3 blocks live
        with pytest.raises(torch.OutOfMemoryError) as raised:
            torch.empty(2 * 128)  # 2 more: past 4
    assert kept.numel() == 384
    assert (count.over_budget_requested_bytes, count.over_budget_live_bytes) == (2 * BLOCK_BYTES, 3 * BLOCK_BYTES)
    figures = oom_figures(str(raised.value))
    assert figures is not None and (figures.requested_bytes, figures.live_bytes) == (2 * BLOCK_BYTES, 3 * BLOCK_BYTES)
    assert figures.need_bytes > count.memory_budget_bytes


def test_a_budget_of_exactly_what_is_needed_fits():
    with TensorBytes(memory_budget_bytes=2 * BLOCK_BYTES) as count:
        a = torch.empty(128)
        b = torch.empty(128)
    assert count.peak_bytes == 2 * BLOCK_BYTES and a.numel() + b.numel() == 256


def test_fake_tensors_count_as_real_ones_of_their_device():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), TensorBytes() as count:
        x = torch.empty(1 << 20)
        assert count.live_bytes == 4 << 20
        del x
    assert count.live_bytes == 0 and count.peak_bytes == 4 << 20


def test_the_cublas_workspace_is_torchs_default_or_the_configured_pairs():
    from mbtune.device.cuda import parse_workspace_config, training_workspace_bytes

    assert parse_workspace_config(None, 9) == 32 * 2**20  # Hopper and later: :4096:8
    assert parse_workspace_config(None, 8) == (4096 * 2 + 16 * 8) * 1024
    assert parse_workspace_config(":4096:8", 8) == 32 * 2**20
    assert parse_workspace_config(":16:8:4096:2", 9) == (16 * 8 + 4096 * 2) * 1024
    assert parse_workspace_config("garbage", 9) == 32 * 2**20
    assert training_workspace_bytes("cpu") == 0
