"""The workload probe holds what the model holds: on one device a probe trial trains the model as the user
wrote it (from_module, hf:), not the chain of blocks a pipeline splits it into, and drops a step's logits
where the users' loop does (transformers' Trainer, `loss = model(**batch).loss`). Its peak at a size is the
plain loop's and the Trainer's, measured under the same cap (`confirm`), and its ceiling is theirs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mbtune.probing.config import TrialConfig
from mbtune.probing.confirm import FITS, OUT_OF_MEMORY, ConfirmConfig, confirm_command
from mbtune.probing.trial import run_classified_trial

pytestmark = pytest.mark.integration

SCRIPTS = Path(__file__).parents[1] / "fixtures" / "train_scripts"
SEQ = 64
# Small members of the causal families hf: takes, as config.json files users have: no dropout, so a step
# holds the same tensors whichever the seed.
FAMILIES = {
    "llama": {"model_type": "llama", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False},
    "gpt2": {"model_type": "gpt2", "vocab_size": 2048, "n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 128,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "qwen2": {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
}


def _config(tmp_path: Path, family: str) -> Path:
    folder = tmp_path / family
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(FAMILIES[family]))
    return folder / "config.json"


def _peak_in_the_users_loop(config: Path, batch: int, budget: int = 8 << 30, script: str = "hf_loop.py") -> tuple[str, int]:
    run = confirm_command(ConfirmConfig(
        command=[sys.executable, str(SCRIPTS / script), "--batch-size", str(batch), "--seq", str(SEQ), "--config",
                 str(config.parent), "--steps", "3"], memory_budget_bytes=budget, runs=1)).runs[0]
    return run.outcome, run.peak_bytes or 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_trials_peak_is_the_plain_loops_within_1_percent(family: str, tmp_path: Path) -> None:
    config = _config(tmp_path, family)
    trial = run_classified_trial(TrialConfig(workload=f"hf:{config}", workload_options=(("seq_len", SEQ),),
                                             device="cpu", batch_size=24, steps=3), 300)
    assert trial.ok and trial.peak_memory_bytes, trial.error
    outcome, peak = _peak_in_the_users_loop(config, 24)
    assert outcome == FITS
    assert abs(trial.peak_memory_bytes / peak - 1) < 0.01, (trial.peak_memory_bytes, peak)


def test_the_trainers_peak_is_the_trials_too(tmp_path: Path) -> None:
    dims = ["--vocab", "2048", "--hidden", "128", "--intermediate", "344", "--layers", "2", "--heads", "4",
            "--kv-heads", "2", "--seq", str(SEQ)]
    run = confirm_command(ConfirmConfig(
        command=[sys.executable, str(SCRIPTS / "hf_trainer.py"), "--batch-size", "24", *dims, "--max-steps", "3",
                 "--output-dir", str(tmp_path / "out")], memory_budget_bytes=8 << 30, runs=1)).runs[0]
    trial = run_classified_trial(TrialConfig(workload=f"hf:{_config(tmp_path, 'llama')}",
                                             workload_options=(("seq_len", SEQ),), device="cpu", batch_size=24,
                                             steps=3), 300)
    assert run.outcome == FITS and trial.ok
    assert abs(trial.peak_memory_bytes / run.peak_bytes - 1) < 0.01, (trial.peak_memory_bytes, run.peak_bytes)


@pytest.mark.slow
def test_the_probes_ceiling_is_the_plain_loops(tmp_path: Path) -> None:
    from mbtune.probing.config import ProbeConfig
    from mbtune.probing.run import probe_workload

    config = _config(tmp_path, "llama")
    budget = 160 << 20
    found = probe_workload(ProbeConfig(workload=f"hf:{config}", workload_options=(("seq_len", SEQ),), device="cpu",
                                       memory_budget_bytes=budget, granularity=4, resolution=4))
    assert found.first_failing == found.ceiling + 4
    assert _peak_in_the_users_loop(config, found.ceiling, budget)[0] == FITS
    assert _peak_in_the_users_loop(config, found.first_failing, budget)[0] == OUT_OF_MEMORY
