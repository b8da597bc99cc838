"""On a GPU, a probe trial of an hf: model holds what the user's loop holds (the allocator's peak of each,
under the same per-process memory fraction), and a sweep of the user's own pipelined command runs its ranks
on CUDA with NCCL (marked gpu; skipped where no CUDA device is visible)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mbtune.probing.config import TrialConfig
from mbtune.probing.confirm import FITS, ConfirmConfig, confirm_command
from mbtune.probing.trial import run_classified_trial

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCRIPTS = Path(__file__).parents[1] / "fixtures" / "train_scripts"
LLAMA = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1376,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": False}


def test_a_cuda_trials_peak_is_the_plain_loops(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    trial = run_classified_trial(TrialConfig(workload=f"hf:{tmp_path / 'config.json'}",
                                             workload_options=(("seq_len", 256),), device="cuda:0", batch_size=16,
                                             steps=3, precision="fp32"), 300)
    assert trial.ok and trial.peak_memory_bytes, trial.error
    run = confirm_command(ConfirmConfig(
        command=[sys.executable, str(SCRIPTS / "hf_loop.py"), "--batch-size", "16", "--seq", "256", "--config",
                 str(tmp_path), "--steps", "3", "--device", "cuda"], memory_budget_bytes=8 << 30, runs=1,
        device="cuda:0")).runs[0]
    assert run.outcome == FITS and run.peak_bytes
    assert abs(trial.peak_memory_bytes / run.peak_bytes - 1) < 0.02, (trial.peak_memory_bytes, run.peak_bytes)


def test_a_sweep_of_a_pipelined_cuda_command_measures_each_point() -> None:
    from mbtune.sweeping.config import SweepConfig
    from mbtune.sweeping.run import sweep_workload

    command = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "{stages}",
               str(SCRIPTS / "pipe_loop.py"), "--batch-size", "{batch}", "--micro-batches", "{micro_batches}",
               "--schedule", "{schedule}", "--device", "cuda", "--width", "1024")
    report = sweep_workload(SweepConfig(command=command, device="cuda", num_ranks=1, schedules=("gpipe", "1f1b"),
                                        micro_batches=(4,), grad_accum_steps=(1,), micro_batch_size=(16,), repeats=1,
                                        warmup_steps=2, measured_steps=5))
    assert [r.status for r in report.results] == ["ok", "ok"], [r.error_tail for r in report.results]
    assert all(r.samples_per_s and r.peak_memory_bytes and r.peak_memory_bytes[0] for r in report.results)
