"""The CLI's plumbing: configs from options, output checks, printing and exit codes, and the one place
that turns a config field into its flag. The command modules hold only their commands' options."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from mbtune.errors import Interrupted, MbtuneError

if TYPE_CHECKING:
    from mbtune.probing.config import ProbeConfig
    from mbtune.report.progress import TrialProgressBar
    from mbtune.saving.session import RunOutcome
    from mbtune.serving.config import ServeConfig
    from mbtune.sweeping.config import SweepConfig

T = TypeVar("T")
quiet: list[bool] = [False]  # -q: no per-trial progress lines

def probe_config_from(options: Mapping[str, Any], *, steps: str = "steps") -> ProbeConfig:
    """The probe's config from a training command's options (`steps`: the option that holds the probe's
    trial steps; tune's is probe_steps)."""
    from mbtune.probing.config import ProbeConfig
    from mbtune.saving.profiles import command_line
    from mbtune.settings import MAX_BUDGET_BYTES
    from mbtune.units import parse_bytes, parse_list, parse_options

    o = options
    budget = parse_bytes(o["memory_budget"], name="--memory-budget", at_most=MAX_BUDGET_BYTES) if o["memory_budget"] is not None else None
    return ProbeConfig(
        workload=o["workload"], workload_options=parse_options(o["option"] or []), device=o["device"],
        memory_budget_bytes=budget, margin=o["margin"], granularity=o["granularity"], max_batch=o["max_batch"],
        confirm=o["confirm"], resolution=o["resolution"], predict=o["predict"], precision=o["precision"], optimizer=o["optimizer"],
        steps=o[steps], threads=o["threads"], trial_timeout_s=o["trial_timeout"], load_timeout_s=o["load_timeout"],
        lr=o["lr"], seed=o["seed"], recompute=parse_list(o["recompute"], name="--recompute", convert=str),
        command_line=command_line())


def sweep_config_from(options: Mapping[str, Any], launch: dict[str, Any]) -> SweepConfig:
    """The sweep's config from a training command's options and its launcher settings."""
    from mbtune.saving.profiles import command_line
    from mbtune.sweeping.config import DEFAULT_SCHEDULES, SweepConfig
    from mbtune.sweeping.stopping import default_repeats
    from mbtune.units import parse_list, parse_options

    o = options
    return SweepConfig(
        workload=o["workload"], workload_options=parse_options(o["option"] or []), device=o["device"],
        num_ranks=o["stages"], schedules=parse_list(o["schedules"], name="--schedules", convert=str) or DEFAULT_SCHEDULES,
        micro_batches=parse_list(o["micro_batches"], name="--micro-batches"),
        grad_accum_steps=parse_list(o["accum"], name="--accum"),
        micro_batch_size=parse_list(o["micro_batch_size"], name="--micro-batch-size"),
        global_batch=parse_list(o["global_batch"], name="--global-batch"),
        data_parallel_size=parse_list(o["data_parallel"], name="--data-parallel"),
        recompute=parse_list(o["recompute"], name="--recompute", convert=str), balance=o["balance"],
        objective=o["objective"], measured_steps=o["steps"], warmup_steps=o["warmup"],
        virtual_stages=o["virtual_stages"], optimizer=o["optimizer"], precision=o["precision"], threads=o["threads"],
        strategy=o["strategy"], repeats=default_repeats() if o["repeats"] is None else o["repeats"], target_ci=o["target_ci"],
        max_time_per_point_s=o["max_time_per_point"], pin_cpus=o["pin_cpus"], point_timeout_s=o["point_timeout"],
        load_timeout_s=o["load_timeout"], lr=o["lr"], reference_batch=o["reference_batch"], seed=o["seed"],
        command_line=command_line(), **launch)


def serve_config_from(*, p99: str, option: list[str] | None, memory_budget: str | None, rates: str | None,
                  concurrency: str | None, max_batch_sizes: str | None, queue_delays: str | None,
                  preferred: str | None, window: str, queue_timeout: str | None, **fields: Any) -> ServeConfig:
    from mbtune.saving.profiles import command_line
    from mbtune.serving.config import ServeConfig
    from mbtune.settings import MAX_BUDGET_BYTES
    from mbtune.units import parse_bytes, parse_duration, parse_list, parse_options

    delays = parse_list(queue_delays, name="--queue-delays", convert=str)
    return ServeConfig(
        p99_budget_s=parse_duration(p99, name="--p99"), workload_options=parse_options(option or []),
        memory_budget_bytes=parse_bytes(memory_budget, name="--memory-budget", at_most=MAX_BUDGET_BYTES) if memory_budget is not None else None,
        rates=parse_list(rates, name="--rates", convert=float), concurrency=parse_list(concurrency, name="--concurrency") or (),
        max_batch_sizes=parse_list(max_batch_sizes, name="--max-batch-sizes"),
        queue_delays_s=tuple(parse_duration(d, name="--queue-delays") for d in delays) if delays else None,
        preferred=parse_list(preferred, name="--preferred") or (), window_s=parse_duration(window, name="--window"),
        queue_timeout_s=parse_duration(queue_timeout, name="--queue-timeout") if queue_timeout is not None else None,
        command_line=command_line(), **fields)


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


def launch_settings(launcher: str, nnodes: int | None, node_rank: int | None, endpoint: str | None,
            join_timeout: float) -> dict[str, Any]:
    """The SweepConfig fields of --launcher and the node flags, filled from the scheduler's environment
    (Slurm, torchrun, Kubeflow PyTorchJob) where a flag is not given."""
    from mbtune.errors import ConfigError
    from mbtune.pipeline.nodes import LAUNCHERS, Nodes, nodes_from_env

    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}",
                          hint="Use --launcher local (one host) or --launcher torchrun.")
    if launcher == "local":
        given = [flag for flag, value in (("--nnodes", nnodes), ("--node-rank", node_rank),
                                          ("--rdzv-endpoint", endpoint)) if value is not None]
        if given and not (nnodes in (None, 1) and node_rank in (None, 0) and endpoint is None):
            raise ConfigError(f"{' and '.join(given)} need --launcher torchrun",
                              hint="Add --launcher torchrun: mbtune's own launcher reaches one host only.")
        return {}
    env = nodes_from_env()
    nodes = Nodes(nnodes=nnodes if nnodes is not None else env.get("nnodes", 1),
                  node_rank=node_rank if node_rank is not None else env.get("node_rank", 0),
                  endpoint=endpoint if endpoint is not None else env.get("endpoint"), join_timeout_s=join_timeout)
    return {"launcher": "torchrun", "nnodes": nodes.nnodes, "node_rank": nodes.node_rank,
            "rdzv_endpoint": nodes.endpoint, "join_timeout_s": nodes.join_timeout_s}


def lead_or_follow(launch: dict[str, Any]) -> None:
    """Under torchrun: node 0 opens the shared store now (the other nodes can join while it probes); any
    other node follows node 0's points until it says the run is over, then exits with its exit code."""
    import sys

    if not launch:
        return
    from mbtune.pipeline.nodes import Nodes
    from mbtune.pipeline.torchrun import command_fingerprint, session

    nodes = Nodes(nnodes=launch["nnodes"], node_rank=launch["node_rank"], endpoint=launch["rdzv_endpoint"],
                  join_timeout_s=launch["join_timeout_s"])
    opened = session(nodes, command_fingerprint(sys.argv[1:]))
    if nodes.leads:
        return
    from mbtune.report import make_console

    console = make_console(stderr=True)
    console.print(f"node {nodes.node_rank} of {nodes.nnodes}: following node 0 at {opened.endpoint}")
    code = opened.follow(say=lambda line: console.print(f"node {nodes.node_rank}: {line}"))
    console.print(f"node {nodes.node_rank}: node 0 ended the run (exit code {code})")
    raise typer.Exit(code)


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
    from mbtune.sweeping.grid import nothing_measured

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
