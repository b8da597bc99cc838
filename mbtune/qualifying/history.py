"""Every qualification run kept: one history file per machine and baseline (or spec), beside qualify's
profiles, and the steps found in it.

The file is <profiles-dir>/history/<host>/<baseline>-<id>.json, where <id> names the baseline's own
measurement (its creation time and host), so a baseline checked out to another path keeps its history and a
new baseline (`tune --as-baseline` again: re-baselining is that explicit command) starts a new one. It is
JSON in the schema mbtune/schemas/history-v1.schema.json. A run is added under an exclusive lock on a
lock file beside it (two jobs on one machine wait for each other) and written atomically (a reader sees the
old file or the new one). A damaged file, or one a newer mbtune wrote, is refused with one line before
anything is measured, and left as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbtune.atomic import write_atomic
from mbtune.errors import ProfileError
from mbtune.qualifying.changes import change_points
from mbtune.qualifying.records import CHECK_ERROR, Change, History, HistoryRun, RunCheck, Verdict
from mbtune.recordio import RecordFieldError
from mbtune.saving.profiles import Profile, slug

HISTORY_VERSION = 1
FOLDER = "history"


def history_file_name(version: int = HISTORY_VERSION) -> str:
    return f"history-v{version}.schema.json"


def history_schema() -> dict[str, Any]:
    """The JSON Schema of a history of this mbtune's history version, derived from its records."""
    from mbtune.saving.profile_schema import record_schema

    return record_schema(History, version_field="history_version", version=HISTORY_VERSION,
                         file_name=history_file_name(), title=f"mbtune qualification history, version {HISTORY_VERSION}")


def shipped_history_schema() -> dict[str, Any]:
    """The history schema file shipped in the package."""
    from mbtune.saving.profile_schema import shipped_file

    return shipped_file(history_file_name())


def history_path(profiles_dir: Path, baseline: Profile | None, against: str, host: str | None = None) -> Path:
    """Where the runs of this machine against this baseline (or the spec at `against`, without one) are kept."""
    machine = slug(host or socket.gethostname())
    if baseline is not None:
        meta = baseline.metadata
        ident = hashlib.sha256(f"{meta.created_at}|{meta.host}".encode()).hexdigest()[:8]
        name = f"{slug(Path(against).stem)}-{ident}"
    else:
        name = f"spec-{slug(Path(against).stem)}"
    return Path(profiles_dir) / FOLDER / machine / f"{name}.json"


def read_history(path: Path) -> History | None:
    """The history at `path`, None where there is none yet; a damaged or newer file is refused in one line."""
    hint = "Move it aside; qualify --no-history runs without one."
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        raise ProfileError(f"history {path} is not readable JSON ({exc})", hint=hint) from exc
    if not isinstance(data, dict) or "history_version" not in data:
        raise ProfileError(f"{path} is not an mbtune qualification history (no history_version)", hint=hint)
    version = data["history_version"]
    if isinstance(version, int) and not isinstance(version, bool) and version > HISTORY_VERSION:
        raise ProfileError(f"history {path} was written by a newer mbtune (history version {version}; this one reads "
                           f"{HISTORY_VERSION})", hint="Upgrade mbtune, or keep this history apart with another --profiles-dir.")
    if version != HISTORY_VERSION:
        raise ProfileError(f"history {path}: history_version is {version!r}, expected {HISTORY_VERSION}", hint=hint)
    try:
        return History.from_dict(data)
    except RecordFieldError as exc:
        raise ProfileError(f"history {path}: {exc}", hint=hint) from exc


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def add_run(path: Path, verdict: Verdict, *, against: str, host: str | None = None) -> History:
    """Add the verdict's run to the history at `path` (made where missing), under its lock; the history as
    it now is, this run last."""
    with _locked(path):
        history = read_history(path) or History(history_version=HISTORY_VERSION, machine=host or socket.gethostname(),
                                                baseline=against)
        device = f"{verdict.device.backend}: {verdict.device.name}" if verdict.device else ""
        run = HistoryRun(run=len(history.runs) + 1, started_at=verdict.started_at, status=verdict.status,
                         wall_s=verdict.wall_s, tolerance=verdict.tolerance, device=device, state=verdict.state,
                         checks=tuple(RunCheck(name=c.name, status=c.status, measured=c.measured,
                                               spread_pct=c.spread_pct, gating=c.gating) for c in verdict.checks))
        history = History(history_version=HISTORY_VERSION, machine=history.machine, baseline=history.baseline,
                          runs=(*history.runs, run))
        try:
            write_atomic(path, json.dumps(history.to_dict(), indent=1) + "\n")
        except OSError as exc:
            raise ProfileError(f"cannot write the history {path}: {exc.strerror or exc}",
                               hint="Choose a writable --profiles-dir, or pass --no-history.") from exc
    return history


def gating_series(history: History) -> dict[str, list[tuple[HistoryRun, float]]]:
    """Each gating check's measured figures, run by run (runs where it could not be measured left out), in
    the order the checks first appear."""
    series: dict[str, list[tuple[HistoryRun, float]]] = {}
    for run in history.runs:
        for check in run.checks:
            if check.gating and check.status != CHECK_ERROR and check.measured is not None:
                series.setdefault(check.name, []).append((run, check.measured))
    return series


def all_changes(history: History) -> dict[str, list[Change]]:
    """Every step found in each gating check's series (qualifying/changes.py), oldest first."""
    found: dict[str, list[Change]] = {}
    for name, rows in gating_series(history).items():
        shifts = change_points([value for _, value in rows])
        found[name] = [Change(check=name, run=rows[s.index][0].run, started_at=rows[s.index][0].started_at,
                              change_pct=100 * s.change, half_pct=100 * s.half, p_value=s.p_value,
                              before=s.before, after=s.after) for s in shifts]
    return found


def latest_changes(history: History) -> tuple[Change, ...]:
    """The latest step of each gating check's series, where one is found."""
    return tuple(changes[-1] for changes in all_changes(history).values() if changes)


def histories(profiles_dir: Path) -> list[Path]:
    """Every history file under a profiles folder, in name order."""
    return sorted(p for p in (Path(profiles_dir) / FOLDER).glob("*/*.json") if p.is_file())


@dataclass(frozen=True)
class Shown:
    """One history as `mbtune history` shows it: its file, its runs, each gating check's steps."""

    path: Path
    history: History
    changes: dict[str, list[Change]]

    def series(self) -> list[str]:
        """The gating checks that measured a figure, in the order they first appear."""
        names: list[str] = []
        for run in self.history.runs:
            names += [c.name for c in run.checks if c.gating and c.measured is not None and c.name not in names]
        return names


def read_histories(profiles_dir: Path) -> list[Shown]:
    """Every history under a profiles folder with the steps found in it; a folder with none is refused."""
    from mbtune.errors import ConfigError

    paths = histories(profiles_dir)
    if not paths:
        raise ConfigError(f"no qualification history under {Path(profiles_dir) / FOLDER}",
                          hint="Pass the --profiles-dir qualify wrote to (default profiles/qualify-runs); "
                               "qualify keeps one unless --no-save or --no-history.")
    shown = []
    for path in paths:
        history = read_history(path)
        assert history is not None, "a listed history file exists"
        shown.append(Shown(path=path, history=history, changes=all_changes(history)))
    return shown
