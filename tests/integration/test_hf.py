"""Hugging Face transformers models as workloads (hf:NAME), on CPU with tiny configs: every family of the
usual shape splits into blocks that compute what the whole transformers model computes, and the pipelined
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

# Every family the workload must split (the usual shapes: decoders with learned or rotary positions, tied
# or not, embedding scales, logit scales, alternating sliding windows; encoders), tiny.
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "granite", "gpt_neox",
            "opt", "bert", "roberta")
TINY = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 64, "vocab_size": 64, "head_dim": 16, "ffn_dim": 64, "word_embed_proj_dim": 32}


def _options(family: str, seq_len: int = 8) -> tuple[tuple[str, object], ...]:
    from mbtune.workloads.hf import hf_config

    default = hf_config(family, {})[0]
    return tuple({**{k: v for k, v in TINY.items() if hasattr(default, k)}, "seq_len": seq_len}.items())


def test_every_family_splits_into_blocks_that_compute_what_the_whole_model_computes():
    from mbtune.workloads.hf import _builder, _kind, hf_config

    for family in FAMILIES:
        options = dict(_options(family))
        workload = load_workload(f"hf:{family}", tuple(options.items()))
        config, _ = hf_config(family, {k: v for k, v in options.items() if k != "seq_len"})
        torch.manual_seed(3)
        whole = _builder(config, _kind(family), family)()
        ids, _ = workload.make_batch(3, torch.Generator().manual_seed(0))  # traced at 2, run at 3
        with torch.no_grad():
            difference = (workload.build(seed=3)(ids) - whole(ids)).abs().max().item()
        assert difference == 0.0, family
        assert workload.num_blocks == 2 + 2, family  # embeddings, the layers, the head
        assert workload.num_parameters() == sum(p.numel() for p in whole.parameters()), family  # ties once
        assert bool(workload.ties) == bool(config.tie_word_embeddings), family  # found from the model


@pytest.mark.parametrize(("family", "schedule"), [
    ("llama", "1f1b"),  # (hidden, cos, sin, mask) across the stage boundary
    ("qwen3", "zbv"),  # the same, with the backward split in input and weight parts
    ("gpt2", "interleaved-1f1b"),  # the tied embedding and head on different ranks
    ("gemma2", "gpipe"),  # eager attention, alternating sliding windows, scaled embeddings, soft-capped logits
    ("bert", "1f1b"),  # masked LM with a fixed count per sample
])
def test_the_pipelined_update_is_the_plain_models(family, schedule):
    result = check_update(CheckConfig(workload=f"hf:{family}", workload_options=_options(family), device="cpu",
                                      schedule=schedule, num_ranks=2, num_micro_batches=4, grad_accum_steps=2,
                                      micro_batch_size=2))
    assert result.status == PASS, (result.cause, result.blocks)


def test_a_family_that_does_not_split_says_what_it_looked_for_and_offers_from_module():
    # Mixtral's experts route tokens by value: the sizes inside a layer depend on the data.
    with pytest.raises(WorkloadError, match="does not split as a causal LM of the usual shape") as caught:
        load_workload("hf:mixtral", (("seq_len", 8),))
    assert "Workload.from_module" in caught.value.hint


def test_a_bad_hf_value_is_one_line_from_the_command_line():
    # The other bad names, fields and values are in the bad-input catalogue (tests/fixtures/bad_inputs.py).
    result = mbtune("probe", "-w", "hf:gpt2", "-O", "colour=3", "-d", "cpu", "--no-save")
    assert result.returncode == 2 and "no config field colour" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    # A whole number for a float field is that float.
    assert load_workload("hf:llama", (("rms_norm_eps", 1),)).num_blocks == 6


def test_without_transformers_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(WorkloadError, match="transformers") as caught:
        load_workload("hf:gpt2")
    assert "pip install 'mbtune[hf]'" in (caught.value.hint or "")


def test_a_deep_model_traced_by_its_first_layers_computes_what_the_whole_model_computes():
    # Seven layers: the first three are traced and the third copied for the other four where the layers are
    # alike (identical_members.py); gemma2's alternate sliding and global attention, so all seven are traced. (Every
    # family: bench/families.py --load-all --layers 8.)
    from mbtune.workloads.hf import _builder, _kind, hf_config

    copied = {}
    for family in ("gpt2", "llama", "gemma", "gemma2", "bert"):
        options = {**dict(_options(family)), "num_hidden_layers": 7}
        workload = load_workload(f"hf:{family}", tuple(options.items()))
        copied[family] = workload.traced.num_copied
        config, _ = hf_config(family, {k: v for k, v in options.items() if k != "seq_len"})
        torch.manual_seed(3)
        whole = _builder(config, _kind(family), family)()
        ids, _ = workload.make_batch(3, torch.Generator().manual_seed(0))
        model = workload.build(seed=3)
        assert (model(ids) - whole(ids)).abs().max().item() == 0.0, family
        assert workload.num_blocks == 2 + 7, family
        assert [block.label for block in model][1:-1] == list(workload.traced.trunk), family
        assert workload.num_parameters() == sum(p.numel() for p in whole.parameters()), family
    assert {family: n for family, n in copied.items() if n != 4} == {"gemma2": 0}, copied


def test_the_pipelined_update_of_a_deep_model_traced_by_its_first_layers_is_the_plain_models():
    options = tuple({**dict(_options("llama")), "num_hidden_layers": 7}.items())
    assert load_workload("hf:llama", options).traced.num_copied == 4
    result = check_update(CheckConfig(workload="hf:llama", workload_options=options, device="cpu", schedule="1f1b",
                                      num_ranks=2, num_micro_batches=4, grad_accum_steps=2, micro_batch_size=2))
    assert result.status == PASS, (result.cause, result.blocks)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_a_transformers_step_predicted_with_echoed_micro_batches_peaks_where_every_one_computed_does(family):
    from mbtune.pipeline.point import SweepPoint
    from mbtune.pipeline.point_spec import PipelineSpec
    from mbtune.pipeline.rank_memory import RankPeaks

    options = tuple({**dict(_options(family)), "num_hidden_layers": 4}.items())
    workload = load_workload(f"hf:{family}", options)
    echoes, computed = RankPeaks(workload, echoes=True), RankPeaks(workload, echoes=False)
    for schedule in ("1f1b", "gpipe"):
        point = SweepPoint(schedule=schedule, num_ranks=2, num_micro_batches=5, grad_accum_steps=1,
                           micro_batch_size=2)
        spec = PipelineSpec.for_point(point, workload=f"hf:{family}", workload_options=options, device="cpu",
                                      measured_steps=1)
        for rank in range(2):
            fast = echoes.rank(echoes.prepare(spec), rank)
            whole = computed.rank(computed.prepare(spec), rank)
            # Their stages hand over masks and positions, and keep what autograd's unrun nodes hold.
            assert fast.num_echoed > 0 and fast.peak_bytes == whole.peak_bytes, (family, schedule, rank)
