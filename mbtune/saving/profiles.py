"""Versioned profile files under profiles/<device-slug>/<workload>.json: save atomically, load strictly."""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import platform
import re
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from mbtune.atomic import write_atomic
from mbtune.errors import EXIT_COULD_NOT_RUN, ProfileError
from mbtune.probing.records import ProbeResult
from mbtune.recordio import (
    Record,
    RecordFieldError,
    short_repr,
)
from mbtune.records import DeviceInfo
from mbtune.serving.records import ServeReport
from mbtune.sweeping.records import SweepReport
from mbtune.version import __version__

# Schema versions this mbtune reads, and the step that upgrades each older one. A field added with a
# default needs no more than the version bump; a renamed or restructured one needs a real step.
OLDEST_READABLE_SCHEMA = 1
MIGRATIONS: dict[int, Callable[[dict], dict]] = {
    1: lambda data: {**data, "schema_version": 2, "serve": None},  # 2 adds `serve`: version 1 had none
    2: lambda data: _to_3(data),
    # 4: a point's micro-batch count is `num_micro_batches` (was `num_microbatches`), read by its former name
    # too (SweepPoint.FORMER_NAMES), in profiles and journals alike.
    3: lambda data: {**data, "schema_version": 4},
}
# 3: a point's ranks are `num_ranks` (was `num_stages`) and its model stages per rank `stages_per_rank` (was
# `virtual_stages`); a sweep records the precision, optimizer and learning rate it trained with.
_POINT_RENAMES = {"num_stages": "num_ranks", "virtual_stages": "stages_per_rank"}


def _to_3(data: dict) -> dict:
    """Version 2 -> 3: points renamed; the sweep's precision and optimizer are the probe's (a version 2
    sweep trained with those; without a probe, fp32 and adamw, the defaults), its learning rate unknown."""
    sweep = data.get("sweep")
    if isinstance(sweep, dict):
        probe = data["probe"] if isinstance(data.get("probe"), dict) else {}
        sweep = {**sweep, "precision": probe.get("precision", "fp32"), "optimizer": probe.get("optimizer", "adamw")}
        for section in ("results", "skipped"):
            if isinstance(sweep.get(section), list):
                sweep[section] = [_point_renamed(row) for row in sweep[section]]
        if isinstance(sweep.get("check"), dict):
            sweep["check"] = _point_renamed(sweep["check"])
    return {**data, "schema_version": 3, "sweep": sweep}


def _point_renamed(row: object) -> object:
    """A record holding a `point`, with the point's fields under their version 3 names."""
    if not isinstance(row, dict) or not isinstance(row.get("point"), dict):
        return row
    return {**row, "point": {_POINT_RENAMES.get(k, k): v for k, v in row["point"].items()}}

# Settings that move the memory ceiling; recorded so a profile says what it was measured under.
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "GLIBC_TUNABLES", "MALLOC_ARENA_MAX",
                 "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS", "LD_PRELOAD")


