"""The console entry point: run the app and map known errors to one line and an exit code."""

from __future__ import annotations

import os
import signal
import sys
import traceback

from mbtune.cli.app import app
from mbtune.cli.support import as_flag, on_interrupt, save_traceback
from mbtune.errors import EXIT_COULD_NOT_RUN, Interrupted, MbtuneError


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app and map known errors to one line and an exit code."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_interrupt)
    try:
        _run(argv)
    except SystemExit as exc:  # every way out: under torchrun across nodes, the others exit with this code
        if "mbtune.pipeline.torchrun" in sys.modules:
            from mbtune.pipeline.torchrun import close_sessions

            close_sessions(exc.code if isinstance(exc.code, int) else EXIT_COULD_NOT_RUN)
        raise


def _run(argv: list[str] | None) -> None:
    from mbtune.report import print_error

    debug = bool(os.environ.get("MBTUNE_DEBUG"))
    try:
        app(args=argv, prog_name="mbtune")
    except (MbtuneError, Interrupted) as exc:
        if debug:  # the whole text and the traceback first; the line and the exit code as without it
            if exc.detail:
                sys.stderr.write(f"{exc.detail}\n")
            traceback.print_exc()
        shown = as_flag(exc) if isinstance(exc, MbtuneError) else exc
        print_error(shown.one_line())
        sys.exit(exc.exit_code)
    except Exception as exc:  # a bug in mbtune: still one line unless debugging
        if debug:
            traceback.print_exc()
            print_error(f"internal error: {type(exc).__name__}: {exc}; please report it.")
            sys.exit(EXIT_COULD_NOT_RUN)
        text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print_error(f"internal error: {type(exc).__name__}: {text}. The traceback is in "
                    f"{save_traceback()}; please report it.")
        sys.exit(EXIT_COULD_NOT_RUN)
