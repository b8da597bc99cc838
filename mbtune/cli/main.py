"""The console entry point: run the app and map known errors to one line and an exit code."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback

from mbtune.cli.app import app
from mbtune.cli.support import as_flag, on_interrupt, save_traceback
from mbtune.errors import EXIT_BAD_INPUT, EXIT_COULD_NOT_RUN, Interrupted, MbtuneError
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
    from mbtune.report import print_error, stdout_for_documents

    debug = bool(os.environ.get("MBTUNE_DEBUG"))
    args = sys.argv[1:] if argv is None else argv
    quiet_resource_tracker()
    quiet_library_logs()
    try:
        refuse_empty_command(args)
        with stdout_for_documents() if asks_for_document(args) else contextlib.nullcontext():
            # Not standalone: a value the command line cannot parse comes here, to be told in mbtune's one line.
            code = app(args=argv, prog_name="mbtune", standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)  # typer.Exit(code), --help's exit, or done: as the parser would
    except _command_line_errors() as exc:  # the command line itself: an unknown flag, a value of the wrong type
        if debug:
            traceback.print_exc()
        if type(exc).__name__ == "NoArgsIsHelpError":  # `mbtune` alone: the help, as the parser shows it
            sys.stderr.write(getattr(exc, "format_message", exc.__str__)() + "\n")
        else:
            print_error(usage_line(exc, args))
        sys.exit(getattr(exc, "exit_code", EXIT_BAD_INPUT))
    except _aborts():
        print_error("aborted")
        sys.exit(1)
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


def refuse_empty_command(args: list[str]) -> None:
    """A `--` with nothing after it is refused: the parser would drop it, and a probe, sweep or tune would run
    the built-in workload instead of the command the user meant to give."""
    if "--" in args and args.index("--") == len(args) - 1:
        from mbtune.errors import ConfigError

        raise ConfigError("nothing after --: the training command goes there",
                          hint="Give it as you run it (mbtune probe -- python train.py --batch-size {batch}), or "
                          "leave -- out to run a built-in workload.")


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



def usage_line(exc: Exception, args: list[str]) -> str:
    """click's usage error as one line, with where to read what the command takes."""
    message = " ".join(exc.format_message().split()) if hasattr(exc, "format_message") else str(exc)
    command = next((a for a in args if not a.startswith("-")), "")
    return f"{message.rstrip('.')}. See `mbtune {command} -h`.".replace("mbtune  -h", "mbtune -h")


def _command_line_errors() -> tuple[type[Exception], ...]:
    """What the command-line parser raises for a line it cannot take: typer's own (newer typer carries its
    parser) or click's."""
    kinds: list[type[Exception]] = []
    try:
        from typer.exceptions import TyperException

        kinds.append(TyperException)
    except ImportError:
        pass
    try:
        from click import ClickException

        kinds.append(ClickException)
    except ImportError:
        pass
    return tuple(kinds)


def _aborts() -> tuple[type[BaseException], ...]:
    """What the parser raises when it gives up (an end of input at a prompt)."""
    import typer

    kinds: list[type[BaseException]] = [typer.Abort]
    try:
        from click.exceptions import Abort

        kinds.append(Abort)
    except ImportError:
        pass
    return tuple(kinds)
