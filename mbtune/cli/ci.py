"""The commands CI jobs and people read results with: show, qualify, compare and check."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mbtune.checking.config import CheckConfig
from mbtune.cli.options import (
    PROFILES,
    C,
    Device,
    Format,
    FormerVirtualStages,
    JoinTimeout,
    Launcher,
    LoadTimeout,
    Lr,
    NNodes,
    NodeRank,
    Optimizer,
    Output,
    RdzvEndpoint,
    Resume,
    S,
    Save,
    Seed,
    Stages,
    StagesPerRank,
    Workload,
    WorkloadOption,
)
from mbtune.cli.support import (
    PROFILE_HINT,
    TOML_HINT,
    check_format,
    check_inputs,
    check_output,
    check_outputs,
    check_resume,
    interrupted_exit_code,
    note_on_stderr,
    printing_to,
    say_on_stderr,
    settings_in,
    target_folder,
    with_progress,
)
from mbtune.errors import EXIT_CHECK_FAILED
from mbtune.pipeline.theory import SCHEDULE_NAMES


def show(
    profile: Annotated[Path, typer.Argument(help="A profile file written by probe (profiles/<device>/<workload>.json).")],
    errors: Annotated[bool, typer.Option("--errors", help="Also print every failed trial's and point's whole error tail (traceback and stderr).")] = False,
    warnings: Annotated[bool, typer.Option("--warnings", help="Print every sweep point's warnings one by one (by default, one line per cause).")] = False,
    format: Format = "table",
    output: Output = None,
) -> None:
    """Print a saved profile again."""
    from mbtune.report import make_console
    from mbtune.report.profile import print_profile
    from mbtune.saving.profiles import load_profile

    fmt = check_output(check_format(format), output)
    loaded = load_profile(profile)
    with printing_to(output):
        print_profile(make_console(), loaded, fmt, path=str(profile), errors=errors, warnings=warnings)


def qualify(
    baseline: Annotated[Path | None, typer.Option("--baseline", help="Profile to re-run and compare against (profiles/<device>/<workload>.json).")] = None,
    spec: Annotated[Path | None, typer.Option("--spec", help="Qualification spec (TOML): workload, device, budget, sweep lists, thresholds.")] = None,
    tolerance: Annotated[str | None, typer.Option("--tolerance", help="Allowed shortfall against the baseline, e.g. 10% (default 10%, or the spec's).")] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", help="Runs of each sweep point, each in fresh processes; checks use the median and the spread over them (default: each point until its throughput is known, or the spec's).")] = None,
    allow_different_device: Annotated[bool, typer.Option("--allow-different-device", help="Compare against a baseline measured on another device model.")] = False,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write a JUnit XML file: one testcase per check.")] = None,
    profiles_dir: Annotated[Path, typer.Option("--profiles-dir", help="Where this run's measurements are saved (kept apart from baselines).")] = PROFILES / "qualify-runs",
    save: Save = True,
    history: Annotated[bool, typer.Option(help="Add this run to the history of this machine against this baseline (or spec) in --profiles-dir/history, and name the latest step of each gating check's series (see mbtune history).")] = True,
    until_decided: Annotated[bool, typer.Option("--until-decided", help="While the verdict is INCONCLUSIVE, measure again, each round twice as precisely, until it is decided or --max-time would pass.")] = False,
    max_time: Annotated[str, typer.Option("--max-time", help="With --until-decided: the time every round together may take, e.g. 30m or 2h.")] = "30m",
    resume: Resume = False,
    format: Annotated[str, typer.Option("--format", "-f", help="table (people) or json (machines).")] = "table",
    launcher: Launcher = S.launcher,
    nnodes: NNodes = None,
    node_rank: NodeRank = None,
    rdzv_endpoint: RdzvEndpoint = None,
    join_timeout: JoinTimeout = S.join_timeout_s,
) -> None:
    """Re-run a baseline's probe and sweep here and give a verdict: exit 0 pass, 1 a check failed, 3 could not run,
    4 inconclusive (the measured spread is wider than the tolerance)."""
    from mbtune.pipeline.nodes import launch_nodes
    from mbtune.qualifying.judge import exit_code
    from mbtune.qualifying.run import run_qualify
    from mbtune.qualifying.specfile import read_spec
    from mbtune.report import make_console
    from mbtune.report.qualify import print_verdict, write_junit
    from mbtune.saving.profiles import command_line
    from mbtune.saving.session import lead_or_follow
    from mbtune.units import parse_duration, parse_fraction

    fmt = check_format(format, allowed=("table", "json"))
    check_resume(resume, save)
    check_outputs(files={"--junit": junit})
    check_inputs({"--baseline": (baseline, PROFILE_HINT), "--spec": (spec, TOML_HINT)})
    nodes = launch_nodes(launcher, nnodes=nnodes, node_rank=node_rank, endpoint=rdzv_endpoint, join_timeout_s=join_timeout)
    launch = nodes if launcher == "torchrun" else None
    # Before the spec and baseline are read: only node 0 needs those files.
    if (followed := lead_or_follow(launch, say_on_stderr)) is not None:
        raise typer.Exit(followed)
    share = parse_fraction(tolerance, name="--tolerance") if tolerance is not None else None
    until_s = parse_duration(max_time, name="--max-time") if until_decided else None
    path = str(baseline) if baseline else None
    plan, repeats = read_spec(spec, baseline=path, tolerance=share, repeats=repeats,
                              allow_different_device=allow_different_device, command_line=command_line(),
                              said=note_on_stderr)
    verdict = with_progress("qualify", lambda p: run_qualify(plan, p, profiles_dir=target_folder(profiles_dir, save),
                                                               repeats=repeats, launch=launch, resume=resume,
                                                               history_dir=profiles_dir if history and save else None,
                                                               against=str(baseline or spec), until_decided_s=until_s))
    if junit is not None:
        write_junit(verdict, junit)
    print_verdict(make_console(), verdict, fmt)
    if verdict.sweep is not None and verdict.sweep.interrupted:  # a verdict on part of the points is no verdict
        raise typer.Exit(interrupted_exit_code())
    raise typer.Exit(exit_code(verdict.status))


def history(
    profiles_dir: Annotated[Path, typer.Option("--profiles-dir", help="The folder qualify's --profiles-dir wrote to; its histories are under history/.")] = PROFILES / "qualify-runs",
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG per history into this folder: each gating check's series, its steps marked (needs matplotlib).")] = None,
    format: Format = "table",
    output: Output = None,
) -> None:
    """Show every qualification run kept, each gating check's series, and the steps found in them."""
    from mbtune.qualifying.history import read_histories
    from mbtune.report import make_console
    from mbtune.report.history import print_histories, write_history_plots

    fmt = check_output(check_format(format), output)
    check_outputs(plot_dir=plot)
    shown = read_histories(profiles_dir)
    with printing_to(output):
        print_histories(make_console(), shown, fmt)
    if plot is not None:
        for path in write_history_plots(shown, plot):
            say_on_stderr(f"wrote {path}")