def slug(text: str) -> str:
    """A file-name-safe, lower-case form of a device or workload name."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unnamed"


def device_slug(device: DeviceInfo) -> str:
    name = slug(device.name)
    return name if name.startswith(device.backend) else f"{device.backend}-{name}"


def profile_path(root: str | Path, device: DeviceInfo, workload: str) -> Path:
    return Path(root) / device_slug(device) / f"{slug(workload)}.json"


def collect_metadata(command_line: str, torch_version: str) -> Metadata:
    """The environment this process runs in."""
    return Metadata(
        mbtune_version=__version__, torch_version=torch_version, python_version=platform.python_version(),
        host=socket.gethostname(), platform=platform.platform(), command_line=command_line,
        created_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        allocator_settings={k: os.environ[k] for k in ALLOCATOR_ENV if k in os.environ},
    )


def save_results(root: Path, device: DeviceInfo, workload: str, command_line: str, *,
                 probe: ProbeResult | None = None, sweep: SweepReport | None = None,
                 serve: ServeReport | None = None) -> Path:
    """Write results into their profile, keeping the sections of an existing valid profile that this run
    did not produce. A profile that cannot be read is never overwritten: the results go beside it."""
    path = profile_path(root, device, workload)
    existing = None
    if path.exists():
        try:
            existing = load_profile(path)
        except ProfileError:
            stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
            path = path.with_name(f"{path.stem}.{stamp}.json")
    profile = Profile(
        schema_version=SCHEMA_VERSION, metadata=collect_metadata(command_line, device.torch_version),
        probe=probe if probe is not None else (existing.probe if existing else None),
        sweep=sweep if sweep is not None else (existing.sweep if existing else None),
        serve=serve if serve is not None else (existing.serve if existing else None),
    )
    write_profile(path, profile)
    return path


def save_probe(root: Path, probe: ProbeResult, command_line: str) -> Path:
    """Write the probe and the environment it ran in to its profile; returns the path."""
    return save_results(root, probe.device, probe.workload, command_line, probe=probe)


def write_profile(path: Path, profile: Profile) -> None:
    """Atomic write (mbtune.atomic): readers see the old profile or the new one, never a part."""
    path = Path(path)
    try:
        write_atomic(path, json.dumps(profile.to_dict(), indent=2, sort_keys=False) + "\n")
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the machine's fault, not the input's: exit 3
            error = ProfileError(f"cannot write profile {path}: {exc.strerror or exc}",
                                 hint="The journal keeps every trial: free space, rerun with --resume.")
            error.exit_code = EXIT_COULD_NOT_RUN
            raise error from exc
        raise ProfileError(f"cannot write profile {path}: {exc.strerror or exc}",
                           hint="Choose a writable folder with --profiles-dir.") from exc


_CORRUPT = "Fix that field or re-run the probe."


def load_profile(path: str | Path) -> Profile:
    """Read a profile, refusing missing, corrupt, mistyped and unknown-schema files with one line that names
    the file and the field (e.g. probe.trials[3].status), what it holds and what was expected."""
    path = Path(path)
    data = _document(path, _read_json(path))
    version = _schema_version(path, data)
    try:
        return Profile.from_dict(migrate(data))
    except RecordFieldError as exc:
        raise ProfileError(f"profile {path}: {exc}", hint=_CORRUPT) from exc
    except (TypeError, KeyError, ValueError, AttributeError, RecursionError) as exc:  # a migration step's
        raise ProfileError(f"profile {path} does not match schema version {version}: {exc}",
                           hint="The file is corrupt; re-run the probe to write a new one.") from exc


def _read_json(path: Path) -> object:
    if path.is_dir():
        raise ProfileError(f"profile {path} is a folder", hint="Pass a profile file, e.g. profiles/<device>/<workload>.json.")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError as exc:
        raise ProfileError(f"profile {path} does not exist", hint="Pass a file under profiles/.") from exc
    except RecursionError:
        raise ProfileError(f"profile {path} is not readable JSON (nested too deeply to parse)",
                           hint="The file is corrupt; re-run the probe to write a new one.") from None
    except (OSError, ValueError) as exc:  # ValueError: bad JSON, bad UTF-8, a number past int's digit limit
        raise ProfileError(f"profile {path} is not readable JSON ({exc})",
                           hint="The file is corrupt; re-run the probe to write a new one.") from exc


def _document(path: Path, data: object) -> dict[str, Any]:
    """The parsed file, refusing a document that is not a JSON object."""
    if not isinstance(data, dict):
        raise ProfileError(f"{path} is not an mbtune profile: the document is {short_repr(data)}, expected an "
                           "object", hint="Pass a file written by mbtune probe, sweep or tune.")
    return data


def _schema_version(path: Path, data: dict[str, Any]) -> int:
    """The file's schema version, refusing what is not a profile or is of a schema this mbtune cannot read."""
    if "schema_version" not in data:
        raise ProfileError(f"{path} is not an mbtune profile (no schema_version)")
    version = data["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProfileError(f"profile {path}: schema_version is {short_repr(version)}, expected an integer",
                           hint=_CORRUPT)
    if version > SCHEMA_VERSION:
        raise ProfileError(f"profile {path} has schema version {short_repr(version)}, newer than this mbtune reads "
                           f"({SCHEMA_VERSION})", hint="Upgrade mbtune to read it.")
    if version < OLDEST_READABLE_SCHEMA:
        raise ProfileError(f"profile {path} has schema version {short_repr(version)}, older than this mbtune reads "
                           f"({OLDEST_READABLE_SCHEMA}-{SCHEMA_VERSION})", hint="Re-run the probe to write a new one.")
    return version


def migrate(data: dict) -> dict:
    """Bring a profile's dict up to SCHEMA_VERSION one version at a time (MIGRATIONS[v] turns v into v+1)."""
    while data["schema_version"] < SCHEMA_VERSION:
        data = MIGRATIONS[data["schema_version"]](dict(data))
    return data


def command_line() -> str:
    return " ".join(["mbtune", *sys.argv[1:]])


# 2: a profile may hold `serve` (mbtune serve's report); version 1 files read as having none.
# 3: points name ranks `num_ranks` and model stages per rank `stages_per_rank`; a sweep records its precision,
# optimizer and learning rate (see MIGRATIONS).
# 4: a point's micro-batch count is `num_micro_batches`, named as its flag is (--micro-batches).
SCHEMA_VERSION = 4


@dataclass(frozen=True, kw_only=True)
class Metadata(Record):
    """The environment a profile was measured in."""

    mbtune_version: str
    torch_version: str
    python_version: str
    host: str
    platform: str
    command_line: str
    created_at: str
    allocator_settings: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Profile(Record):
    """The versioned file saved under profiles/<device>/<workload>.json."""

    __repr__ = Record.__repr__  # short: the dataclass one prints every trial and action

    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    schema_version: int
    metadata: Metadata
    probe: ProbeResult | None = None
    sweep: SweepReport | None = None
    serve: ServeReport | None = None
