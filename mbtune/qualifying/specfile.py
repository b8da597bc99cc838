"""Qualification specs from TOML files committed beside a CI job.

```toml
workload = "gpt"                 # built-in name or package.module:factory
device = "cuda"
memory_budget = "8GiB"
tolerance = "10%"                # against the baseline, when there is one
repeats = 3                      # runs of each sweep point, each in fresh processes (default: until known)
baseline = "profiles/cuda-nvidia-h200/gpt.json"   # optional; relative to this file

[options]                        # workload options
layers = 8

[probe]                          # any `mbtune probe` setting: margin, granularity, precision, ...
granularity = 8

[sweep]                          # stages, schedules, micro_batches, accum, micro_batch_size, global_batch,
                                 # data_parallel_size, steps
stages = 1
schedules = ["gpipe", "1f1b"]
micro_batches = [2, 4, 8]

[serve]                          # optional: run `mbtune serve` too (any of its settings)
p99 = "50ms"
max_batch_sizes = [8, 16]

[thresholds]                     # absolute bounds
min_rate_at_p99 = 200.0          # requests/s the best serving configuration sustains within [serve] p99
min_ceiling = 100
min_safe_batch = 85
min_best_samples_per_s = 1000.0
max_best_bubble = 0.5
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import tomllib
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from mbtune.errors import ConfigError
from mbtune.probing.config import ProbeConfig
from mbtune.qualifying.spec import SERVE_THRESHOLDS, THRESHOLD_KEYS, QualifySpec
from mbtune.records import RecordFieldError, load_value, short_repr, shorten
from mbtune.serving.config import ServeConfig
from mbtune.settings import FORMER_NAMES, build, param_for, setting_names
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.stopping import default_repeats
from mbtune.units import parse_fraction

if typing.TYPE_CHECKING:
    pass

# Each top-level key: the TOML types it may hold, and those in words.
_TOP: dict[str, tuple[type | tuple[type, ...], str]] = {
    "workload": (str, "a string"), "device": (str, "a string"), "memory_budget": ((str, int, float), "a size such as \"8GiB\""),
    "tolerance": ((str, int, float), "a share such as \"10%\" or 0.1"), "repeats": (int, "an integer"),
    "baseline": (str, "a path"), "options": (dict, "a table"), "probe": (dict, "a table"), "sweep": (dict, "a table"),
    "thresholds": (dict, "a table"), "serve": (dict, "a table"),
}
_SET_AT_THE_TOP = {"workload", "workload_options", "device", "memory_budget_bytes"}
_OPTION = int | float | str | bool  # a workload option's value
# Longer text is no name, size, device or schedule (nor path): refused before any message could echo it.
_TEXT_LIMIT = 256
_PATH_LIMIT = 4096
_PATHS = {"baseline"}


class LoadedSpec(NamedTuple):
    """A spec file read: what to run and hold it to, and how many runs each sweep point gets."""

    spec: QualifySpec
    repeats: int | None


def load_spec(path: Path, *, baseline: str | None = None, tolerance: float | None = None,
              allow_different_device: bool = False, command_line: str = "") -> QualifySpec:
    """Read a TOML spec; flags given on the command line win over the file."""
    return read_spec(path, baseline=baseline, tolerance=tolerance, allow_different_device=allow_different_device,
                     command_line=command_line).spec


def read_spec(path: Path | None, *, baseline: str | None = None, tolerance: float | None = None,
              repeats: int | None = None, allow_different_device: bool = False,
              command_line: str = "", said: Said = None) -> LoadedSpec:
    """Read a TOML spec and its repeats (the flag, else the file's `repeats` or [sweep] repeats, else None:
    each point measured until known);
    flags given on the command line win over the file. Every value is checked at this boundary: a wrong
    type, a non-table section or an unknown key is one ConfigError naming the file and the field. Without
    a file (`path` None), the flags alone: a baseline to re-run."""
    data = _read(path) if path is not None else {}
    path = path if path is not None else Path("(no spec)")  # nothing from a file can fail then
    if baseline is None and data.get("baseline"):
        baseline = str((Path(path).parent / data["baseline"]).resolve())
    repeats = _repeats(path, data, repeats)
    serve = _config("serve", path, data, command_line, said=said) if "serve" in data else None
    serving_only = serve is not None and not {"probe", "sweep"} & set(data) and set(
        _table(data, "thresholds")) <= set(SERVE_THRESHOLDS)
    probe = _config("probe", path, data, command_line, said=said) if "workload" in data and not serving_only else None
    sweep = _config("sweep", path, data, command_line, said=said) if probe and "sweep" in data else None
    if tolerance is None:
        with _named(path, "the top level"):
            tolerance = parse_fraction(data.get("tolerance", QualifySpec.tolerance), name="tolerance")
    spec = QualifySpec(
        baseline=baseline, probe=probe, sweep=dataclasses.replace(sweep, repeats=repeats) if sweep else None,
        tolerance=tolerance, thresholds=_thresholds(path, data), allow_different_device=allow_different_device,
        serve=serve,
    )
    return LoadedSpec(spec=spec, repeats=repeats)


def _read(path: Path) -> dict[str, Any]:
    """The file's TOML, its top-level keys known and of the right type."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"spec {path} does not exist", hint="Pass the path of a TOML file (a qualify.toml).") from None
    except OSError as exc:
        raise ConfigError(f"spec {path} is not readable: {exc.strerror or exc}", hint="Fix the file.") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"spec {path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                          hint="Save the file as UTF-8.") from None
    except RecursionError:
        raise ConfigError(f"spec {path} is not valid TOML: nested too deeply to parse", hint="Fix the file.") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"spec {path} is not valid TOML: {exc}", hint="Fix the file.") from None
    unknown = sorted(set(data) - set(_TOP))
    if unknown:
        raise ConfigError(f"spec {path} has unknown key(s) {_names(unknown)}; known: {', '.join(sorted(_TOP))}",
                          hint="Fix the key's name.")
    for key, value in data.items():
        if not isinstance(value, _TOP[key][0]) or isinstance(value, bool):
            hint = f"Write it as a [{key}] table." if _TOP[key][0] is dict else "Fix that value in the spec."
            raise ConfigError(f"spec {path}: {key} is {short_repr(value)}, expected {_TOP[key][1]}", hint=hint)
        _check_text(path, key, value)
    return data