def compare(
    a: Annotated[Path, typer.Argument(help="First profile (A).")],
    b: Annotated[Path, typer.Argument(help="Second profile (B); ratios are B / A.")],
    allow_different_device: Annotated[bool, typer.Option("--allow-different-device", help="Compare profiles measured on different device models.")] = False,
    allow_different_workload: Annotated[bool, typer.Option("--allow-different-workload", help="Compare profiles of different workloads, options, precisions or optimizers.")] = False,
    format: Annotated[str, typer.Option("--format", "-f", help="table (people) or json (machines).")] = "table",
) -> None:
    """Print two saved profiles side by side with ratios."""
    from mbtune.qualifying.compare import compare_files
    from mbtune.report import make_console
    from mbtune.report.qualify import print_comparison

    fmt = check_format(format, allowed=("table", "json"))
    rows = compare_files(a, b, allow_different_device=allow_different_device,
                         allow_different_workload=allow_different_workload)
    print_comparison(make_console(), rows, str(a), str(b), fmt)


# The options that say which pipeline to check: with none of them, check validates the workload alone.
PIPELINE_OPTIONS = ("stages", "schedule", "micro_batches", "accum", "data_parallel", "recompute", "micro_batch_size",
                    "global_batch", "stages_per_rank", "virtual_stages", "precision", "optimizer", "lr", "from_profile", "rank", "from_old")


