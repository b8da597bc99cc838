"""The profile format as a JSON Schema (draft 2020-12), for readers in other languages and CI validators.

The schema is derived from the records themselves, rule for rule as the loader (recordio.py) reads a file:
every record an object whose fields without a default are required and whose unknown keys are allowed (a
newer mbtune's additions); `X | None` accepts null; tuples are arrays (of one type, or of fixed length);
dicts are objects; floats are finite numbers; a field with fixed choices is an enum. The file ships as
mbtune/schemas/profile-v<schema_version>.schema.json, so a profile's `schema_version` names its schema;
`python docs/generate_profile_schema.py` writes it (the tests hold the shipped file to it). A qualification
history's schema (history-v<N>.schema.json) is derived the same way from its records.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from importlib import resources
from typing import Any

from mbtune.recordio import Record


def schema_file_name(version: int) -> str:
    return f"profile-v{version}.schema.json"


def profile_schema() -> dict[str, Any]:
    """The JSON Schema of a profile of this mbtune's schema version."""
    from mbtune.saving.profiles import SCHEMA_VERSION, Profile

    defs: dict[str, Any] = {}
    root = _record(Profile, defs)
    root["properties"]["schema_version"] = {"const": SCHEMA_VERSION}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://mbtune.dev/schemas/{schema_file_name(SCHEMA_VERSION)}",
            "title": f"mbtune profile, schema version {SCHEMA_VERSION}", **root, "$defs": defs}


def record_schema(root: Any, *, version_field: str, version: int, file_name: str, title: str) -> dict[str, Any]:
    """The JSON Schema of a versioned document whose root is the record class `root` (a qualification
    history's, qualifying/history.py), derived as the profile's is."""
    defs: dict[str, Any] = {}
    out = _record(root, defs)
    out["properties"][version_field] = {"const": version}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": f"https://mbtune.dev/schemas/{file_name}",
            "title": title, **out, "$defs": defs}


def shipped_file(file_name: str) -> dict[str, Any]:
    """A schema file shipped in the package."""
    return json.loads(resources.files("mbtune").joinpath("schemas", file_name).read_text())


def shipped_schema(version: int | None = None) -> dict[str, Any]:
    """The schema file shipped in the package for `version` (default: this mbtune's)."""
    from mbtune.saving.profiles import SCHEMA_VERSION

    name = schema_file_name(SCHEMA_VERSION if version is None else version)
    return json.loads(resources.files("mbtune").joinpath("schemas", name).read_text())


def _record(cls: Any, defs: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    properties, required = {}, []
    for f in dataclasses.fields(cls):
        prop = _type(hints[f.name], defs)
        choices = cls.field_choices(f.name)
        if choices is not None:
            prop = {"enum": list(choices)}
        properties[f.name] = prop
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    return out


def _type(hint: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_type(a, defs) for a in args if a is not type(None)]
        nullable = [{"type": "null"}] if type(None) in args else []
        return options[0] if len(options) == 1 and not nullable else {"anyOf": options + nullable}
    if hint is Any or hint is object:
        return {}
    if origin is tuple or hint is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type(args[0], defs)}
        return {"type": "array", "prefixItems": [_type(a, defs) for a in args], "items": False,
                "minItems": len(args)}
    if origin is dict or hint is dict:
        value = args[1] if args else Any
        return {"type": "object", "additionalProperties": _type(value, defs)}
    if isinstance(hint, type) and issubclass(hint, Record):
        name = hint.__name__
        if name not in defs:
            defs[name] = {}  # taken before recursing: a record may hold itself
            defs[name] = _record(hint, defs)
        return {"$ref": f"#/$defs/{name}"}
    scalars = {bool: {"type": "boolean"}, int: {"type": "integer"}, float: {"type": "number"},
               str: {"type": "string"}}
    return dict(scalars.get(hint, {}))


def schema_text(schema: dict[str, Any] | None = None) -> str:
    """A schema (the profile's by default) as the shipped file holds it."""
    return json.dumps(profile_schema() if schema is None else schema, indent=1) + "\n"
