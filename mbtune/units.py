"""Parsing what people write: sizes, durations, rates, lists, fractions, devices and KEY=VALUE options."""

from __future__ import annotations

import math
import re
from typing import Any, overload

from mbtune.errors import ConfigError
from mbtune.validation import require as _require
from mbtune.validation import short

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}


_DEVICE_RE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def parse_bytes(text: str, *, name: str = "memory size", at_most: int | None = None) -> int:
    """Parse '3GiB', '512MiB', '1.5G', '2e9' or a plain byte count into bytes (refused above `at_most`)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    number = float(match.group(1)) * _UNITS[unit] if match and unit in _UNITS else math.nan
    if not math.isfinite(number):
        raise ConfigError(
            f"{name} {short(text)} is not a size", hint="Write it like 3GiB, 512MiB, 2.5GB or a byte count."
        )
    value = int(number)
    if value <= 0:
        raise ConfigError(f"{name} {text!r} must be above zero", hint="Give a positive size such as 3GiB.")
    if at_most is not None and value > at_most:
        raise ConfigError(f"{name} {short(text)} is above {at_most / 2**50:g} PiB, more memory than any device or "
                          "host has", hint=f"Give {name} in GiB, such as 60GiB.")
    return value


def size_flag(size_bytes: int) -> str:
    """A byte count as a flag takes it back, exactly: 512MiB, 3GiB, 1536KiB or 1000 (bytes)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale}{unit}"
    return str(size_bytes)


def parse_device(text: str) -> str:
    """Normalise a device string ('auto', 'cpu', 'cuda', 'cuda:N'); presence is checked by device/."""
    match = _DEVICE_RE.fullmatch(str(text).strip().lower())
    if not match or (match.group(2) is not None and match.group(1) != "cuda"):
        raise ConfigError(
            f"device {text!r} is not recognised", hint="Use --device auto, cpu, cuda or cuda:N."
        )
    kind, index = match.groups()
    if kind == "cuda":
        return f"cuda:{int(index or 0)}"
    return kind


def parse_options(pairs: list[str] | tuple[str, ...]) -> tuple[tuple[str, int | float | str], ...]:
    """Parse KEY=VALUE workload options; numbers become int or float."""
    parsed: dict[str, int | float | str] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"workload option {pair!r} is not KEY=VALUE", hint="Write it like --option layers=4.")
        parsed[key.strip()] = _number_or_text(raw.strip())
    return tuple(sorted(parsed.items()))


def parse_duration(text: str, *, name: str) -> float:
    """'5us', '0.2ms', '1s', '3m' (minutes), '2h' or plain seconds -> seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(us|µs|ms|s|m|min|h|)\s*", str(text))
    if not match:
        raise ConfigError(f"{name} {text!r} is not a duration",
                          hint=f"Write it like {name} 5us, 0.2ms, 90s, 3m or 2h (plain numbers are seconds).")
    scale = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}[match.group(2)]
    return float(match.group(1)) * scale


def parse_rate(text: str, *, name: str) -> float:
    """'50GB/s', '400Gbit/s' or bytes per second -> bytes per second."""
    raw = str(text).strip()
    body = raw[:-2] if raw.lower().endswith("/s") else raw
    if body.lower().endswith(("gbit", "mbit")):
        return parse_bytes(body[:-3], name=name) / 8
    return float(parse_bytes(body, name=name))


@overload
def parse_list(text: str, *, name: str, convert: type = int) -> tuple[Any, ...]: ...
@overload
def parse_list(text: str | None, *, name: str, convert: type = int) -> tuple[Any, ...] | None: ...
def parse_list(text: str | None, *, name: str, convert: type = int) -> tuple[Any, ...] | None:
    """Parse a comma-separated list ('2,4,8'); None stays None (use the default)."""
    if text is None:
        return None
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    hint = f"Write it like {name} {list_example(name, convert)}."
    try:
        values = tuple(convert(item) for item in items)
    except ValueError:
        raise ConfigError(f"{name} {text!r} is not a comma-separated list", hint=hint) from None
    if not values:
        raise ConfigError(f"{name} is empty", hint=hint)
    return values


# A list flag's own example where its items are words or durations; numbers go by their type.
LIST_EXAMPLES = {"--schedules": "gpipe,1f1b", "--recompute": "none,full", "--queue-delays": "0,2ms,10ms",
                 "--rates": "100,200.5"}


def list_example(name: str, convert: type = int) -> str:
    """An example value of the list flag `name` (one its parser takes)."""
    return LIST_EXAMPLES.get(name) or {int: "2,4,8", float: "0.5,1,2"}.get(convert, "a,b")


def _number_or_text(raw: str) -> int | float | str:
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return raw


def parse_fraction(text: str | float, *, name: str) -> float:
    """'10%' or '0.1' -> 0.1."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ConfigError(f"{name} {text!r} is not a fraction", hint=f"Write it like {name} 10% or 0.1.") from None
    _require(0 <= value < 1, name.lstrip("-").replace("-", "_"), text, "0% to 99%")
    return value
