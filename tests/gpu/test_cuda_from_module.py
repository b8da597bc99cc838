"""A model split by mbtune (Workload.from_module) on a GPU: the trace ran on the meta device, so the device
the graphs use comes from their inputs; the blocks compute the model's loss there, and a probe trial of it
trains (marked gpu; skipped with a reason where no CUDA device is visible)."""

from __future__ import annotations

import pytest
import torch

from mbtune.probing.config import TrialConfig
from mbtune.probing.trial import run_trial
from mbtune.workloads import load_workload

pytestmark = pytest.mark.gpu

GPT = (("n_layer", 2), ("n_embd", 64), ("n_head", 2), ("block_size", 32), ("vocab_size", 128))


def test_the_blocks_compute_the_models_loss_on_the_gpu():
    workload = load_workload("examples.nanogpt.workload:gpt", GPT)
    inputs, targets = workload.make_batch(4, torch.Generator().manual_seed(0))
    on_cpu = workload.loss(workload.build(seed=0)(inputs), targets)
    chain = workload.build(seed=0).to("cuda:0")
    on_gpu = workload.loss(chain(inputs.to("cuda:0")), targets.to("cuda:0"))
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-3, atol=1e-4)  # TF32 matmuls on the GPU


def test_a_probe_trial_of_a_model_as_written_trains_on_the_gpu():
    outcome = run_trial(TrialConfig(workload="examples.nanogpt.workload:gpt", workload_options=GPT,
                                    device="cuda:0", batch_size=8), timeout_s=300)
    assert outcome.status == "ok", outcome.error
    assert outcome.peak_memory_bytes > 0
