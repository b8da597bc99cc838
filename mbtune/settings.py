"""What every command's settings share: the precisions, optimizers and modes, their defaults, the flag each
config field is set by, and the checks the configs run on the fields they have in common."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from mbtune.errors import ConfigError
from mbtune.records import RECOMPUTE_MODES
from mbtune.validation import require as _require

C = TypeVar("C")

PRECISIONS = ("fp32", "bf16", "fp16")


# What a trial runs: full training steps, or forward passes in eval mode under torch.inference_mode.
TRAIN, INFER = "train", "infer"


MODES = (TRAIN, INFER)


OPTIMIZERS = ("adamw", "sgd")


# The learning rate each optimizer trains with when --lr is not given (memory and speed do not depend on it).
DEFAULT_LR = {"adamw": 1e-4, "sgd": 1e-3}


def lr_for(optimizer: str, lr: float | None) -> float:
    """The learning rate a run trains with: the one given, else the optimizer's default."""
    return lr if lr is not None else DEFAULT_LR[optimizer]


DEFAULT_MARGIN = 0.15


# Timeouts above a week are a typo (or inf): a hung trial would hold a CI runner for that long.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


DEFAULT_TRIAL_TIMEOUT_S = 600.0


DEFAULT_LOAD_TIMEOUT_S = 120.0


USUAL_MARGIN_RANGE = (0.10, 0.20)


# The fields whose flag is a shorter word than the field. Every other field's flag is its name less its unit
# (`_s`, `_bytes`, `_bytes_per_s`) and its `num_`, with dashes: trial_timeout_s -> --trial-timeout,
# memory_budget_bytes -> --memory-budget, num_gpus -> --gpus. A setting has that one spelling: its flag's,
# with underscores in the Python API and in settings files.
SHORT_FLAGS = {"grad_accum_steps": "accum", "measured_steps": "steps", "warmup_steps": "warmup", "num_ranks": "stages",
               "workload_options": "option", "data_parallel_size": "data-parallel",
               "validation_method": "validation", "p99_budget_s": "p99"}
_UNITS = ("_bytes_per_s", "_bytes", "_s")
# The workload's options are one table (a dict in Python, [options] in a file), not the repeatable -O flag.
_TABLES = {"workload_options": "options"}
# Settings renamed, by their former name: still taken, with a note, for a release.
FORMER_NAMES = {"virtual_stages": "stages_per_rank"}
# Config fields that no setting names: mbtune fills them in itself.
NOT_SETTINGS = frozenset({"command_line", "extra_warnings", "points"})


def flag_for(field_name: str) -> str:
    """The command-line flag of a config field."""
    if field_name in SHORT_FLAGS:
        return "--" + SHORT_FLAGS[field_name]
    name = field_name.removeprefix("num_")
    name = next((name.removesuffix(unit) for unit in _UNITS if name.endswith(unit)), name)
    return "--" + name.replace("_", "-")


def param_for(field_name: str) -> str:
    """The setting's one name in the Python API and in settings files: its flag with underscores."""
    return _TABLES.get(field_name) or flag_for(field_name)[2:].replace("-", "_")


def field_for(key: str, fields: Collection[str]) -> str:
    """The config field, of `fields`, that a setting names by its flag, with underscores or dashes
    (`accum` -> `grad_accum_steps`, `trial-timeout` -> `trial_timeout_s`). A key that names none (a
    field's own name where the flag's differs, say) comes back as it is, for the caller to refuse."""
    wanted = key.replace("-", "_")
    return next((f for f in fields if param_for(f) == wanted), key)


def check_lr(lr: float | None) -> None:
    _require(lr is None or (math.isfinite(lr) and lr > 0), "lr", lr, "a finite number above 0 (e.g. 3e-4)")


def check_timeout(seconds: float, field_name: str) -> None:
    _require(0 < seconds <= MAX_TIMEOUT_S, field_name, seconds, f"seconds above 0 and at most {MAX_TIMEOUT_S:g} (a week)")


def bound_load_timeout(config: Any, run_timeout_s: float) -> None:
    """A load timeout left at its default is cut to the run's own (a trial's or a point's) when that is
    shorter: a user who gives --trial-timeout 5 expects a factory that hangs to be stopped within 5 s, not
    DEFAULT_LOAD_TIMEOUT_S. A load timeout the user set is kept."""
    if config.load_timeout_s == DEFAULT_LOAD_TIMEOUT_S and run_timeout_s < DEFAULT_LOAD_TIMEOUT_S:
        object.__setattr__(config, "load_timeout_s", run_timeout_s)