def check(
    ctx: typer.Context,
    workload: Workload = C.workload,
    option: WorkloadOption = None,
    device: Device = C.device,
    stages: Stages = C.num_ranks,
    schedule: Annotated[str, typer.Option("--schedule", help=f"One schedule: {', '.join(SCHEDULE_NAMES[:-1])} or {SCHEDULE_NAMES[-1]}.")] = C.schedule,
    micro_batches: Annotated[int, typer.Option("--micro-batches", "-m", help="Micro-batches per pipeline step.")] = C.num_micro_batches,
    accum: Annotated[int, typer.Option("--accum", help="Gradient-accumulation steps per optimizer step.")] = C.grad_accum_steps,
    data_parallel: Annotated[int, typer.Option("--data-parallel", help="Data-parallel replicas of the pipeline (gradients all-reduced).")] = C.data_parallel_size,
    recompute: Annotated[str, typer.Option("--recompute", help="none or full: activation recompute in the pipeline (the plain model never recomputes).")] = C.recompute,
    micro_batch_size: Annotated[int | None, typer.Option("--micro-batch-size", help="Samples per micro-batch (default 2, or from --global-batch).")] = C.micro_batch_size,
    global_batch: Annotated[int | None, typer.Option("--global-batch", help="Samples per optimizer step; the micro-batch size follows.")] = C.global_batch,
    stages_per_rank: StagesPerRank = C.stages_per_rank,
    virtual_stages: FormerVirtualStages = None,
    precision: Annotated[str, typer.Option("--precision", help="fp32 or bf16 (autocast), in the pipeline and the plain model.")] = C.precision,
    optimizer: Optimizer = C.optimizer,
    lr: Lr = C.lr,
    seed: Seed = C.seed,
    from_profile: Annotated[Path | None, typer.Option("--from-profile", help="Check a row of a saved profile's sweep instead (with --rank).")] = None,
    rank: Annotated[int, typer.Option("--rank", help="With --from-profile: the row, by rank (1 is the best).")] = 1,
    from_old: Annotated[Path | None, typer.Option("--from", hidden=True, help="The old spelling of --from-profile.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds the pipeline, and then the plain model, may take.")] = C.timeout_s,
    load_timeout: LoadTimeout = C.load_timeout_s,
    format: Annotated[str, typer.Option("--format", "-f", help="table (people) or json (machines).")] = "table",
) -> None:
    """Validate the workload (no pipeline options: each block's hand-over both ways, parameters, FLOPs, the
    split against the model, in seconds on the CPU), or run one optimizer step through the real pipeline and
    through the plain model on the same global batch and seed and compare the gradients per block: exit 0
    PASS, 1 FAIL (with why), 3 could not run."""
    from mbtune.checking.run import check_update
    from mbtune.report import make_console
    from mbtune.report.check import print_check, print_validation
    from mbtune.saving.session import check_config_from_profile
    from mbtune.units import parse_options

    fmt = check_format(format, allowed=("table", "json"))
    if all(getattr(ctx.get_parameter_source(name), "name", "DEFAULT") == "DEFAULT" for name in PIPELINE_OPTIONS):
        from mbtune.checking.workload import validate_workload

        validated = validate_workload(workload, parse_options(option or []), seed=seed, timeout_s=timeout)
        print_validation(make_console(), validated, fmt)
        raise typer.Exit(0 if validated.status == "PASS" else EXIT_CHECK_FAILED)
    if from_old is not None:
        note_on_stderr("--from is now --from-profile (as in sweep); the former name goes in a later release")
        from_profile = from_profile or from_old
    check_inputs({"--from-profile": (from_profile, PROFILE_HINT)})
    if from_profile is not None:
        config = check_config_from_profile(from_profile, rank, device=device, timeout=timeout,
                                           load_timeout=load_timeout, seed=seed, lr=lr)
    else:
        config = settings_in(ctx.params, CheckConfig, leave=("from_old",))
    result = check_update(config)
    print_check(make_console(), result, fmt)
    raise typer.Exit(0 if result.status == "PASS" else EXIT_CHECK_FAILED)
