"""Saved profiles for people and machines."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from mbtune.records import Profile
from mbtune.report import key_value_grid, print_json
from mbtune.report.probe import print_probe
from mbtune.report.sweep import print_sweep


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


def print_profile(console: Console, profile: Profile, fmt: str, *, path: str) -> None:
    """Print a saved profile: its environment, then each section it holds."""
    if fmt == "json":
        print_json(profile.to_dict())
        return
    if fmt == "table":
        console.print(metadata_table(profile, path))
    if profile.probe is not None:
        print_probe(console, profile.probe, fmt)
    if profile.sweep is not None:
        print_sweep(console, profile.sweep, fmt)
