"""The typer app as a package: options (the shared Annotated option types), app (the app and its root
options), train (probe, sweep, tune), ci (show, qualify, compare, check), plan, serve, support (configs from
options, output checks, progress) and main (errors -> one line and an exit code). Each command: options ->
config -> one library call -> report/. No torch import and no logic here."""

from mbtune.cli.app import app
from mbtune.cli.main import main

__all__ = ["app", "main"]
