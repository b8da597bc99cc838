"""Hugging Face transformers models as workloads: `--workload hf:NAME` for any `model_type` of the installed
transformers that has a causal-LM model (a decoder: gpt2, llama, mistral, qwen2, qwen3, gemma, gemma2, phi3,
olmo2, granite, gpt_neox, opt, ...) or a masked-LM model (an encoder: bert, roberta, ...), or
`hf:path/to/config.json` for any config of those.

Built from the config with random weights, initialised as transformers initialises them (no downloads, no
hub access). `-O KEY=VALUE` sets any config field (`-O num_hidden_layers=24 -O hidden_size=2048`), `-O
seq_len=N` the sequence length. The defaults are small enough for a CPU demo, with dropout off (so `mbtune
check` can hold the pipeline to the plain model; `-O hidden_dropout=0.1` and the like put it back).

Blocks come from the model's structure, not from a list of families: the model is split by tracing at its
layers (Workload.from_module, traced.py), so what the family computes around them (embedding scales,
rotary tables computed once and handed on, masks, final norms, logit scales) stays as transformers wrote
it. Attention is sdpa where the family has it, else eager. Tied embeddings are found, not declared.

Losses: next-token cross entropy for the decoders (the last position has no next token and is ignored);
masked LM for the encoders with a fixed number of masked tokens per sample (15% of the sequence), so every
micro-batch's mean has the same count and micro-batching keeps the whole batch's loss.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mbtune.errors import WorkloadError
from mbtune.workloads import Workload

DEFAULT_SEQ_LEN = 64
MASKED_SHARE = 0.15  # masked LM: this share of each sequence is masked (a fixed count per sample)
MIN_TRANSFORMERS = (5, 24)  # the pyproject's hf extra; 5.17 (with torch 2.11) traced llama so that it did not split
INSTALL_HINT = "Install the extra: pip install 'mbtune[hf]' (transformers)."
FROM_MODULE_HINT = ("Load it yourself and pass it to Workload.from_module(lambda: model, make_batch=..., loss=...) "
                    "(docs/guides/workloads.md).")
CAUSAL, MASKED = "causal", "masked"
# The small default of every family: the fields a config has are set, the others ignored.
SMALL = {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 352, "vocab_size": 4096, "max_position_embeddings": 512, "head_dim": 32,
         "ffn_dim": 352, "word_embed_proj_dim": 128}
DROPOUTS = ("dropout", "pdrop", "dropout_prob", "dropout_rate")


def hf_workload(spec: str, options: dict[str, Any]) -> Workload:
    """The workload `hf:<spec>`: a model type or a config.json path, with `options` as config fields."""
    config, family = hf_config(spec, dict(options))
    seq_len = options.get("seq_len", DEFAULT_SEQ_LEN)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    limit = limit if isinstance(limit, int) and limit > 0 else None  # some families have no limit (-1)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2 or (limit and seq_len > limit):
        raise WorkloadError(f"hf:{spec}: seq_len={seq_len!r} is out of range: expected an integer from 2 to {limit}",
                            hint="Set -O seq_len=N within the model's positions (or raise max_position_embeddings).")
    if config.vocab_size < 3:
        raise WorkloadError(f"hf:{spec}: vocab_size={config.vocab_size} leaves no ids to train on",
                            hint="Use -O vocab_size=3 or more.")
    kind = _kind(family)
    build = _builder(config, kind, spec)
    try:
        # transformers' Trainer, Lightning and `loss = model(**batch).loss` drop the logits once the loss is taken.
        return Workload.from_module(
            build, make_batch=_batches(config, kind, seq_len), loss=_lm_loss, name=f"hf:{spec}",
            tokens_per_sample=seq_len, holds_outputs=False, whole=_builder(config, kind, spec, as_users_call=True),
            description=f"transformers {family}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                        f"vocab {config.vocab_size}, sequence {seq_len}")
    except WorkloadError as exc:
        raise WorkloadError(f"hf:{spec}: {family} does not split as a {kind} LM of the usual shape (looked for "
                            f"a run of layers of one class between the embeddings and the head): {exc}",
                            hint=FROM_MODULE_HINT) from exc


def _transformers() -> Any:
    try:
        import transformers
    except ModuleNotFoundError as exc:
        if exc.name != "transformers":
            raise WorkloadError(f"hf: transformers is installed but does not import: {exc}",
                                hint=INSTALL_HINT) from None
        raise WorkloadError("hf: workloads need transformers, which is not installed", hint=INSTALL_HINT) from None
    except ImportError as exc:  # its own check of its dependencies' versions, or a broken install
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise WorkloadError(f"hf: transformers is installed but does not import: {first}",
                            hint=INSTALL_HINT) from None
    found = _release(transformers.__version__)
    if found < MIN_TRANSFORMERS:
        raise WorkloadError(f"hf: transformers {transformers.__version__} is older than the "
                            f"{'.'.join(map(str, MIN_TRANSFORMERS))} hf: workloads are split with",
                            hint="pip install -U 'mbtune[hf]'")
    transformers.logging.set_verbosity_error()
    return transformers


def _release(version: str) -> tuple[int, ...]:
    """A version's leading numbers ('5.24.0.dev0' -> (5, 24, 0))."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
    return tuple(numbers)


def families() -> dict[str, str]:
    """Every model type of the installed transformers with a causal-LM or a masked-LM model, and which."""
    from transformers.models.auto import modeling_auto as auto

    found = {name: MASKED for name in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES}
    found.update({name: CAUSAL for name in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES})
    return found


