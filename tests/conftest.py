from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Trial processes import fixture workloads by module name; they inherit this sys.path.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("COLUMNS", "120")


def _cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_visible():
        return
    skip = pytest.mark.skip(reason="no CUDA device is visible on this machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)

# Sweeps in the suite run each point once unless a test asks for more (or for None: until known); the
# stopping rule is tested on its own (tests/unit/test_stopping.py) and end to end where a test says so.
os.environ.setdefault("MBTUNE_REPEATS", "1")


_VALIDATOR = None


@pytest.fixture(autouse=True)
def _profiles_written_match_their_schema(request: pytest.FixtureRequest):
    """After each test that had a tmp_path: every profile under it that mbtune reads must also validate
    against the shipped JSON Schema (files a test broke on purpose, which the loader refuses, are skipped)."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    folder = request.getfixturevalue("tmp_path")
    yield
    import json

    from mbtune.saving.profiles import SCHEMA_VERSION, Profile

    global _VALIDATOR
    for path in folder.rglob("*.json"):
        try:
            if path.stat().st_size > 64 * 2**20:
                continue
            data = json.loads(path.read_text())
            if not (isinstance(data, dict) and data.get("schema_version") == SCHEMA_VERSION and "metadata" in data):
                continue
            Profile.from_dict(data)
        except Exception:
            continue  # not a profile, or one the loader refuses: not what mbtune wrote
        if _VALIDATOR is None:
            import jsonschema

            from mbtune.saving.profile_schema import shipped_schema

            _VALIDATOR = jsonschema.Draft202012Validator(shipped_schema())
        errors = sorted(_VALIDATOR.iter_errors(data), key=lambda e: list(e.absolute_path))
        assert not errors, f"{path} does not match its schema: {errors[0].message} at {list(errors[0].absolute_path)}"
