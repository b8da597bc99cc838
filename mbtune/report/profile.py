"""Saved profiles for people and machines."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from mbtune.report import key_value_grid, print_json
from mbtune.report.probe import print_probe
from mbtune.report.sweep import print_sweep
from mbtune.saving.profiles import Profile


def metadata_table(profile: Profile, path: str) -> Table:
    meta = profile.metadata
    table = key_value_grid()
    table.add_row("profile", f"{path} (schema {profile.schema_version})")
    table.add_row("measured", f"{meta.created_at} on {meta.host} by mbtune {meta.mbtune_version}")
    table.add_row("software", f"torch {meta.torch_version}, python {meta.python_version}, {meta.platform}")
    allocator = ", ".join(f"{k}={v}" for k, v in meta.allocator_settings.items()) or "defaults"
    table.add_row("allocator", allocator)
    table.add_row("command", meta.command_line)
    return table


def print_profile(console: Console, profile: Profile, fmt: str, *, path: str, errors: bool = False,
                  warnings: bool = False) -> None:
    """Print a saved profile: its environment, then each section it holds; with `errors` (table format),
    then every failed trial's and point's whole error tail (its traceback and stderr); with `warnings`, every
    point's warnings one by one (else one line per cause)."""
    if fmt == "json":
        print_json(profile.to_dict())
        return
    if fmt == "table":
        console.print(metadata_table(profile, path))
    if profile.probe is not None:
        print_probe(console, profile.probe, fmt)
    if profile.sweep is not None:
        print_sweep(console, profile.sweep, fmt, every_warning=warnings)
    if profile.serve is not None:
        from mbtune.report.serve import print_serve

        print_serve(console, profile.serve, fmt)
    if errors and fmt == "table":
        print_error_tails(console, profile)


def error_tails(profile: Profile) -> list[tuple[str, str]]:
    """(heading, whole error text) for every failed probe trial and sweep point, in the order they ran."""
    found = []
    trials = profile.probe.trials if profile.probe is not None else ()
    for number, trial in enumerate(trials, 1):
        if not trial.ok:
            kind = f", {trial.error_kind}" if trial.error_kind else ""
            found.append((f"probe trial {number} (batch {trial.batch_size}): {trial.status}{kind}",
                          _whole(trial.error, trial.error_tail)))
    results = profile.sweep.results if profile.sweep is not None else ()
    for result in results:
        if not result.ok:
            kind = f", {result.error_kind}" if result.error_kind else ""
            rank = "" if result.failed_rank is None else f", rank {result.failed_rank}"
            blocks = f" (blocks {', '.join(map(str, result.failed_blocks))})" if result.failed_blocks else ""
            found.append((f"sweep point {result.point.label}: {result.status}{kind}{rank}{blocks}",
                          _whole(result.error, result.error_tail)))
    return found


def _whole(error: str, tail: str) -> str:
    """The error line, then the tail, without saying the same thing twice."""
    error, tail = error.strip(), tail.strip()
    if not tail or error in tail:
        return tail or error or "no error text"
    return f"{error}\n{tail}"


def print_error_tails(console: Console, profile: Profile) -> None:
    """Every failed trial's and point's whole error text, printed literally (tracebacks hold brackets)."""
    tails = error_tails(profile)
    if not tails:
        console.print("no failed trials or points")
        return
    for heading, text in tails:
        console.print(Text(heading, style="bold red"))
        console.print(Text(text), soft_wrap=True, highlight=False)
