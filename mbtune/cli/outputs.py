"""Paths given on the command line are checked before anything is measured, each error naming its flag:
an output (--junit, --trace, --plot, -o) that cannot be written, an input (--baseline, --spec, --config,
--from-profile) that cannot be read, is bad input found in a second rather than after an hour of measuring."""

from __future__ import annotations

import os
from pathlib import Path

from mbtune.errors import ConfigError


def check_writable(path: Path | str, *, flag: str, folder: bool = False) -> None:
    """Raise ConfigError, naming `flag`, unless `path` (a file, or with folder=True a folder) can be created
    or written. Missing folders count as writable where the nearest existing one above them is."""
    path = Path(path)
    what = f"{flag}: output {'folder' if folder else 'file'}"
    if path.exists():
        if folder and not path.is_dir():
            raise ConfigError(f"{what} {path} is a file", hint="Give a folder, or a new path.")
        if not folder and path.is_dir():
            raise ConfigError(f"{what} {path} is a folder", hint="Give a file name inside it.")
        if not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
            raise ConfigError(f"{what} {path} is not writable", hint="Choose a path you can write to.")
        return
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what} {path} lies under {existing}, which is not a folder",
                          hint="Choose a path inside a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path} cannot be created: {existing} is not writable",
                          hint="Choose a path you can write to.")


def check_readable(path: Path | str, *, flag: str, hint: str) -> None:
    """Raise ConfigError, naming `flag`, unless `path` is a file this process can read."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{flag} {path} does not exist", hint=hint)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder", hint=hint)
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{flag} {path} is not readable", hint="Choose a file you can read.")