def as_tuple(config: Any, name: str) -> None:
    """A list field given one value (an int, a str), as before lists: that value alone."""
    value = getattr(config, name)
    if isinstance(value, int | str) and not isinstance(value, bool):
        object.__setattr__(config, name, (value,))


def check_recompute_modes(modes: tuple[str, ...]) -> None:
    unknown = [m for m in modes if m not in RECOMPUTE_MODES]
    _require(bool(modes) and not unknown, "recompute", ",".join(unknown) or modes, " | ".join(RECOMPUTE_MODES))


STRATEGIES = ("grid", "quick")


# Upper bounds far above any real run. A value past one is a typo (an exponent, a stray digit, 2**63-1 from a
# script) that would otherwise overflow a tensor's size in the first trial or run for years before failing.
MAX_SAMPLES = 2**40  # a batch, a granularity, a global batch: about a trillion samples
MAX_COUNT = 2**20  # steps, repeats, confirmations, micro-batches, accumulation steps: about a million
MAX_PROCESSES = 2**16  # stages, replicas, virtual stages, threads
MAX_BUDGET_BYTES = 2**50  # 1 PiB: more memory than any one device or host has
MAX_SEED = 2**40  # a seed is scaled by about 10**6 into torch's 64-bit generator seeds
_BOUNDS = {MAX_SAMPLES: "2**40 samples", MAX_COUNT: "2**20", MAX_PROCESSES: "2**16",
           MAX_BUDGET_BYTES: "1 PiB (more than any device or host has)", MAX_SEED: "2**40"}


def check_at_most(config: Any, limit: int, *names: str) -> None:
    """Refuse a field (a number, or a list of them; None passes) above `limit`, one of the MAX_ bounds."""
    for name in names:
        value = getattr(config, name)
        values = value if isinstance(value, tuple) else (value,)
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        _require(all(v <= limit for v in numbers), name, value, f"at most {_BOUNDS[limit]}")


def check_seed(seed: int) -> None:
    _require(abs(seed) <= MAX_SEED, "seed", seed, f"an integer from -{_BOUNDS[MAX_SEED]} to {_BOUNDS[MAX_SEED]}")


def setting_names(kind: type) -> dict[str, str]:
    """A config's settings: each setting's name (its flag with underscores) -> the config field it sets. The
    workload's options answer to `options` (one table) and to `option` (the repeatable flag's KEY=VALUE items)."""
    fields = [f.name for f in dataclasses.fields(kind) if f.init and f.name not in NOT_SETTINGS]
    return {**{flag_for(f)[2:].replace("-", "_"): f for f in fields}, **{param_for(f): f for f in fields}}


def build(kind: type[C], given: Mapping[str, Any], *, spelled: Callable[[str], str] = param_for, what: str = "",
          said: Callable[[str], None] | None = None, **filled: Any) -> C:
    """The one door to a config, for the command line, the Python API, settings files and re-runs alike.

    `given`: settings by name (the flag's, with underscores or dashes); None is a setting not given (the
    config's default). Each value is coerced by its field: a size ("8GiB") for a `_bytes` field, a duration
    ("50ms") for an `_s` one, a rate ("50GB/s") for a `_bytes_per_s` one, a comma list ("2,4") or a list for
    a tuple, KEY=VALUE items or a mapping for the workload's options. The config then checks its own
    bounds. `spelled` names a field in the caller's words (the flag on the command line, the setting's name
    elsewhere): every error names the setting so. A setting given by its former name (FORMER_NAMES) is
    taken, and `said` (default: a FutureWarning) tells the caller its new name. `filled`: fields mbtune fills
    in itself (command_line)."""
    names = setting_names(kind)
    given = _current_names(given, spelled, said)
    hints = typing.get_type_hints(kind)
    fields: dict[str, Any] = {}
    for key, value in given.items():
        name = names.get(key.replace("-", "_"))
        if name is None:
            raise ConfigError(f"unknown setting {key!r} for {what or kind.__name__}",
                              hint=f"Settings are the flags' names with underscores: {', '.join(sorted(names))}.")
        if name in fields:
            raise ConfigError(f"{spelled(name)} is given twice", hint="Give it once.")
        if value is not None:
            fields[name] = _coerced(name, hints[name], value, spelled(name))
    try:
        return kind(**fields, **filled)
    except ConfigError as exc:
        raise _in_words(exc, spelled) if exc.field in names.values() else exc from None


