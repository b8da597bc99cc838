"""The one atomic file writer: a reader sees the old file or the new one, never a part of either."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

_ATTEMPTS = 100  # temporary names are random; a clash is all but impossible, a hundred in a row is a bug


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write text (as UTF-8) or bytes to path: a temporary file in the same folder (made if missing), fsync,
    os.replace over the target, then fsync the folder. On any failure the temporary file is removed and the
    target is left as it was; OSError propagates for the caller to word.

    The file is created with mode 0o666 as open() would, so the kernel applies the umask (and any default
    ACL): the result is 0o644 under the usual umask 022, not the 0o600 that tempfile.mkstemp gives."""
    target = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = _create_temporary(target)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)
    return target


def _create_temporary(target: Path) -> tuple[int, Path]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_ATTEMPTS):
        temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(temporary, flags, 0o666), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {target}")


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable. Some file systems cannot open or fsync a folder: the file's own fsync
    already ran, so that is no reason to fail the write."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