def _repeats(path: Path, data: dict[str, Any], flag: int | None) -> int | None:
    value = flag if flag is not None else data.get("repeats", _table(data, "sweep").get("repeats", default_repeats()))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        said = f"--repeats {short_repr(value)}" if flag is not None else f"spec {path}: repeats={short_repr(value)}"
        raise ConfigError(f"{said} is out of range: expected an integer >= 1",
                          hint="Use an integer >= 1, or leave it out to measure each point until known.")
    return value


_SECTIONS: dict[str, type] = {"probe": ProbeConfig, "sweep": SweepConfig, "serve": ServeConfig}


def _config(section: str, path: Path, data: dict[str, Any], command_line: str,
            settings: dict[str, Any] | None = None, said: Said = None) -> Any:
    """The config of a [probe], [sweep] or [serve] table (with the top level's settings), through the door."""
    kind = _SECTIONS[section]
    settings = _settings(path, data, section, kind) if settings is None else settings
    with _named(path, section):
        if section == "serve" and "p99" not in settings:
            raise ConfigError(f"spec {path}: [serve] has no p99 budget", hint='Add p99 = "50ms" to [serve].')
        return build(kind, {**_top(path, data, kind), **settings}, said=_in_file(path, said),
                     command_line=command_line)


def _top(path: Path, data: dict[str, Any], config: type) -> dict[str, Any]:
    """The settings the spec gives at its top level (workload, device, memory_budget, [options]) that
    `config` takes."""
    names = setting_names(config)
    top: dict[str, Any] = {key: data[key] for key in ("workload", "device", "memory_budget") if key in data and key in names}
    return {**top, "options": _options(path, data)}