def _current_names(given: Mapping[str, Any], spelled: Callable[[str], str],
                   said: Callable[[str], None] | None) -> dict[str, Any]:
    """The settings with each former name (FORMER_NAMES) given replaced by its current one."""
    current = dict(given)
    for key, value in given.items():
        name = FORMER_NAMES.get(key.replace("-", "_"))
        if name is None:
            continue
        del current[key]
        if value is None:
            continue
        current[name] = value
        line = f"{spelled(key.replace('-', '_'))} is now {spelled(name)}; the former name goes in a later release"
        if said is not None:
            said(line)
        else:
            import warnings

            warnings.warn(line, FutureWarning, stacklevel=4)
    return current


def _coerced(name: str, hint: Any, value: Any, label: str) -> Any:
    """A setting's value as its field holds it (see build)."""
    from mbtune.units import parse_bytes, parse_duration, parse_fraction, parse_list, parse_options, parse_rate

    if name == "grid":  # a sweep's own settings of a command: checked by SweepConfig (sweeping/command.py)
        return tuple(value.items()) if isinstance(value, Mapping) else tuple(value) if isinstance(value, list) else value
    if name == "workload_options":
        if isinstance(value, Mapping):
            return tuple(sorted(value.items()))
        if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
            return parse_options(list(value))
        return value
    if isinstance(value, list):
        value = tuple(value)
    listed = _is_tuple(hint)
    if listed and isinstance(value, str):
        value = parse_list(value, name=label, convert=str if name.endswith("_s") else _item_type(hint))
    if not isinstance(value, str):
        if listed and name.endswith("_s") and isinstance(value, tuple):
            return tuple(parse_duration(v, name=label) if isinstance(v, str) else v for v in value)
        return value
    if name.endswith("_bytes_per_s"):
        return parse_rate(value, name=label)
    if name.endswith("_bytes"):
        return parse_bytes(value, name=label, at_most=MAX_BUDGET_BYTES)
    if name.endswith("_s"):
        return parse_duration(value, name=label)
    if _is_float(hint):  # a number, a share as 0.03 or 3%
        if value.strip().endswith("%"):
            return parse_fraction(value, name=label)
        try:
            return float(value)
        except ValueError:
            return value  # the config names what it wanted
    return value


def _is_float(hint: Any) -> bool:
    return hint is float or hint == "float" or (isinstance(hint, str) and hint.replace(" ", "") == "float")


def _is_tuple(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple or any(typing.get_origin(a) is tuple for a in typing.get_args(hint))


def _item_type(hint: Any) -> type:
    """The item type of a tuple field (`tuple[int, ...] | None` -> int); str where it is not one type."""
    tuples = [hint] if typing.get_origin(hint) is tuple else [a for a in typing.get_args(hint) if typing.get_origin(a) is tuple]
    item = typing.get_args(tuples[0])[0] if tuples and typing.get_args(tuples[0]) else str
    return item if item in (int, float, str) else str


def _in_words(exc: ConfigError, spelled: Callable[[str], str]) -> ConfigError:
    """A config's error about one of its fields, naming the setting as the caller does."""
    assert exc.field is not None
    word = spelled(exc.field)
    message = exc.message.replace(f"{exc.field}=", f"{word} " if word.startswith("--") else f"{word}=", 1)
    hint = exc.hint or (f"Fix {word}." if word.startswith("--") else None)
    return ConfigError(message, hint=hint, detail=exc.detail, field=exc.field, given=exc.given, expected=exc.expected)


def settings_of(kind: type, record: Any, *, skip: Collection[str] = ()) -> dict[str, Any]:
    """The settings of `kind` that a saved record holds under the same field name, by setting name: what a
    re-run of the record starts from (qualify's re-run of a baseline). `skip`: fields the record holds that a
    re-run decides afresh."""
    held = {f.name for f in dataclasses.fields(record)} - set(skip)
    return {param_for(field): getattr(record, field) for field in set(setting_names(kind).values()) & held}
