"""Versioned profile files under profiles/<device-slug>/<workload>.json: save atomically, load strictly."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from mbtune import __version__
from mbtune.errors import ProfileError
from mbtune.records import SCHEMA_VERSION, DeviceInfo, Metadata, ProbeResult, Profile, SweepReport

# Schema versions this mbtune reads, and the step that upgrades each older one (none yet: version 1 is
# the first). A field added with a default needs no step; a renamed or restructured one does.
OLDEST_READABLE_SCHEMA = 1
MIGRATIONS: dict[int, Callable[[dict], dict]] = {}

# Settings that move the memory ceiling; recorded so a profile says what it was measured under.
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "GLIBC_TUNABLES", "MALLOC_ARENA_MAX",
                 "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS", "LD_PRELOAD")


def slug(text: str) -> str:
    """A file-name-safe, lower-case form of a device or workload name."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unnamed"


def device_slug(device: DeviceInfo) -> str:
    name = slug(device.name)
    return name if name.startswith(device.backend) else f"{device.backend}-{name}"


def profile_path(root: Path, device: DeviceInfo, workload: str) -> Path:
    return Path(root) / device_slug(device) / f"{slug(workload)}.json"


def collect_metadata(command_line: str, torch_version: str) -> Metadata:
    """The environment this process runs in."""
    return Metadata(
        mbtune_version=__version__, torch_version=torch_version, python_version=platform.python_version(),
        host=socket.gethostname(), platform=platform.platform(), command_line=command_line,
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        allocator_settings={k: os.environ[k] for k in ALLOCATOR_ENV if k in os.environ},
    )


def save_results(root: Path, device: DeviceInfo, workload: str, command_line: str, *,
                 probe: ProbeResult | None = None, sweep: SweepReport | None = None) -> Path:
    """Write results into their profile, keeping the sections of an existing valid profile that this run
    did not produce. A profile that cannot be read is never overwritten: the results go beside it."""
    path = profile_path(root, device, workload)
    existing = None
    if path.exists():
        try:
            existing = load_profile(path)
        except ProfileError:
            stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            path = path.with_name(f"{path.stem}.{stamp}.json")
    profile = Profile(
        schema_version=SCHEMA_VERSION, metadata=collect_metadata(command_line, device.torch_version),
        probe=probe if probe is not None else (existing.probe if existing else None),
        sweep=sweep if sweep is not None else (existing.sweep if existing else None),
    )
    write_profile(path, profile)
    return path


def save_probe(root: Path, probe: ProbeResult, command_line: str) -> Path:
    """Write the probe and the environment it ran in to its profile; returns the path."""
    return save_results(root, probe.device, probe.workload, command_line, probe=probe)


def write_profile(path: Path, profile: Profile) -> None:
    """Atomic write: a temporary file in the same folder, fsync, then rename over the target."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise ProfileError(f"cannot write profile {path}: {exc.strerror or exc}",
                           hint="Choose a writable folder with --profiles-dir.") from exc
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(profile.to_dict(), handle, indent=2, sort_keys=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_profile(path: Path) -> Profile:
    """Read a profile, refusing missing, corrupt and unknown-schema files with a clear message."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ProfileError(f"profile {path} does not exist", hint="Pass a file under profiles/.") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"profile {path} is not readable JSON ({exc})",
                           hint="The file is corrupt; re-run the probe to write a new one.") from exc
    if not isinstance(data, dict) or not isinstance(data.get("schema_version"), int):
        raise ProfileError(f"{path} is not an mbtune profile (no schema_version)")
    version = data["schema_version"]
    if version > SCHEMA_VERSION:
        raise ProfileError(f"profile {path} has schema version {version}, newer than this mbtune reads "
                           f"({SCHEMA_VERSION})", hint="Upgrade mbtune to read it.")
    if version < OLDEST_READABLE_SCHEMA:
        raise ProfileError(f"profile {path} has schema version {version}, older than this mbtune reads "
                           f"({OLDEST_READABLE_SCHEMA}-{SCHEMA_VERSION})", hint="Re-run the probe to write a new one.")
    try:
        return Profile.from_dict(migrate(data))
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise ProfileError(f"profile {path} does not match schema version {version}: {exc}",
                           hint="The file is corrupt; re-run the probe to write a new one.") from exc


def migrate(data: dict) -> dict:
    """Bring a profile's dict up to SCHEMA_VERSION one version at a time (MIGRATIONS[v] turns v into v+1)."""
    while data["schema_version"] < SCHEMA_VERSION:
        data = MIGRATIONS[data["schema_version"]](dict(data))
    return data


def command_line() -> str:
    return " ".join(["mbtune", *sys.argv[1:]])