def read_settings(path: Path, command: str) -> dict[str, Any]:
    """A settings file for probe, sweep or tune (`--config`: the spec's schema, its qualify-only keys unused)
    as that command's option values by parameter name, every value checked as a spec's is. The command
    line's flags win over them (they fill click's default_map). In tune the probe's `steps` are
    `probe_steps`; a setting both tables give must agree, since tune takes it once."""
    data = _read(path)
    values: dict[str, Any] = {key: str(data[key]) for key in ("workload", "device", "memory_budget") if key in data}
    if "options" in data:
        values["option"] = [f"{key}={value}" for key, value in _options(path, data)]
    if command in ("sweep", "tune") and "repeats" in data:
        values["repeats"] = _repeats(path, data, None)
    sections = {"probe": ("probe", "tune"), "sweep": ("sweep", "tune")}
    setters: dict[str, str] = {}  # parameter -> the table that set it
    for section, commands in sections.items():
        if command not in commands or section not in data:
            continue
        config = ProbeConfig if section == "probe" else SweepConfig
        settings = _settings(path, data, section, config)
        # The whole config checks out (the command notes a former name when it builds its own).
        _config(section, path, data, "", settings, said=_silent)
        for name, value in settings.items():
            param = "probe_steps" if (command, section, name) == ("tune", "probe", "steps") else name
            shown = ",".join(map(str, value)) if isinstance(value, list | tuple) else value
            if param in setters and values[param] != shown:
                raise ConfigError(f"spec {path}: [{setters[param]}] and [{section}] set {param} differently "
                                  f"({short_repr(values[param])} and {short_repr(shown)}), and tune takes it once",
                                  hint="Set it in one of the two tables.")
            values[param], setters[param] = shown, section
    return values


Said = Callable[[str], None] | None  # who hears that a setting was given by its former name (None: a warning)


def _in_file(path: Path, said: Said) -> Said:
    return None if said is None else (lambda line: said(f"spec {path}: {line}"))


def _silent(line: str) -> None:
    pass


def _settings(path: Path, data: dict[str, Any], section: str, config: type) -> dict[str, Any]:
    """A [probe], [sweep] or [serve] table as settings by name, each value checked against the config
    field's type (a string where a list belongs is refused, not split; a size or duration may be text,
    "8GiB" or "50ms", which the config's door reads). A key is the flag's name, with underscores or dashes
    (`accum`, `trial_timeout` or `trial-timeout`)."""
    names = {name: field for name, field in setting_names(config).items() if field not in _SET_AT_THE_TOP}
    hints = typing.get_type_hints(config)
    settings: dict[str, Any] = {}
    keys: dict[str, str] = {}  # setting -> the key that set it
    unknown = []
    for key, value in _table(data, section).items():
        former = key.replace("-", "_") if key.replace("-", "_") in FORMER_NAMES else None
        current = FORMER_NAMES[former] if former else key.replace("-", "_")
        field = names.get(current)
        if field is None or current != param_for(field):
            unknown.append(key)
            continue
        name = former or param_for(field)  # a former name goes on to the door, which says the new one
        if param_for(field) in keys:
            raise ConfigError(f"spec {path}: [{section}] sets {param_for(field)} twice, as {keys[param_for(field)]} "
                              f"and as {key}", hint="Keep one of them.")
        keys[param_for(field)] = key
        if field in _ONE_OR_MORE and isinstance(value, int | str) and not isinstance(value, bool) and _is_list(hints[field]):
            value = [value]  # one value, as specs wrote it before lists
        settings[name] = _value(path, f"[{section}] {key}", hints[field], value, read_by_door=_read_by_the_door(field))
    if unknown:
        known = sorted({param_for(field) for field in names.values()})
        raise ConfigError(f"[{section}] in the spec {path} has unknown key(s) {_names(unknown)}; known: "
                          f"{', '.join(known)}", hint="Fix the key's name.")
    return settings


