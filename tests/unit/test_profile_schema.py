"""The profile's JSON Schema: shipped in the package under its schema version, the same as the records
give, a valid draft 2020-12 schema, and strict where the loader is (every profile the suite writes is
validated against it by tests/conftest.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mbtune.saving.profile_schema import profile_schema, schema_file_name, shipped_schema
from mbtune.saving.profiles import SCHEMA_VERSION, Profile
from tests.unit.test_qualify import sample_probe, sweep_report


def test_the_shipped_schema_is_the_one_the_records_give():
    assert shipped_schema() == json.loads(json.dumps(profile_schema()))
    assert schema_file_name(SCHEMA_VERSION) == f"profile-v{SCHEMA_VERSION}.schema.json"
    jsonschema.Draft202012Validator.check_schema(shipped_schema())


def profile() -> dict:
    from mbtune.saving.profiles import Metadata

    metadata = Metadata(mbtune_version="0", torch_version="2", python_version="3.11", host="h", platform="p",
                        command_line="mbtune tune", created_at="2026-12-04T10:00:00")
    return json.loads(json.dumps(Profile(schema_version=SCHEMA_VERSION, metadata=metadata, probe=sample_probe(),
                                         sweep=sweep_report()).to_dict()))


def test_a_profile_validates_and_what_the_loader_refuses_does_not():
    validator = jsonschema.Draft202012Validator(shipped_schema())
    good = profile()
    validator.validate(good)
    Profile.from_dict(good)
    for broken in (
        {**good, "schema_version": SCHEMA_VERSION + 1},
        {**good, "probe": {**good["probe"], "ceiling": "64"}},
        {**good, "metadata": {k: v for k, v in good["metadata"].items() if k != "host"}},
        {**good, "sweep": {**good["sweep"], "results": [{**good["sweep"]["results"][0], "status": "maybe"}]}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(broken)
