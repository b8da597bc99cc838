"""The typer app and its root options (--version, --quiet, --verbose)."""

from __future__ import annotations

from typing import Annotated

import typer

from mbtune.cli import ci, plan, serve, support, train
from mbtune.version import __version__

app = typer.Typer(
    name="mbtune", no_args_is_help=True, add_completion=True, rich_markup_mode=None, pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Profile real hardware to find the best batch configuration for pipeline-parallel training.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mbtune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No per-trial progress lines on stderr (results, warnings and errors still print).")] = False,
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True, help="Log what mbtune does to stderr (-v info, -vv debug), through the 'mbtune' logger.")] = 0,
) -> None:
    """Profile real hardware to find the best batch configuration for pipeline-parallel training."""
    support.quiet[0] = quiet
    if verbose:
        from mbtune.report import log_to_stderr

        log_to_stderr(verbose)


# The commands, in the order --help lists them; each module declares its commands' options and nothing else.
for command in (train.probe, train.confirm, train.sweep, train.tune, serve.serve, ci.show, ci.qualify, ci.history, ci.compare, plan.plan, ci.check):
    app.command()(command)
