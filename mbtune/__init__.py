"""mbtune: profile real hardware to find the best batch configuration for pipeline-parallel training.

The Python API (imported on first use, so `import mbtune` stays fast): mbtune.probe, mbtune.sweep,
mbtune.tune, mbtune.plan, mbtune.serve and mbtune.load_profile; see mbtune.api.
"""

from __future__ import annotations

import logging
from typing import Any

from mbtune.version import __version__

logging.getLogger("mbtune").addHandler(logging.NullHandler())  # the application (the CLI's -v) decides
__all__ = ["__version__", "load_profile", "plan", "probe", "serve", "sweep", "tune"]
_API = {"probe", "sweep", "tune", "plan", "serve", "load_profile"}


def __getattr__(name: str) -> Any:
    if name in _API:
        from mbtune import api

        return getattr(api, name)
    raise AttributeError(f"module 'mbtune' has no attribute {name!r}")
