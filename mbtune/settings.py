"""What every command's settings share: the precisions, optimizers and modes, their defaults, the flag each
config field is set by, and the checks the configs run on the fields they have in common."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from mbtune.records import RECOMPUTE_MODES
from mbtune.validation import require as _require

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


# Config fields whose command-line flag is not the field's name with dashes (every other field's is). A
# setting has one spelling: its flag's, with underscores in the Python API and in settings files.
FLAG_NAMES = {"trial_timeout_s": "trial-timeout", "load_timeout_s": "load-timeout", "point_timeout_s": "point-timeout",
              "grad_accum_steps": "accum", "measured_steps": "steps", "warmup_steps": "warmup", "num_ranks": "stages",
              "memory_budget_bytes": "memory-budget", "workload_options": "option", "data_parallel_size": "data-parallel",
              "num_blocks": "blocks", "link_bandwidth_bytes_per_s": "link-bandwidth", "link_latency_s": "link-latency",
              "validation_method": "validation", "num_microbatches": "micro-batches", "timeout_s": "timeout",
              "p99_budget_s": "p99", "queue_delays_s": "queue-delays", "window_s": "window",
              "queue_timeout_s": "queue-timeout", "num_gpus": "gpus", "device_memory_bytes": "device-memory",
              "max_time_per_point_s": "max-time-per-point"}
# The workload's options are one table (a dict in Python, [options] in a file), not the repeatable -O flag.
_TABLES = {"workload_options": "options"}


def flag_for(field_name: str) -> str:
    """The command-line flag of a config field."""
    return "--" + FLAG_NAMES.get(field_name, field_name.replace("_", "-"))


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