def _kind(family: str) -> str:
    known = families()
    if family not in known:
        raise WorkloadError(f"hf:{family}: transformers has no causal-LM or masked-LM model for {family!r}",
                            hint="Use a model type such as gpt2, llama, qwen3, phi3 or bert, a config.json, or "
                                 "Workload.from_module for any other model.")
    return known[family]


def preload(spec: str) -> None:
    """Import transformers and the family's modeling code now (a trial does it before its memory cap: the
    budget is for training, not for importing a library). Any failure is left to the real load to report."""
    try:
        import importlib

        _transformers()
        if not spec.endswith(".json"):
            importlib.import_module(f"transformers.models.{spec}.modeling_{spec}")
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
        if not isinstance(family, str):
            raise WorkloadError(f"hf:{spec}: the config names no model_type", hint="Give a transformers config.json file.")
        _kind(family)
        default = transformers.AutoConfig.for_model(family)
    else:
        family = spec
        _kind(family)
        default = transformers.AutoConfig.for_model(family)
        base = _accepted(transformers, family, _small(default))
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
    _fit_special_tokens(config)
    return config, family


def _small(default: Any) -> dict[str, Any]:
    """The small defaults a family's config has a field for, and no dropout."""
    small: dict[str, Any] = {}
    for key, value in SMALL.items():
        if hasattr(default, key) and _settable(default, key):
            small[key] = value
    for key, value in vars(default).items():
        if isinstance(value, float) and 0 < value < 1 and key.endswith(DROPOUTS):
            small[key] = 0.0
    for key in ("layer_types", "sliding_window_pattern"):
        if _settable(default, key):
            small[key] = None  # recomputed from the number of layers where the family has it
    return small


def _settable(config: Any, key: str) -> bool:
    """Whether a config field can be set (some families compute one, a property without a setter)."""
    attribute = getattr(type(config), key, None)
    return not (isinstance(attribute, property) and attribute.fset is None)


def _accepted(transformers: Any, family: str, small: dict[str, Any]) -> dict[str, Any]:
    """The small defaults the family's config takes: all of them where it takes them together, else each
    one it takes alone (a family may refuse a field, such as a sequence limit it does not have)."""
    try:
        transformers.AutoConfig.for_model(family, **small)
        return small
    except Exception:  # noqa: BLE001 - one field or another is refused: keep those taken
        pass
    taken = {}
    for key, value in small.items():
        try:
            transformers.AutoConfig.for_model(family, **{key: value})
            taken[key] = value
        except Exception:  # noqa: BLE001 - refused: the family's own default stays
            continue
    return taken


def _fit_special_tokens(config: Any) -> None:
    """Token ids of the family's defaults that fall outside a small vocabulary, dropped (an embedding's
    padding index must lie inside it)."""
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= config.vocab_size:
            setattr(config, key, None)


def _value(value: Any) -> Any:
    """A -O value as a config field takes it: true / false / none as such."""
    words = {"true": True, "false": False, "none": None, "null": None}
    return words.get(value.lower(), value) if isinstance(value, str) else value


class _LanguageModel(nn.Module):
    """The transformers model called on token ids alone, returning its logits: without its key-value cache
    to be traced and split; `as_users_call` as its users' loops call it (`model(input_ids=..., labels=...)`,
    the cache as the family's config sets it, which some families return in training too)."""

    def __init__(self, model: nn.Module, kind: str, as_users_call: bool = False) -> None:
        super().__init__()
        self.model, self.kind, self.as_users_call = model, kind, as_users_call

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        extra = {"use_cache": False} if self.kind == CAUSAL and not self.as_users_call else {}
        return self.model(input_ids=ids, **extra).logits


def _builder(config: Any, kind: str, spec: str, as_users_call: bool = False) -> Callable[[], nn.Module]:
    transformers = _transformers()
    auto = transformers.AutoModelForCausalLM if kind == CAUSAL else transformers.AutoModelForMaskedLM
    attention = ["sdpa"]

    def build() -> nn.Module:
        while True:
            try:
                model = auto.from_config(config, attn_implementation=attention[0])
                break
            except ValueError as exc:
                if attention[0] == "sdpa" and "scaled_dot_product_attention" in str(exc):
                    attention[0] = "eager"  # the family has no sdpa path
                    continue
                raise WorkloadError(f"hf:{spec}: transformers cannot build the model: {exc}",
                                    hint="Fix the -O values.") from None
        return _LanguageModel(model, kind, as_users_call)

    return build


# --- batches and losses -------------------------------------------------------------------------------------

def _batches(config: Any, kind: str, seq_len: int) -> Callable[[int, torch.Generator | None],
                                                               tuple[torch.Tensor, torch.Tensor]]:
    vocab = config.vocab_size
    masked = max(1, round(MASKED_SHARE * seq_len))
    mask_id = getattr(config, "mask_token_id", None)
    mask_id = mask_id if isinstance(mask_id, int) and 0 <= mask_id < vocab else vocab - 1

    def causal(batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]
        return ids, targets

    def masked_lm(batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, vocab - 1, (batch_size, seq_len), generator=generator)
        picks = torch.rand(batch_size, seq_len, generator=generator).argsort(dim=1)[:, :masked]
        targets = torch.full_like(ids, -100).scatter(1, picks, ids.gather(1, picks))
        return ids.scatter(1, picks, mask_id), targets

    return masked_lm if kind == MASKED else causal


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the positions with a target (a fixed count per sample: every position but the
    last for the decoders, the masked ones for the encoders)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)
