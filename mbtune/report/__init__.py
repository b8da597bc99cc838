"""The only place that prints: rich tables, progress, JSON and CSV. Units are converted here alone."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

FORMATS = ("table", "json", "csv")


# Output that goes to a file or a CI log has no terminal to fit: give tables room instead of folding them.
LOG_WIDTH = 160


def make_console(*, stderr: bool = False) -> Console:
    """A console; COLUMNS pins the width (tests do), a terminal sets it, logs and pipes get LOG_WIDTH."""
    width = int(os.environ["COLUMNS"]) if os.environ.get("COLUMNS", "").isdigit() else None
    console = Console(stderr=stderr, width=width, highlight=False, soft_wrap=False)
    if width is None and not console.is_terminal:
        console.width = LOG_WIDTH
    return console


def key_value_grid() -> Table:
    """Two columns, bold labels on the left: the body of every summary panel."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    return grid


def fmt_bytes(value: float | None) -> str:
    """Bytes as GiB or MiB with three significant figures, or 'n/a'."""
    if value is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}" if abs(value) / size < 100 else f"{value / size:.0f} {unit}"
    return f"{value:.0f} B"


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def fmt_pct(value: float | None, scale: float = 100.0) -> str:
    """A share as a percentage with one decimal ("n/a" for none)."""
    return "n/a" if value is None else f"{value * scale:.1f}%"


def fmt_rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f}"


def print_json(data: Any) -> None:
    """Machine output goes to the document's stream untouched by rich."""
    document_stream().write(json.dumps(data, indent=2) + "\n")


# Where json and csv documents go, innermost last: --output's file, or the stdout a machine run kept for them.
_DOCUMENTS: list[TextIO] = []


def document_stream() -> TextIO:
    """The stream a json or csv document is written to (stdout unless redirected below)."""
    return _DOCUMENTS[-1] if _DOCUMENTS else sys.stdout


@contextlib.contextmanager
def documents_to(stream: TextIO) -> Iterator[None]:
    """Documents written inside go to `stream` (--output's file)."""
    _DOCUMENTS.append(stream)
    try:
        yield
    finally:
        _DOCUMENTS.remove(stream)


@contextlib.contextmanager
def stdout_for_documents() -> Iterator[None]:
    """stdout holds the document and nothing else: inside, file descriptor 1 is stderr's, for this process
    and every process it starts (trial workers, ranks, servers, whatever the user's code prints in them),
    sys.stdout is sys.stderr, and documents go to the stdout that was."""
    was = sys.stdout
    was.flush()
    try:
        on_fd1 = was.fileno() == 1
    except (AttributeError, OSError, ValueError):  # stdout captured in this process (tests)
        on_fd1 = False
    fd1 = os.dup(1)
    stream = os.fdopen(os.dup(1), "w", encoding="utf-8") if on_fd1 else was
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _DOCUMENTS.insert(0, stream)
    try:
        yield
    finally:
        _DOCUMENTS.remove(stream)
        sys.stderr.flush()
        stream.flush()
        os.dup2(fd1, 1)
        os.close(fd1)
        sys.stdout = was
        if stream is not was:
            stream.close()


def log_to_stderr(verbosity: int) -> None:
    """Show the 'mbtune' logger's records on stderr through rich: -v info, -vv debug."""
    import logging

    from rich.logging import RichHandler

    logger = logging.getLogger("mbtune")
    logger.addHandler(RichHandler(console=make_console(stderr=True), show_path=False, markup=False))
    logger.setLevel(logging.DEBUG if verbosity > 1 else logging.INFO)


def print_error(message: str) -> None:
    """One line, printed literally (brackets in a path or name are not markup) and never wrapped, so the
    line reads the same whatever the terminal's width or the message's length."""
    from rich.text import Text

    make_console(stderr=True).print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True,
                                    highlight=False)


def print_warnings(console: Console, warnings: tuple[str, ...] | list[str]) -> None:
    for warning in warnings:
        console.print(f"[yellow]warning:[/] {warning}")
