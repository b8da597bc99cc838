"""The console entry point: run the app and map known errors to one line and an exit code."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback

from mbtune.cli.app import app
from mbtune.cli.support import as_flag, on_interrupt, save_traceback
from mbtune.errors import EXIT_COULD_NOT_RUN, Interrupted, MbtuneError
from mbtune.quiet import quiet_library_logs, quiet_resource_tracker


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
    from mbtune.report import stdout_for_documents

    args = sys.argv[1:] if argv is None else argv
    quiet_resource_tracker()
    quiet_library_logs()
    try:
        with stdout_for_documents() if asks_for_document(args) else contextlib.nullcontext():
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


def asks_for_document(args: list[str]) -> bool:
    """Whether the command line asks for a json or csv document on stdout (--format json|csv, -f csv,
    --format=json, -fjson), so nothing else may reach it. Arguments after `--` are the user's command's."""
    args = args[:args.index("--")] if "--" in args else args
    for i, arg in enumerate(args):
        if arg in ("-f", "--format") and i + 1 < len(args) and args[i + 1] in ("json", "csv"):
            return True
        if arg in ("--format=json", "--format=csv", "-fjson", "-fcsv"):
            return True
    return False

