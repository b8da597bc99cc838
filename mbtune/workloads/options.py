"""Workload options (KEY=VALUE) converted to the types the factory's parameters are annotated with.

On the command line every value is text, read as a number where it looks like one (units.parse_options).
A factory `def f(bias: bool = True, width: int = 8, lr: float = 0.1)` given `bias=false` must get False,
not the text "false" (which is truthy): each annotated bool, int, float or str parameter (or an optional
one, where `none` is None) gets its value converted, and a value that does not convert is bad input naming
the option and the type expected. Unannotated parameters, and other annotations, get the value as given.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from collections.abc import Callable
from typing import Any

from mbtune.errors import WorkloadError
from mbtune.recordio import shorten

TRUE, FALSE = ("true", "yes", "1"), ("false", "no", "0")
_EXPECTED = {bool: "true or false (yes/no, 1/0)", int: "an integer", float: "a number", str: "text"}


def convert_options(name: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs with each value converted to its parameter's annotated type (see the module docstring)."""
    try:
        hints = typing.get_type_hints(factory)
    except Exception:  # noqa: BLE001 - annotations that do not resolve: values as given
        hints = {}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return kwargs
    converted = {}
    for key, value in kwargs.items():
        hint = hints.get(key)
        converted[key] = value if hint is None else _convert(name, key, value, hint, params.get(key))
    return converted


def _convert(name: str, key: str, value: Any, hint: Any, param: inspect.Parameter | None) -> Any:
    kinds = [hint]
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        optional = type(None) in args
        kinds = [a for a in args if a is not type(None)]
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() == "none")):
        return None
    if not all(kind in _EXPECTED for kind in kinds):
        return value  # an annotation this does not convert to (Literal, a class...): as given
    if any(type(value) is kind for kind in kinds):
        return value
    for kind in kinds:
        ok, result = _to(kind, value)
        if ok:
            return result
    expected = " or ".join(_EXPECTED[kind] for kind in kinds) + (" or none" if optional else "")
    default = "" if param is None or param.default is inspect.Parameter.empty else f"; its default is {param.default!r}"
    raise WorkloadError(f"workload {name!r}: option {key}={shorten(str(value))} is not {expected}",
                        hint=f"The factory annotates {key} as {_spelled(hint)}{default}.")


def _spelled(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _to(kind: type, value: Any) -> tuple[bool, Any]:
    """(True, value as kind) or (False, None) when it does not convert."""
    if kind is bool:
        text = str(value).strip().lower() if isinstance(value, str | int) and not isinstance(value, bool) else ""
        return (True, True) if text in TRUE else (True, False) if text in FALSE else (False, None)
    if isinstance(value, bool):
        return False, None  # True is no number
    if kind is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return True, int(value)
        return _parsed(int, value) if isinstance(value, str) else (False, None)
    if kind is float:
        if isinstance(value, int):
            return True, float(value)
        return _parsed(float, value) if isinstance(value, str) else (False, None)
    return (True, str(value)) if isinstance(value, int | float) else (False, None)


def _parsed(kind: type, text: str) -> tuple[bool, Any]:
    try:
        return True, kind(text.strip())
    except ValueError:
        return False, None