def _read_by_the_door(field: str) -> bool:
    """Whether a field's value may be written as text that the door reads: a size, a duration, a rate."""
    return field.endswith(("_bytes", "_s"))


# Settings that took one value before they took lists: a single value is a list of one.
_ONE_OR_MORE = ("global_batch", "micro_batch_size", "data_parallel_size", "recompute")


def _is_list(hint: Any) -> bool:
    """Whether a field's type is a tuple (or an optional one)."""
    return typing.get_origin(hint) is tuple or any(typing.get_origin(a) is tuple for a in typing.get_args(hint))


def _value(path: Path, where: str, hint: Any, value: Any, *, read_by_door: bool = False) -> Any:
    if read_by_door and (isinstance(value, str) or (isinstance(value, list) and any(isinstance(v, str) for v in value))):
        _check_text(path, where, value)
        return value
    args = typing.get_args(hint)
    if type(None) in args:  # TOML has no null: an optional setting is one left out
        options = tuple(a for a in args if a is not type(None))
        hint = options[0] if len(options) == 1 else typing.Union[options]  # noqa: UP007 - built at run time from a tuple
    _check_text(path, where, value)
    try:
        return load_value(hint, value, path=where)
    except RecordFieldError as exc:
        fix = "Fix that value in the spec."
        if not isinstance(value, (list, dict)) and typing.get_origin(hint) is tuple:
            fix = f"A list is written in brackets, even of one item: [{short_repr(value)}]."
        raise ConfigError(f"spec {path}: {exc}", hint=fix) from None


def _thresholds(path: Path, data: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    table = _table(data, "thresholds")
    unknown = [k for k in table if k not in THRESHOLD_KEYS]
    if unknown:
        raise ConfigError(f"[thresholds] in the spec {path} has unknown key(s) {_names(unknown)}; known: "
                          f"{', '.join(THRESHOLD_KEYS)}", hint="Fix the key's name.")
    return tuple(sorted((k, _value(path, f"[thresholds] {k}", float, v)) for k, v in table.items()))


def _options(path: Path, data: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, _value(path, f"[options] {k}", _OPTION, v)) for k, v in _table(data, "options").items()))


def _table(data: dict[str, Any], name: str) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{name} in the spec is {short_repr(table)}, expected a table", hint=f"Write it as [{name}].")
    return table


def _check_text(path: Path, where: str, value: Any) -> None:
    """Refuse absurdly long text (no name, size or schedule is that long) before any message echoes it."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check_text(path, f"{where}[{index}]", item)
    elif isinstance(value, str) and len(value) > (limit := _PATH_LIMIT if where in _PATHS else _TEXT_LIMIT):
        raise ConfigError(f"spec {path}: {where} is {short_repr(value)} ({len(value)} characters), expected at most "
                          f"{limit}", hint="Fix that value in the spec.")


def _names(keys: list[str]) -> str:
    shown = ", ".join(shorten(str(k)) for k in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


@contextlib.contextmanager
def _named(path: Path, section: str) -> Iterator[None]:
    """Say which file a config's own range check refers to, and where in it to fix it."""
    try:
        yield
    except ConfigError as exc:
        where = section if section.startswith("the ") else f"the top level or [{section}]"
        # A config's own hint may name a command-line flag; this value came from the file.
        hint = exc.hint if exc.hint and not exc.hint.startswith("Fix --") else f"Fix it in the spec ({where})."
        message = exc.message if exc.message.startswith(f"spec {path}") else f"spec {path}: {exc.message}"
        raise ConfigError(message, hint=hint, given=exc.given, expected=exc.expected) from None
