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
