"""Printing a probe, a sweep, or both (tune) in one format."""

from __future__ import annotations

from rich.console import Console

from mbtune.probing.records import ProbeResult
from mbtune.report import make_console, print_json
from mbtune.report.probe import print_probe
from mbtune.report.sweep import print_sweep
from mbtune.sweeping.records import SweepReport


def print_results(console: Console, fmt: str, *, probe: ProbeResult | None = None, sweep: SweepReport | None = None,
                  saved_to: str | None = None, notes: tuple[str, ...] = ()) -> None:
    """Tables for both; one JSON document holding both; CSV of the sweep when there is one. Notes about
    the run (resumed, journal kept) go to stderr so machine output stays clean."""
    if notes:
        err = make_console(stderr=True)
        for note in notes:
            err.print(f"note: {note}")
    if fmt == "json" and probe is not None and sweep is not None:
        print_json({"probe": probe.to_dict(), "sweep": sweep.to_dict()})
        return
    if probe is not None and (sweep is None or fmt == "table"):
        print_probe(console, probe, fmt, saved_to=None if sweep is not None else saved_to)
    if sweep is not None:
        print_sweep(console, sweep, fmt, saved_to=saved_to)
