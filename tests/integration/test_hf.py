"""Hugging Face transformers models as workloads (hf:NAME), on CPU with tiny configs: the blocks compute what
the whole transformers model computes, the FLOPs the config gives are the ones counted, and the pipelined
update is the plain model's, hand-overs of several tensors and ties across stages included."""

from __future__ import annotations

import sys

import pytest

from mbtune.checking.config import CheckConfig
from mbtune.checking.run import PASS, check_update
from mbtune.errors import WorkloadError
from mbtune.workloads import load_workload
from tests.unit.test_cli import mbtune

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.integration

DECODER = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
           "intermediate_size": 64, "vocab_size": 64}
TINY = {"gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64},
        "llama": DECODER, "mistral": DECODER, "qwen2": DECODER,
        "bert": {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
                 "vocab_size": 64}}


def _options(family: str, seq_len: int = 8) -> tuple[tuple[str, object], ...]:
    return tuple({**TINY[family], "seq_len": seq_len}.items())


@pytest.mark.parametrize("family", sorted(TINY))
def test_the_blocks_compute_what_the_whole_model_computes_and_count_its_parameters(family):
    from mbtune.workloads.chain import Chain
    from mbtune.workloads.hf import hf_config, split_model

    config, _ = hf_config(family, dict(TINY[family]))
    kind = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    whole = kind.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 63, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (Chain(*split_model(whole))(ids) - whole(ids).logits).abs().max().item() < 1e-5
    workload = load_workload(f"hf:{family}", _options(family))
    assert workload.num_parameters() == sum(p.numel() for p in whole.parameters())  # ties counted once
    assert bool(workload.ties) == (family in ("gpt2", "bert"))  # tied by default there only


@pytest.mark.parametrize("family", sorted(TINY))
def test_the_flops_the_config_gives_are_the_ones_counted(family):
    from mbtune.workloads.flops import count_flops_per_sample

    workload = load_workload(f"hf:{family}", _options(family, seq_len=32))
    counted = count_flops_per_sample(workload)
    assert counted is not None and abs(workload.flops_per_sample - counted) <= 0.05 * counted


@pytest.mark.parametrize(("family", "schedule"), [
    ("llama", "1f1b"),  # (hidden, cos, sin) across the stage boundary
    ("qwen2", "zbv"),  # the same, with the backward split in input and weight parts
    ("gpt2", "interleaved-1f1b"),  # the tied embedding and head on different ranks
    ("bert", "1f1b"),  # masked LM with a fixed count per sample
])
def test_the_pipelined_update_is_the_plain_models(family, schedule):
    result = check_update(CheckConfig(workload=f"hf:{family}", workload_options=_options(family), device="cpu",
                                      schedule=schedule, num_ranks=2, num_microbatches=4, grad_accum_steps=2,
                                      micro_batch_size=2))
    assert result.status == PASS, (result.cause, result.blocks)


def test_a_bad_hf_value_is_one_line_from_the_command_line():
    # The other bad names, fields and values are in the bad-input catalogue (tests/fixtures/bad_inputs.py).
    result = mbtune("probe", "-w", "hf:gpt2", "-O", "colour=3", "-d", "cpu", "--no-save")
    assert result.returncode == 2 and "no config field colour" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    # A whole number for a float field is that float; within the window a sliding window changes nothing.
    assert load_workload("hf:llama", (("rms_norm_eps", 1),)).num_blocks == 6
    assert load_workload("hf:mistral", (("sliding_window", 64), ("seq_len", 64))).num_blocks == 6


def test_without_transformers_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(WorkloadError, match="transformers") as caught:
        load_workload("hf:gpt2")
    assert "pip install 'mbtune[hf]'" in (caught.value.hint or "")
