"""The loader every record shares: lossless to_dict, and from_dict that checks each value read from a
file against its field's type and names the field by its path when it does not fit. No torch import."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import types
import typing
from typing import Any


class Record:
    """Mixin: lossless to_dict/from_dict for frozen dataclasses of plain values, tuples and records."""

    if typing.TYPE_CHECKING:  # every Record is a dataclass; this tells the type checker so
        __dataclass_fields__: typing.ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _dump(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __repr__(self) -> str:
        """A short repr (records that hold many trials or actions would print pages): plain fields as they
        are, lists by their length, nested records by their name."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple) and (len(value) > 3 or any(isinstance(v, Record) for v in value)):
                parts.append(f"{f.name}=<{len(value)} items>")
            elif isinstance(value, Record):
                parts.append(f"{f.name}={type(value).__name__}(...)")
            elif isinstance(value, str) and len(value) > 40:
                parts.append(f"{f.name}={value[:37]!r}...")
            elif value not in (None, "", (), {}):
                parts.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def to_frame(self) -> Any:
        """A pandas DataFrame: one row per item of the record's main list (a probe's trials, a sweep's
        results), nested fields flattened to dotted columns; a record without one is one row."""
        import pandas

        items = getattr(self, self.FRAME_ROWS) if self.FRAME_ROWS else (self,)
        return pandas.json_normalize([item.to_dict() if isinstance(item, Record) else item for item in items])

    FRAME_ROWS: typing.ClassVar[str] = ""  # the field whose items are the frame's rows
    # A field's former name -> its name: what an older mbtune wrote (a profile, a journal) still loads.
    FORMER_NAMES: typing.ClassVar[dict[str, str]] = {}

    @classmethod
    def field_choices(cls, name: str) -> tuple[str, ...] | None:
        """The fixed set a field's value must come from (None: any value of its type). Records with such
        fields override this; it is read at load time, so later additions count."""
        return None

    @classmethod
    def from_dict(cls, data: object, *, path: str = "") -> Any:
        """Build the record from plain data (parsed JSON), checking every value against its field's type.
        Unknown keys are ignored (a newer mbtune's additions); anything else that does not fit raises
        RecordFieldError naming the field by its path from `path` (e.g. trials[3].status)."""
        return _load_record(cls, data, path, 0)


MAX_DEPTH = 64  # far deeper than any record nests: deeper input is refused rather than recursed into
_SHORT = 60  # the most of a value an error message echoes


class RecordFieldError(ValueError):
    """A value read into a record does not fit its field; path names the field (trials[3].status)."""

    def __init__(self, path: str, problem: str, *, expected: str = "") -> None:
        self.path = path or "the document"
        self.problem = problem
        self.expected = expected  # what would have fitted, when the value was of the wrong kind
        super().__init__(f"{shorten(self.path, 2 * _SHORT)} {problem}")


def shorten(text: str, limit: int = _SHORT) -> str:
    """text, cut to at most limit characters with an ellipsis in the middle when longer."""
    if len(text) <= limit:
        return text
    keep = max(limit - 3, 2)
    return f"{text[: keep - keep // 3]}...{text[len(text) - keep // 3:]}"


def short_repr(value: Any, limit: int = _SHORT) -> str:
    """value as JSON would spell it (Python's repr where JSON cannot), shortened for an error message."""
    if isinstance(value, str) and len(value) > limit:
        value = value[: 2 * limit]  # no need to encode 100 KB to show 60 characters of it
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(value)
        except (ValueError, RecursionError):
            text = f"a {type(value).__name__}"
    return shorten(text, limit)


def load_value(hint: Any, value: Any, *, path: str) -> Any:
    """value checked against a type hint as from_dict checks a field (lists become tuples); raises
    RecordFieldError naming path."""
    return _load(hint, value, path, 0)


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN: a diverged loss is saved as unknown, so the file stays readable
    return value


