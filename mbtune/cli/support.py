"""The CLI's plumbing: configs from options, output checks, printing and exit codes, and the one place
that turns a config field into its flag. The command modules hold only their commands' options."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from mbtune.errors import Interrupted, MbtuneError

if TYPE_CHECKING:
    from mbtune.report.progress import TrialProgressBar
    from mbtune.saving.session import RunOutcome

T = TypeVar("T")
quiet: list[bool] = [False]  # -q: no per-trial progress lines

# The options that say where and how a command prints and saves, not what it measures: the rest of what a
# command is given are its config's settings.
RUN_OPTIONS = frozenset({"config_file", "profiles_dir", "save", "resume", "format", "output", "plot", "trace",
                         "export", "check", "from_profile", "rank", "junit"})


def settings_in(given: Mapping[str, Any], door: Callable[..., T], *, leave: Collection[str] = ()) -> T:
    """The config a command's options describe, through its one door: settings.build for a config class,
    or a wing's own door (tune_configs); every error names the flag. `leave`: options of the command that
    are not this config's (plan's, which builds one of two configs)."""
    import dataclasses

    from mbtune.saving.profiles import command_line
    from mbtune.settings import build, flag_for

    settings = {name: value for name, value in given.items() if name not in RUN_OPTIONS and name not in leave}
    if not isinstance(door, type):
        return door(settings, spelled=flag_for, said=note_on_stderr, command_line=command_line())
    filled = {"command_line": command_line()} if "command_line" in {f.name for f in dataclasses.fields(door)} else {}
    return build(door, settings, spelled=flag_for, said=note_on_stderr, **filled)


@dataclass(frozen=True, kw_only=True)
class Given:
    """A training command's output settings, checked before anything runs: the format (as --output's name
    says, where it says one), --resume with saving, and the picture and trace paths."""

    fmt: str
    output: Path | None
    folder: Path | None  # where the run is saved; None with --no-save
    resume: bool
    plot: Path | None
    trace: Path | None

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> Given:
        plot, trace = given.get("plot"), given.get("trace")
        fmt = check_run(given["format"], given["output"], resume=given["resume"], save=given["save"], plot=plot,
                        trace=trace)
        return cls(fmt=fmt, output=given["output"], folder=target_folder(given["profiles_dir"], given["save"]),
                   resume=given["resume"], plot=plot, trace=trace)


def say_on_stderr(line: str) -> None:
    from mbtune.report import make_console

    make_console(stderr=True).print(line)


def note_on_stderr(line: str) -> None:
    say_on_stderr(f"note: {line}")


def finish_serve(fmt: str, outcome: RunOutcome, *, plot: Path | None, output: Path | None,
                 export: Path | None = None) -> None:
    """Print a serve run, write its picture and serving files; exit as finish does when it was interrupted."""
    from mbtune.report import make_console
    from mbtune.report.serve import print_serve, write_serve_plot
    from mbtune.serving.export import write_serving_files

    if outcome.notes:
        err = make_console(stderr=True)
        for note in outcome.notes:
            err.print(f"note: {note}")
    assert outcome.serve is not None
    exported = write_serving_files(outcome.serve, export) if export is not None else None
    with printing_to(output):
        print_serve(make_console(), outcome.serve, fmt, saved_to=str(outcome.saved_to) if outcome.saved_to else None,
                    exported=exported)
    if plot is not None:
        make_console(stderr=True).print(f"wrote {write_serve_plot(outcome.serve, plot)}")
    if outcome.interrupted:
        raise typer.Exit(interrupted_exit_code())


def check_run(fmt: str, output: Path | None, *, resume: bool, save: bool, plot: Path | None = None,
              trace: Path | None = None) -> str:
    """A training command's output settings checked before anything runs: the format (as --output's name
    says, where it says one), --resume with saving, and the picture and trace paths."""
    fmt = check_output(check_format(fmt), output)
    check_resume(resume, save)
    check_outputs(plot_dir=plot, files={"--trace": trace})
    return fmt


def check_resume(resume: bool, save: bool) -> None:
    from mbtune.errors import ConfigError

    if resume and not save:
        raise ConfigError("--resume continues from the journal that saving keeps, and --no-save keeps none",
                          hint="Drop --no-save to resume, or drop --resume to run without saving.")


def check_outputs(*, plot_dir: Path | None = None, files: dict[str, Path | None] | None = None,
                  export_dir: Path | None = None) -> None:
    """Output paths are checked before anything is measured, so a typo costs nothing. `files`: flag -> path."""
    from mbtune.cli.outputs import check_writable

    for flag, folder in (("--plot", plot_dir), ("--export", export_dir)):
        if folder is not None:
            check_writable(folder, flag=flag, folder=True)
    for flag, path in (files or {}).items():
        if path is not None:
            check_writable(path, flag=flag)


PROFILE_HINT = "Pass a saved profile's file (profiles/<device>/<workload>.json)."
TOML_HINT = "Pass the path of a TOML file (a qualify.toml)."


def check_inputs(files: dict[str, tuple[Path | None, str]]) -> None:
    """Input paths (flag -> (path, what to pass instead)) are checked before anything runs."""
    from mbtune.cli.outputs import check_readable

    for flag, (path, hint) in files.items():
        if path is not None:
            check_readable(path, flag=flag, hint=hint)


def with_progress(label: str, job: Callable[[TrialProgressBar | None], T]) -> T:
    from mbtune.report import make_console
    from mbtune.report.progress import TrialProgressBar

    if quiet[0]:
        return job(None)
    with TrialProgressBar(make_console(stderr=True), label=label) as progress:
        return job(progress)


@contextlib.contextmanager
def printing_to(output: Path | None) -> Iterator[None]:
    """What is printed to stdout goes to `output` instead, when given (checked writable before the run)."""
    if output is None:
        yield
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    from mbtune.report import documents_to

    with open(output, "w") as handle, documents_to(handle):
        yield


def check_output(fmt: str, output: Path | None) -> str:
    """The format to print in: with --output, json or csv (a .json or .csv file name says which when
    --format does not); the file is checked writable before anything is measured."""
    from mbtune.errors import ConfigError

    if output is not None and fmt == "table":
        fmt = {".json": "json", ".csv": "csv"}.get(output.suffix.lower(), fmt)
        if fmt == "table":
            raise ConfigError("--output writes json or csv",
                              hint="Add --format json or --format csv, or name the file .json or .csv.")
    check_outputs(files={"--output": output})
    return fmt


def target_folder(profiles_dir: Path, save: bool) -> Path | None:
    return profiles_dir if save else None


def finish(fmt: str, outcome: RunOutcome, *, plot: Path | None = None, trace: Path | None = None,
            output: Path | None = None) -> None:
    """Print what the run produced, write pictures and traces; exit 128 + the signal's number when it was
    interrupted (after saving what finished), 3 when no point produced a result."""
    from mbtune.errors import NothingMeasuredError
    from mbtune.report import make_console
    from mbtune.report.sweep import write_artifacts
    from mbtune.report.tune import print_results
    from mbtune.sweeping.ranking import nothing_measured

    if outcome.followed is not None:  # another node led the run, and printed and saved it
        raise typer.Exit(outcome.followed)
    saved = str(outcome.saved_to) if outcome.saved_to else None
    with printing_to(output):
        print_results(make_console(), fmt, probe=outcome.probe, sweep=outcome.sweep, saved_to=saved,
                      notes=outcome.notes)
    if outcome.sweep is not None and (plot or trace):
        write_artifacts(make_console(stderr=True), outcome.sweep, plot_dir=plot, trace_path=trace)
    if outcome.interrupted:
        raise typer.Exit(interrupted_exit_code())
    if outcome.sweep is not None and (why := nothing_measured(outcome.sweep)):
        raise NothingMeasuredError(why)


def check_format(fmt: str, allowed: tuple[str, ...] | None = None) -> str:
    """The output format, refused when this command cannot print it."""
    from mbtune.errors import ConfigError
    from mbtune.report import FORMATS

    allowed = allowed or FORMATS
    if fmt not in allowed:
        raise ConfigError(f"--format {fmt!r} is not one of {', '.join(allowed)} for this command",
                          hint=f"Use --format {' or '.join(allowed)}.")
    return fmt


_received: list[int] = []  # the signals that interrupted this run


def interrupted_exit_code() -> int:
    """128 + the signal that interrupted the run (130 for Ctrl-C)."""
    from mbtune.errors import EXIT_INTERRUPTED

    return 128 + _received[-1] if _received else EXIT_INTERRUPTED


def as_flag(exc: MbtuneError) -> MbtuneError:
    """A ConfigError that names a config field, told in terms of its flag (hints name flags only here)."""
    from mbtune.errors import ConfigError
    from mbtune.settings import flag_for

    field = getattr(exc, "field", None)
    if not isinstance(exc, ConfigError) or not field:
        return exc
    flag = flag_for(field)
    return ConfigError(exc.message.replace(f"{field}=", f"{flag} ", 1), hint=exc.hint or f"Fix {flag}.",
                       detail=exc.detail)


def on_interrupt(signum: int, frame: object) -> None:
    # Our own exception rather than KeyboardInterrupt, which click would turn into "Aborted!" and exit 1.
    # SIGTERM and SIGHUP (a cancelled CI job, `timeout`, a closed terminal) stop the run as Ctrl-C does.
    _received.append(signum)
    raise Interrupted(f"interrupted by {signal.Signals(signum).name}", exit_code=128 + signum)


def save_traceback() -> str:
    """Write the current exception's traceback to a temp file; its path (or where it could not go)."""
    import tempfile
    import traceback

    try:
        fd, path = tempfile.mkstemp(prefix="mbtune-traceback-", suffix=".txt")
        with os.fdopen(fd, "w") as handle:
            handle.write(traceback.format_exc())
        return path
    except OSError:
        return "nowhere (the temp folder is not writable; rerun with MBTUNE_DEBUG=1)"
