"""Hugging Face transformers models as workloads: `--workload hf:gpt2` (llama, mistral, qwen2, bert), or
`hf:path/to/config.json` for any config of those families.

Built from the config with random weights (no downloads, no hub access). `-O KEY=VALUE` sets any config
field (`-O num_hidden_layers=24 -O hidden_size=2048`), `-O seq_len=N` the sequence length. The defaults are
small enough for a CPU demo, with dropout off (so `mbtune check` can hold the pipeline to the plain model;
`-O resid_pdrop=0.1` and the like put it back).

Blocks: the embeddings, each decoder or encoder layer, and the final norm with the head. Llama, Mistral and
Qwen2 hand (hidden states, cos, sin) from block to block: the rotary table is computed once, by the
embedding block, and crosses stages without a gradient. Attention is always sdpa: a layer called on its own
with no mask is then causal in a decoder and bidirectional in BERT; the eager fallback would attend to
future tokens unmasked. Tied embeddings (GPT-2's and BERT's by default, the others' with
`-O tie_word_embeddings=true`) are declared as ties (see the workload contract).

Losses: next-token cross entropy for the decoders (the last position has no next token and is ignored);
masked LM for BERT with a fixed number of masked tokens per sample (15% of the sequence), so every
micro-batch's mean has the same count and micro-batching keeps the whole batch's loss.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mbtune.errors import WorkloadError
from mbtune.workloads import Workload

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "bert")
DECODERS = ("llama", "mistral", "qwen2")
DEFAULT_SEQ_LEN = 64
MASKED_SHARE = 0.15  # BERT: this share of each sequence is masked (a fixed count per sample)
INSTALL_HINT = "Install the extra: pip install 'mbtune[hf]' (transformers)."
_SMALL_DECODER = {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "intermediate_size": 352, "vocab_size": 4096, "max_position_embeddings": 512,
                  "attention_dropout": 0.0}
SMALL: dict[str, dict[str, Any]] = {
    "gpt2": {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 4096, "n_positions": 512, "resid_pdrop": 0.0,
             "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None},
    "llama": dict(_SMALL_DECODER),
    "mistral": {**_SMALL_DECODER, "sliding_window": None},
    "qwen2": dict(_SMALL_DECODER),
    "bert": {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512,
             "vocab_size": 4096, "max_position_embeddings": 512, "hidden_dropout_prob": 0.0,
             "attention_probs_dropout_prob": 0.0},
}


def hf_workload(spec: str, options: dict[str, Any]) -> Workload:
    """The workload `hf:<spec>`: a family name or a config.json path, with `options` as config fields."""
    config, family = hf_config(spec, dict(options))
    seq_len = options.get("seq_len", DEFAULT_SEQ_LEN)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2 or (limit and seq_len > limit):
        raise WorkloadError(f"hf:{spec}: seq_len={seq_len!r} is out of range: expected an integer from 2 to {limit}",
                            hint="Set -O seq_len=N within the model's positions (or raise max_position_embeddings).")
    window = _sliding_window(config)
    if window is not None and seq_len > window:
        raise WorkloadError(f"hf:{spec}: seq_len={seq_len} is longer than the sliding window ({window}), which "
                            "these blocks do not apply (attention runs unmasked, causal by sdpa)",
                            hint="Use -O seq_len within the window, or -O sliding_window=none.")
    if config.vocab_size < 3:
        raise WorkloadError(f"hf:{spec}: vocab_size={config.vocab_size} leaves no ids to train on",
                            hint="Use -O vocab_size=3 or more.")
    parts = _FAMILY_PARTS[family](config)
    blocks: list[Callable[[], nn.Module]] = [_initialised(build, config) for build in parts.blocks]
    tokens = seq_len
    return Workload(
        name=f"hf:{spec}", blocks=blocks, make_batch=_batches(config, family, seq_len),
        loss=_masked_lm_loss if family == "bert" else _causal_lm_loss,
        flops_per_sample=training_flops(config, family, seq_len), tokens_per_sample=tokens,
        description=f"transformers {family}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                    f"vocab {config.vocab_size}, sequence {seq_len}",
        ties=parts.ties(len(blocks)) if _tied(config) else (),
    )


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise WorkloadError("hf: workloads need transformers, which is not installed", hint=INSTALL_HINT) from None
    transformers.logging.set_verbosity_error()
    return transformers


def preload(spec: str) -> None:
    """Import transformers and the family's modeling code now (a trial does it before its memory cap: the
    budget is for training, not for importing a library). Any failure is left to the real load to report."""
    try:
        import importlib

        _transformers()
        family = spec if spec in FAMILIES else None
        if family is not None:
            importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except Exception:  # noqa: BLE001 - reported by the load that follows
        pass


def hf_config(spec: str, options: dict[str, Any]) -> tuple[Any, str]:
    transformers = _transformers()
    fields = {k: _value(v) for k, v in options.items() if k != "seq_len"}
    if spec.endswith(".json"):
        try:
            data = json.loads(Path(spec).read_text())
        except (OSError, ValueError) as exc:
            raise WorkloadError(f"hf:{spec}: cannot read the config: {exc}",
                                hint="Give a transformers config.json file.") from None
        family = data.pop("model_type", None) if isinstance(data, dict) else None
        base: dict[str, Any] = {k: v for k, v in data.items() if not k.startswith("_")} if isinstance(data, dict) else {}
    else:
        family, base = spec, dict(SMALL.get(spec, {}))
    if family not in FAMILIES:
        raise WorkloadError(f"hf:{spec}: unknown model family {family!r}",
                            hint=f"Supported: {', '.join('hf:' + f for f in FAMILIES)}, or hf:path/to/config.json.")
    default = transformers.AutoConfig.for_model(family)
    unknown = sorted(k for k in fields if not hasattr(default, k))
    if unknown:
        raise WorkloadError(f"hf:{spec} has no config field {', '.join(unknown)}",
                            hint=f"-O sets {type(default).__name__} fields (or seq_len).")
    # A whole number given for a field that holds a float (-O rms_norm_eps=1) is that float.
    fields = {k: float(v) if isinstance(getattr(default, k), float) and isinstance(v, int) and not isinstance(v, bool)
              else v for k, v in fields.items()}
    try:
        config = transformers.AutoConfig.for_model(family, **{**base, **fields})
    except Exception as exc:  # noqa: BLE001 - transformers refuses the values: bad input, in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise WorkloadError(f"hf:{spec}: the config refuses these settings: {first}",
                            hint="Fix the -O values (see the family's transformers config).") from None
    config._attn_implementation = "sdpa"
    return config, family


def _sliding_window(config: Any) -> int | None:
    """The sliding window some layer attends over (Mistral's, Qwen2's with use_sliding_window), or None."""
    window = getattr(config, "sliding_window", None)
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return window if isinstance(window, int) and window > 0 else None


def _value(value: Any) -> Any:
    """A -O value as a config field takes it: true / false / none as such."""
    words = {"true": True, "false": False, "none": None, "null": None}
    return words.get(value.lower(), value) if isinstance(value, str) else value


def _tied(config: Any) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


class _Parts:
    """A family's block builders (embeddings, layers, head) and where its tie sits."""

    def __init__(self, blocks: list[Callable[[], nn.Module]], embedding: str, head: str) -> None:
        self.blocks, self.embedding, self.head = blocks, embedding, head

    def ties(self, num_blocks: int) -> tuple[tuple[tuple[int, str], ...], ...]:
        return (((0, self.embedding), (num_blocks - 1, self.head)),)


