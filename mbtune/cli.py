"""The typer app. Each command parses options, builds a config, calls one library function and hands the
record to report/. No torch import at module top and no logic here."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from mbtune import __version__
from mbtune.errors import Interrupted, MbtuneError

app = typer.Typer(
    name="mbtune", no_args_is_help=True, add_completion=False, rich_markup_mode=None,
    help="Profile real hardware to find the best batch configuration for pipeline-parallel training.",
)

Workload = Annotated[str, typer.Option("--workload", "-w", help="Built-in workload (gpt, mlp) or package.module:factory.")]
WorkloadOption = Annotated[Optional[list[str]], typer.Option("--option", "-O", help="Workload option KEY=VALUE, repeatable (e.g. -O layers=8).")]
Device = Annotated[str, typer.Option("--device", "-d", help="auto, cpu, cuda or cuda:N.")]
Budget = Annotated[Optional[str], typer.Option("--memory-budget", help="Memory a trial may use, e.g. 3GiB. CPU: address-space cap; CUDA: per-process memory fraction (default: whole device).")]
Format = Annotated[str, typer.Option("--format", "-f", help="table (people), json or csv (machines).")]
Precision = Annotated[str, typer.Option("--precision", help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler, CUDA only).")]
Optimizer = Annotated[str, typer.Option("--optimizer", help="adamw or sgd (optimizer state counts toward memory).")]
ProfilesDir = Annotated[Path, typer.Option("--profiles-dir", help="Folder that holds saved profiles.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mbtune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Profile real hardware to find the best batch configuration for pipeline-parallel training."""


@app.command()
def probe(
    workload: Workload = "gpt",
    option: WorkloadOption = None,
    device: Device = "auto",
    memory_budget: Budget = None,
    margin: Annotated[float, typer.Option(help="Safety margin below the ceiling, 0-0.5 (usual 0.10-0.20).")] = 0.15,
    granularity: Annotated[int, typer.Option(help="Batch sizes are multiples of this.")] = 1,
    max_batch: Annotated[Optional[int], typer.Option("--max-batch", help="Stop growing at this batch size.")] = None,
    confirm: Annotated[int, typer.Option(help="Times the ceiling must pass before it is reported.")] = 2,
    precision: Precision = "fp32",
    optimizer: Optimizer = "adamw",
    steps: Annotated[int, typer.Option(help="Full training steps per trial (>= 2, so optimizer state exists).")] = 2,
    threads: Annotated[Optional[int], typer.Option(help="torch threads per trial (default: all cores).")] = None,
    trial_timeout: Annotated[float, typer.Option("--trial-timeout", help="Seconds before a trial is killed.")] = 600.0,
    profiles_dir: ProfilesDir = Path("profiles"),
    save: Annotated[bool, typer.Option(help="Save the result to profiles/<device>/<workload>.json.")] = True,
    format: Format = "table",
) -> None:
    """Find the per-device memory ceiling with real training steps, then leave a safety margin."""
    from mbtune.config import ProbeConfig, parse_bytes, parse_options
    from mbtune.jobs import probe_workload
    from mbtune.profiles import command_line, save_probe
    from mbtune.report import make_console
    from mbtune.report.probe import print_probe
    from mbtune.report.progress import TrialProgressBar

    fmt = _check_format(format)
    config = ProbeConfig(
        workload=workload, workload_options=parse_options(option or []), device=device,
        memory_budget_bytes=parse_bytes(memory_budget, name="--memory-budget") if memory_budget else None,
        margin=margin, granularity=granularity, max_batch=max_batch, confirm=confirm, precision=precision,
        optimizer=optimizer, steps=steps, threads=threads, trial_timeout_s=trial_timeout,
    )
    console = make_console()
    with TrialProgressBar(make_console(stderr=True), label="probe") as progress:
        result = probe_workload(config, progress)
    saved = save_probe(profiles_dir, result, command_line()) if save else None
    print_probe(console, result, fmt, saved_to=str(saved) if saved else None)


@app.command()
def show(
    profile: Annotated[Path, typer.Argument(help="A profile file written by probe (profiles/<device>/<workload>.json).")],
    format: Format = "table",
) -> None:
    """Print a saved profile again."""
    from mbtune.profiles import load_profile
    from mbtune.report import make_console
    from mbtune.report.profile import print_profile

    fmt = _check_format(format)
    print_profile(make_console(), load_profile(profile), fmt, path=str(profile))


def _check_format(fmt: str) -> str:
    from mbtune.errors import ConfigError
    from mbtune.report import FORMATS

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}", hint="Use --format table, json or csv.")
    return fmt


def _interrupted(signum: int, frame: object) -> None:
    # Our own exception rather than KeyboardInterrupt, which click would turn into "Aborted!" and exit 1.
    raise Interrupted("interrupted; every finished trial was kept")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app and map known errors to one line and an exit code."""
    from mbtune.report import print_error

    signal.signal(signal.SIGINT, _interrupted)
    try:
        app(args=argv, prog_name="mbtune")
    except MbtuneError as exc:
        if os.environ.get("MBTUNE_DEBUG"):
            raise
        print_error(exc.one_line())
        sys.exit(exc.exit_code)