def _load_record(cls: Any, data: Any, path: str, depth: int) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise _refused(path, data, "an object")
    for former, name in cls.FORMER_NAMES.items():
        if former in data and name not in data:
            data = {**{k: v for k, v in data.items() if k != former}, name: data[former]}
    hints, kwargs = _hints(cls), {}
    for f in dataclasses.fields(cls):
        where = _join(path, f.name)
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecordFieldError(where, f"is missing, expected {_describe(hints[f.name])}")
            continue
        value = _load(hints[f.name], data[f.name], where, depth + 1)
        choices = cls.field_choices(f.name)
        if choices is not None and value not in choices:
            raise _refused(where, value, "one of " + ", ".join(c or '""' for c in choices))
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # the record's own checks
        if isinstance(exc, RecordFieldError):
            raise
        raise RecordFieldError(path, f"is refused as {cls.__name__}: {getattr(exc, 'message', str(exc))}") from None


def _load(hint: Any, value: Any, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise RecordFieldError(path, f"is nested more than {MAX_DEPTH} levels deep")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _load_union(hint, value, path, depth)
    if hint is Any or hint is object:
        return _load_plain(value, path, depth)
    if value is None:
        raise _refused(path, value, _describe(hint))
    if origin is tuple or hint is tuple:
        return _load_tuple(hint, value, path, depth)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise _refused(path, value, "an object")
        key_hint, item_hint = typing.get_args(hint) or (Any, Any)
        for key in value:
            if key_hint is str and not isinstance(key, str):
                raise _refused(f"{path} key", key, "a string")
        return {k: _load(item_hint, v, _join(path, str(k)), depth + 1) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Record):
        return _load_record(hint, value, path, depth)
    return _load_scalar(hint, value, path)


def _load_union(hint: Any, value: Any, path: str, depth: int) -> Any:
    args = typing.get_args(hint)
    if value is None:
        if type(None) in args:
            return None
        raise _refused(path, value, _describe(hint))
    options = [a for a in args if a is not type(None)]
    for option in options:
        try:
            return _load(option, value, path, depth)
        except RecordFieldError as exc:
            # With one option, a field inside the value (or a value nested too deep) is the one to name; a
            # value of the wrong kind is named with all that would have fitted ("an integer or null").
            if len(options) == 1 and (exc.path != (path or "the document") or not exc.expected):
                raise
    raise _refused(path, value, _describe(hint))


def _load_tuple(hint: Any, value: Any, path: str, depth: int) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise _refused(path, value, _describe(hint))
    args = typing.get_args(hint)
    if not args:
        items: tuple = (Any,) * len(value)
    elif len(args) == 2 and args[1] is Ellipsis:
        items = (args[0],) * len(value)
    elif len(args) != len(value):
        raise _refused(path, value, f"a list of {len(args)} items")
    else:
        items = args
    return tuple(_load(h, v, f"{path}[{i}]", depth + 1) for i, (h, v) in enumerate(zip(items, value)))


def _load_scalar(hint: Any, value: Any, path: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
    elif hint is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if math.isfinite(number):
                return number
            raise _refused(path, value, "a finite number")
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        return value  # a hint this loader does not know: taken as given
    raise _refused(path, value, _describe(hint))


def _load_plain(value: Any, path: str, depth: int) -> Any:
    """Free-form content (dict[str, Any] fields): any JSON value, but no NaN and no absurd nesting."""
    if depth > MAX_DEPTH:
        raise RecordFieldError(path, f"is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, float) and not math.isfinite(value):
        raise _refused(path, value, "a finite number")
    if isinstance(value, dict):
        return {k: _load_plain(v, _join(path, str(k)), depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_load_plain(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
    return value


_NAMES = {bool: ("true or false", "booleans"), int: ("an integer", "integers"),
          float: ("a finite number", "finite numbers"), str: ("a string", "strings")}


def _describe(hint: Any, plural: bool = False) -> str:
    """What a hint expects, in words: 'an integer or null', 'a list of strings'."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        words = [_describe(a, plural) for a in args if a is not type(None)] + (["null"] * (type(None) in args))
        return " or ".join(words) if len(words) < 3 else f"{', '.join(words[:-1])} or {words[-1]}"
    if origin is tuple or hint is tuple:
        items = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return "lists" if plural else f"a list of {_describe(items[0], True)}" if len(set(items)) == 1 else "a list"
    if origin is dict or hint is dict or (isinstance(hint, type) and issubclass(hint, Record)):
        return "objects" if plural else "an object"
    if hint in _NAMES:
        return _NAMES[hint][plural]
    return "values" if plural else "a value"


def _refused(path: str, value: Any, expected: str) -> RecordFieldError:
    return RecordFieldError(path, f"is {short_repr(value)}, expected {expected}", expected=expected)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)
