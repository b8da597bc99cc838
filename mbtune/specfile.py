"""Qualification specs from TOML files committed beside a CI job.

```toml
workload = "gpt"                 # built-in name or package.module:factory
device = "cuda"
memory_budget = "8GiB"
tolerance = "10%"                # against the baseline, when there is one
repeats = 3                      # runs of each sweep point, each in fresh processes (default 3)
baseline = "profiles/cuda-nvidia-h200/gpt.json"   # optional; relative to this file

[options]                        # workload options
layers = 8

[probe]                          # any `mbtune probe` setting: margin, granularity, precision, ...
granularity = 8

[sweep]                          # stages, schedules, micro_batches, accum, micro_batch_size, global_batch, steps
stages = 1
schedules = ["gpipe", "1f1b"]
micro_batches = [2, 4, 8]

[thresholds]                     # absolute bounds
min_ceiling = 100
min_safe_batch = 85
min_best_samples_per_s = 1000.0
max_best_bubble = 0.5
```
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any, NamedTuple

from mbtune.config import ProbeConfig, QualifySpec, SweepConfig, parse_bytes, parse_fraction
from mbtune.errors import ConfigError
from mbtune.qualify import DEFAULT_REPEATS

_TOP = {"workload", "device", "memory_budget", "tolerance", "repeats", "baseline", "options", "probe", "sweep",
        "thresholds"}
_SWEEP_NAMES = {"stages": "num_stages", "micro_batches": "micro_batches", "accum": "accum_steps",
                "steps": "measured_steps", "warmup": "warmup_steps"}


class LoadedSpec(NamedTuple):
    """A spec file read: what to run and hold it to, and how many runs each sweep point gets."""

    spec: QualifySpec
    repeats: int


def load_spec(path: Path, *, baseline: str | None = None, tolerance: float | None = None,
              allow_different_device: bool = False, command_line: str = "") -> QualifySpec:
    """Read a TOML spec; flags given on the command line win over the file."""
    return read_spec(path, baseline=baseline, tolerance=tolerance, allow_different_device=allow_different_device,
                     command_line=command_line).spec


def read_spec(path: Path, *, baseline: str | None = None, tolerance: float | None = None,
              repeats: int | None = None, allow_different_device: bool = False,
              command_line: str = "") -> LoadedSpec:
    """Read a TOML spec and its repeats (the flag, else the file's `repeats` or [sweep] repeats, else 3);
    flags given on the command line win over the file."""
    data = _read(path)
    if baseline is None and data.get("baseline"):
        baseline = str((Path(path).parent / data["baseline"]).resolve())
    repeats = _repeats(data, repeats)
    probe = _probe(data, command_line) if "workload" in data else None
    sweep = _sweep(data, command_line) if probe and "sweep" in data else None
    spec = QualifySpec(
        baseline=baseline, probe=probe, sweep=dataclasses.replace(sweep, repeats=repeats) if sweep else None,
        tolerance=tolerance if tolerance is not None else parse_fraction(data.get("tolerance", 0.10), name="tolerance"),
        thresholds=tuple(sorted((k, float(v)) for k, v in data.get("thresholds", {}).items())),
        allow_different_device=allow_different_device,
    )
    return LoadedSpec(spec=spec, repeats=repeats)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"spec {path} does not exist", hint="Pass the path of a qualify.toml.") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"spec {path} is not valid TOML: {exc}", hint="Fix the file.") from None
    unknown = sorted(set(data) - _TOP)
    if unknown:
        raise ConfigError(f"spec {path} has unknown key(s) {', '.join(unknown)}",
                          hint=f"Known keys: {', '.join(sorted(_TOP))}.")
    return data


def _repeats(data: dict[str, Any], flag: int | None) -> int:
    value = flag if flag is not None else data.get("repeats", _table(data, "sweep").get("repeats", DEFAULT_REPEATS))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"repeats={value!r} is out of range", hint="Use an integer >= 1 (default 3).")
    return value


def _probe(data: dict[str, Any], command_line: str) -> ProbeConfig:
    budget = data.get("memory_budget")
    fields = _table(data, "probe")
    try:
        return ProbeConfig(workload=data["workload"], workload_options=_options(data), device=data.get("device", "auto"),
                           memory_budget_bytes=parse_bytes(budget, name="memory_budget") if budget else None,
                           command_line=command_line, **fields)
    except TypeError as exc:
        raise ConfigError(f"[probe] in the spec: {exc}", hint="Use the names of mbtune probe's options.") from None


def _sweep(data: dict[str, Any], command_line: str) -> SweepConfig:
    fields = {_SWEEP_NAMES.get(k, k): tuple(v) if isinstance(v, list) else v for k, v in _table(data, "sweep").items()}
    try:
        return SweepConfig(workload=data["workload"], workload_options=_options(data),
                           device=data.get("device", "auto"), command_line=command_line, **fields)
    except TypeError as exc:
        raise ConfigError(f"[sweep] in the spec: {exc}", hint="Use the names of mbtune sweep's options.") from None


def _table(data: dict[str, Any], name: str) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{name} in the spec must be a table", hint=f"Write it as [{name}].")
    return table


def _options(data: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(_table(data, "options").items()))