# --- GPT-2 ------------------------------------------------------------------------------------------------

class Gpt2Embedding(nn.Module):
    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(positions))


class Gpt2Layer(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden, cache=None, attention_mask=None, use_cache=False)


class Gpt2Head(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = norm, head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def _gpt2(config: Any) -> _Parts:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    layers = [lambda i=i: Gpt2Layer(GPT2Block(config, layer_idx=i)) for i in range(config.num_hidden_layers)]
    head = lambda: Gpt2Head(nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon),  # noqa: E731
                            nn.Linear(config.hidden_size, config.vocab_size, bias=False))
    embed = lambda: Gpt2Embedding(nn.Embedding(config.vocab_size, config.hidden_size),  # noqa: E731
                                  nn.Embedding(config.max_position_embeddings, config.hidden_size),
                                  nn.Dropout(config.embd_pdrop))
    return _Parts([embed, *layers, head], "wte.weight", "lm_head.weight")


# --- Llama, Mistral, Qwen2 --------------------------------------------------------------------------------

class RotaryEmbedding(nn.Module):
    """Token embeddings, and the rotary table (cos, sin) every later layer takes, computed once here."""

    def __init__(self, embed: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.embed_tokens, self.rotary_emb = embed, rotary

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        cos, sin = self.rotary_emb(hidden, positions)
        return hidden, cos, sin


class DecoderLayer(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.layer(hidden, attention_mask=None, position_embeddings=(cos, sin), cache=None, use_cache=False)
        return out, cos, sin


class DecoderHead(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, head

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def _decoder(config: Any) -> _Parts:
    import importlib

    family = config.model_type
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[family]
    layer_cls, rotary_cls, norm_cls = (getattr(module, prefix + name)
                                       for name in ("DecoderLayer", "RotaryEmbedding", "RMSNorm"))
    embed = lambda: RotaryEmbedding(nn.Embedding(config.vocab_size, config.hidden_size),  # noqa: E731
                                    rotary_cls(config))
    layers = [lambda i=i: DecoderLayer(layer_cls(config, layer_idx=i)) for i in range(config.num_hidden_layers)]
    head = lambda: DecoderHead(norm_cls(config.hidden_size, eps=config.rms_norm_eps),  # noqa: E731
                               nn.Linear(config.hidden_size, config.vocab_size, bias=False))
    return _Parts([embed, *layers, head], "embed_tokens.weight", "lm_head.weight")


# --- BERT -------------------------------------------------------------------------------------------------

class BertEmbedding(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids=ids)


class BertEncoderLayer(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden, None)


class BertHead(nn.Module):
    def __init__(self, head: Any) -> None:
        super().__init__()
        self.cls = head
        head.predictions.decoder.bias = head.predictions.bias  # one output bias, as transformers ties them

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cls(hidden)


def _bert(config: Any) -> _Parts:
    from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer, BertOnlyMLMHead

    layers = [lambda i=i: BertEncoderLayer(BertLayer(config, layer_idx=i)) for i in range(config.num_hidden_layers)]
    return _Parts([lambda: BertEmbedding(BertEmbeddings(config)), *layers, lambda: BertHead(BertOnlyMLMHead(config))],
                  "embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")


_FAMILY_PARTS: dict[str, Callable[[Any], _Parts]] = {"gpt2": _gpt2, "llama": _decoder, "mistral": _decoder,
                                                     "qwen2": _decoder, "bert": _bert}


def split_model(model: Any) -> list[nn.Module]:
    """The blocks of a whole transformers model, made of its own modules (its weights): for checking that the
    blocks compute what the model computes."""
    family = model.config.model_type
    if family == "gpt2":
        t = model.transformer
        return [Gpt2Embedding(t.wte, t.wpe, t.drop), *(Gpt2Layer(b) for b in t.h), Gpt2Head(t.ln_f, model.lm_head)]
    if family in DECODERS:
        m = model.model
        return [RotaryEmbedding(m.embed_tokens, m.rotary_emb), *(DecoderLayer(layer) for layer in m.layers),
                DecoderHead(m.norm, model.lm_head)]
    if family == "bert":
        return [BertEmbedding(model.bert.embeddings), *(BertEncoderLayer(layer) for layer in model.bert.encoder.layer),
                BertHead(model.cls)]
    raise WorkloadError(f"no split for model family {family!r}", hint=f"Supported: {', '.join(FAMILIES)}.")


# --- weights, batches, losses, FLOPs ------------------------------------------------------------------------

def _initialised(build: Callable[[], nn.Module], config: Any) -> Callable[[], nn.Module]:
    """The builder, with the weights initialised as transformers initialises them (normal with the
    config's initializer_range for matmuls and embeddings, ones and zeros for norms)."""
    std = getattr(config, "initializer_range", 0.02)

    def built() -> nn.Module:
        module = build()
        for sub in module.modules():
            name = type(sub).__name__
            weight, bias = getattr(sub, "weight", None), getattr(sub, "bias", None)
            if isinstance(sub, nn.Linear | nn.Embedding) or name == "Conv1D":
                if isinstance(weight, nn.Parameter):
                    nn.init.normal_(weight, std=std)
                if isinstance(bias, nn.Parameter):
                    nn.init.zeros_(bias)
            elif "Norm" in name:
                if isinstance(weight, nn.Parameter):
                    nn.init.ones_(weight)
                if isinstance(bias, nn.Parameter):
                    nn.init.zeros_(bias)
        return module

    return built


def _batches(config: Any, family: str, seq_len: int) -> Callable[[int, torch.Generator | None],
                                                                   tuple[torch.Tensor, torch.Tensor]]:
    vocab = config.vocab_size
    masked = max(1, round(MASKED_SHARE * seq_len))

    def causal(batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]
        return ids, targets

    def masked_lm(batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, vocab - 1, (batch_size, seq_len), generator=generator)
        picks = torch.rand(batch_size, seq_len, generator=generator).argsort(dim=1)[:, :masked]
        targets = torch.full_like(ids, -100).scatter(1, picks, ids.gather(1, picks))
        return ids.scatter(1, picks, vocab - 1), targets  # the last id is the [MASK] token

    return masked_lm if family == "bert" else causal


def _causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over every position but the last (a fixed count per sample)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)


def _masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the masked positions, the same number in every sample."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)


def training_flops(config: Any, family: str, seq_len: int) -> float:
    """Forward + backward FLOPs per sample from the config: 6 x matmul parameters x tokens, plus attention's
    two T x T products per layer (4 T^2 d forward, three times that in training). Embedding lookups and
    elementwise work are left out, as FlopCounterMode leaves them out."""
    d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    if family == "gpt2":
        inner = config.n_inner or 4 * d
        per_layer = 4 * d * d + 2 * d * inner
        head = d * vocab
    elif family == "bert":
        per_layer = 4 * d * d + 2 * d * config.intermediate_size
        head = d * d + d * vocab
    else:
        kv = (config.num_key_value_heads or heads) * head_dim
        per_layer = d * heads * head_dim * 2 + 2 * d * kv + 3 * d * config.intermediate_size
        head = d * vocab
    matmul = layers * per_layer + head
    attention = layers * 4 * seq_len * seq_len * heads * head_dim
    return 3.0 * (2 * matmul * seq_len + attention)
