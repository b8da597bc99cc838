"""The one validation helper: configs and specs check their fields here and raise ConfigError naming the
field, the value given (shortened) and what is expected. Flag names are not known here: the CLI turns a
field into its flag when it prints the error."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from mbtune.errors import ConfigError
from mbtune.recordio import shorten


def short(value: Any) -> str:
    """repr(value), shortened (see recordio.shorten) so a 100 KB value is not echoed whole."""
    return shorten(repr(value))


def require(condition: bool, field_name: str, value: object, valid: str) -> None:
    """Raise ConfigError for field_name unless condition holds."""
    if not condition:
        raise ConfigError(f"{field_name}={short(value)} is out of range: expected {valid}",
                          field=field_name, given=short(value), expected=valid)


def check_types(obj: Any) -> None:
    """Check each field of a dataclass instance against its annotation: int is not bool nor float, float
    accepts int and must be finite, str, bool, tuples item by item, Optional. Other annotations pass."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        expected = _mismatch(hints[f.name], value)
        if expected:
            raise ConfigError(f"{f.name}={short(value)} has the wrong type: expected {expected}",
                              field=f.name, given=short(value), expected=expected)


def _mismatch(hint: Any, value: Any) -> str | None:
    """None when value fits hint, else what was expected."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        found = [_mismatch(option, value) for option in options if option is not type(None)]
        return None if None in found else " or ".join(e for e in found if e) + (
            " or nothing" if type(None) in options else "")
    if origin is tuple:
        if not isinstance(value, tuple):
            return "a list"
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            for item in value:
                if inner := _mismatch(args[0], item):
                    return f"a list of which each is {inner}"
            return None
        if args and len(args) != len(value):
            return f"{len(args)} items"
        for inner_hint, item in zip(args, value):
            if inner := _mismatch(inner_hint, item):
                return f"items of which each is {inner}"
        return None
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else "a finite number"
    if hint is str:
        return None if isinstance(value, str) else "text"
    return None


def require_unique(values: tuple | None, field_name: str) -> None:
    """Refuse a list that names one entry twice (it would run one point twice)."""
    if values is None:
        return
    seen: set = set()
    twice = []
    for v in values:
        if v in seen:
            twice.append(v)
        seen.add(v)
    if twice:
        given = short(",".join(map(str, values)))
        raise ConfigError(f"{field_name}={given} names {twice[0]} twice (it would run the same points twice)",
                          field=field_name, given=given, expected="each entry once")
