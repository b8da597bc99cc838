"""A run's hold on one profile: an exclusive lock, an append-only journal of finished trials, and the
final atomic save. Killing mbtune loses at most the trial that was running; `--resume` replays the
journal instead of re-running what finished.

Journal: <profile>.journal.jsonl beside the profile. Line 1 is a header naming the run's kind and
configuration; each further line is one finished trial ({"kind": ..., "record": ...}), fsynced as it is
written. A truncated last line (the process died mid-write) is ignored; any other line that is not a
well-formed entry is reported, naming the line and the field, rather than silently skipped.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any

from mbtune.atomic import write_atomic
from mbtune.errors import EXIT_COULD_NOT_RUN, ConfigError, ProfileError, RunLockedError
from mbtune.probing.records import ProbeResult, TrialOutcome
from mbtune.records import KILLED, DeviceInfo, Record, RecordFieldError, short_repr, shorten
from mbtune.saving.profiles import profile_path, save_results
from mbtune.serving.records import ConfigRun, ServeReport, ServiceCurve
from mbtune.sweeping.records import Balance, PointResult, SweepReport
from mbtune.version import __version__

JOURNAL_VERSION = 2  # 2: points name ranks num_ranks and stages per rank stages_per_rank
# The record each kind of journal entry holds (probing/run.py's PROBE_TRIAL, sweeping/run.py's SWEEP_POINT and
# BALANCE, serving/run.py's SERVICE_CURVE and SERVE_CONFIG).
JOURNAL_RECORDS: dict[str, type[Record]] = {"probe_trial": TrialOutcome, "sweep_point": PointResult,
                                            "balance": Balance, "service_curve": ServiceCurve,
                                            "serve_config": ConfigRun}
_BAD_JOURNAL = "Fix or delete that line, or run without --resume."


class RunStore:
    """Context manager over one profile path for the length of a run."""

    def __init__(self, root: Path | str, device: DeviceInfo, workload: str, *, kind: str,
                 config: dict[str, Any], resume: bool) -> None:
        self.path = profile_path(Path(root), device, workload)
        self.journal_path = self.path.with_name(f"{self.path.stem}.journal.jsonl")
        self._device, self._workload, self._kind, self._config = device, workload, kind, config
        self._resume = resume
        self._lock: int | None = None
        self._journal: Any = None
        self._replay: dict[str, list[dict[str, Any]]] = {}
        self.notes: list[str] = []

    def __enter__(self) -> RunStore:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = os.open(self.path.with_name(f"{self.path.stem}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ProfileError(f"cannot write under {self.path.parent}: {exc.strerror or exc}",
                               hint="Choose a writable folder with --profiles-dir.") from exc
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            self._lock = None
            raise RunLockedError(f"another mbtune run is writing {self.path}") from None
        try:
            if self._resume:
                self._load_journal()
            elif _holds_records(self.journal_path):
                kept = self.journal_path.with_name(f"{self.journal_path.name}.{_stamp()}.bak")
                self.journal_path.rename(kept)
                self.notes.append(f"an unfinished run's journal was kept as {kept} (use --resume to continue a run)")
            self._open_journal()
        except BaseException:
            os.close(self._lock)  # no __exit__ follows a failed __enter__: release the lock here
            self._lock = None
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._journal is not None:
            try:
                self._journal.close()
            except OSError:  # a full disk: what could be written was (record says so), the rest cannot be
                pass
            if not _holds_records(self.journal_path):
                self.journal_path.unlink(missing_ok=True)  # nothing was measured: nothing to resume
        if self._lock is not None:
            os.close(self._lock)  # releases the lock

    def replayed(self, kind: str) -> list[dict[str, Any]]:
        """The journaled records of one kind, in the order they finished."""
        return list(self._replay.get(kind, []))

    def record(self, kind: str, record: dict[str, Any]) -> None:
        """Append one finished trial and force it to disk. A disk that cannot take it ends the run: what was
        journaled before stays (a cut last line is dropped on resume), this trial runs again on resume."""
        try:
            self._journal.write(json.dumps({"kind": kind, "record": record}) + "\n")
            self._journal.flush()
            os.fsync(self._journal.fileno())
        except OSError as exc:
            error = ProfileError(f"cannot write the journal {self.journal_path}: {exc.strerror or exc}; what "
                                 "finished before it is kept there",
                                 hint="Free space on that disk (or fix it), then rerun with --resume.")
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):  # the machine's, not the input's
                error.exit_code = EXIT_COULD_NOT_RUN
            raise error from exc

    def save(self, *, command_line: str, probe: ProbeResult | None = None,
             sweep: SweepReport | None = None, serve: ServeReport | None = None) -> Path:
        """Write the profile atomically (under this run's lock)."""
        return save_results(self.path.parents[1], self._device, self._workload, command_line,
                            probe=probe, sweep=sweep, serve=serve)

    def finish(self) -> None:
        """The run completed and its profile is saved: the journal has done its job."""
        self._journal.close()
        self._journal = None
        self.journal_path.unlink(missing_ok=True)

    def _open_journal(self) -> None:
        header = {"journal": JOURNAL_VERSION, "mbtune": __version__, "kind": self._kind, "config": self._config,
                  "device": self._device.to_dict(), "started_at": _stamp()}
        entries = [{"kind": k, "record": r} for k, records in self._replay.items() for r in records]
        # Rewrite rather than append, so a truncated last line from a killed run does not stay behind.
        try:
            write_atomic(self.journal_path, "".join(json.dumps(line) + "\n" for line in [header, *entries]))
            self._journal = open(self.journal_path, "a")
        except OSError as exc:
            raise ProfileError(f"cannot write the journal {self.journal_path}: {exc.strerror or exc}",
                               hint="Choose a writable folder with --profiles-dir.") from exc

    def _drop_killed(self) -> None:
        """A trial or point killed from outside (the kernel's OOM killer, a job killed with its processes) is
        run again on resume, not replayed: its record leaves the journal, which is rewritten without it.
        A killed probe trial ended the probe, so it can only be the last."""
        trials = self._replay.get("probe_trial", [])
        if trials and _killed(trials[-1]):
            self.notes.append(f"the trial at batch {trials.pop()['batch_size']} was killed from outside: it runs again")
        runs = self._replay.get("serve_config", [])
        gone = [r for r in runs if str(r.get("error", "")).startswith(("the server killed", "the load generator killed"))]
        if gone:
            self._replay["serve_config"] = [r for r in runs if r not in gone]
            self.notes.append(f"{len(gone)} serving configuration(s) killed from outside run again")
        points = self._replay.get("sweep_point", [])
        killed = [p for p in points if _killed(p)]
        if killed:
            self._replay["sweep_point"] = [p for p in points if not _killed(p)]
            self.notes.append(f"{len(killed)} sweep point(s) killed from outside run again")

    def _load_journal(self) -> None:
        if not self.journal_path.exists():
            raise ConfigError(f"nothing to resume: no journal at {self.journal_path}",
                              hint="Run without --resume to start afresh.")
        lines = _journal_lines(self.journal_path)
        header = _journal_header(self.journal_path, lines)
        differences = _differences(header.get("config", {}), self._config)
        if header.get("kind") != self._kind or differences:
            what = ", ".join(differences) or f"it was a {shorten(str(header.get('kind')))} run"
            raise ConfigError(f"the journal at {self.journal_path} is from a different run ({what})",
                              hint="Resume with the same command and options, or run without --resume.")
        for index, (number, raw) in enumerate(lines[1:], start=2):
            entry = _journal_entry(self.journal_path, number, raw, last=index == len(lines))
            if entry is not None:
                self._replay.setdefault(entry["kind"], []).append(entry["record"])
        self._drop_killed()
        self.notes.append(f"resumed from {self.journal_path}: "
                          + ", ".join(f"{len(v)} {k} record(s)" for k, v in self._replay.items()))


def _killed(record: dict[str, Any]) -> bool:
    return record.get("status") == KILLED


def _journal_lines(path: Path) -> list[tuple[int, bytes]]:
    """The journal's non-blank lines, with their line numbers (from 1)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ProfileError(f"journal {path} is not readable: {exc.strerror or exc}",
                           hint="Run without --resume.") from exc
    return [(number, line) for number, line in enumerate(data.split(b"\n"), start=1) if line.strip()]


def _journal_header(path: Path, lines: list[tuple[int, bytes]]) -> dict[str, Any]:
    try:
        header = _parse(lines[0][1]) if lines else None
    except ValueError:
        header = None
    fresh = "Run without --resume to start afresh (the journal is kept beside it as a .bak file)."
    if not isinstance(header, dict) or "journal" not in header:
        raise ProfileError(f"journal {path} is damaged: its first line is not an mbtune journal's header", hint=fresh)
    if header.get("journal") != JOURNAL_VERSION:
        by = f"mbtune {shorten(str(header['mbtune']))}" if "mbtune" in header else "an older mbtune"
        raise ProfileError(f"journal {path} was written by {by} (journal format {short_repr(header.get('journal'))}; "
                           f"this mbtune {__version__} reads format {JOURNAL_VERSION})",
                           hint="Resume it with the mbtune that started it, or r" + fresh[1:])
    if not isinstance(header.get("config", {}), dict):
        raise ProfileError(f"journal {path} line 1: config is {short_repr(header['config'])}, expected an object",
                           hint=_BAD_JOURNAL)
    return header


def _journal_entry(path: Path, number: int, raw: bytes, *, last: bool) -> dict[str, Any] | None:
    """One finished trial's entry, checked against its record type; None for a torn last line."""
    where = f"journal {path} line {number}"
    try:
        entry = _parse(raw)
    except ValueError as exc:
        if last:
            return None  # the last line of a run killed mid-write
        raise ProfileError(f"{where} is not JSON ({exc})", hint=_BAD_JOURNAL) from None
    if not isinstance(entry, dict):
        raise ProfileError(f"{where} is {short_repr(entry)}, expected an object", hint=_BAD_JOURNAL)
    kind = entry.get("kind")
    record_type = JOURNAL_RECORDS.get(kind) if isinstance(kind, str) else None
    if record_type is None:
        raise ProfileError(f"{where}: kind is {short_repr(kind)}, expected one of {', '.join(JOURNAL_RECORDS)}",
                           hint=_BAD_JOURNAL)
    try:
        record_type.from_dict(entry.get("record"), path="record")
    except RecordFieldError as exc:
        raise ProfileError(f"{where}: {exc}", hint=_BAD_JOURNAL) from None
    return entry


def _holds_records(path: Path) -> bool:
    """True when a journal has at least one finished trial after its header."""
    try:
        with open(path, "rb") as handle:  # bytes: a corrupt journal is still counted, not a decoding error
            return sum(1 for line in handle if line.strip()) > 1
    except FileNotFoundError:
        return False


def _parse(line: bytes) -> Any:
    """One journal line's JSON; ValueError for anything that is not (bad UTF-8, bad JSON, absurd nesting)."""
    try:
        return json.loads(line.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [f"{shorten(str(k))}: {short_repr(saved.get(k))} then, {short_repr(current.get(k))} now"
            for k in keys if saved.get(k) != current.get(k)]


def _stamp() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
