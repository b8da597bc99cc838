"""The training commands: probe, confirm, sweep and tune."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mbtune.cli import support
from mbtune.cli.options import (
    PROFILES,
    RECOMPUTE,
    SWEEP_ACCUM,
    SWEEP_DATA_PARALLEL,
    Accum,
    Balance,
    Budget,
    ConfigFile,
    Confirm,
    DataParallel,
    Device,
    Format,
    GlobalBatch,
    Granularity,
    JoinTimeout,
    Launcher,
    LoadTimeout,
    Lr,
    Margin,
    MaxBatch,
    MaxTimePerPoint,
    MicroBatches,
    MicroBatchSizes,
    NNodes,
    NodeRank,
    Objective,
    Optimizer,
    Output,
    P,
    PinCpus,
    Plot,
    PointTimeout,
    Precision,
    Predict,
    ProbeSteps,
    ProfilesDir,
    RdzvEndpoint,
    Recompute,
    ReferenceBatch,
    Repeats,
    Resolution,
    Resume,
    S,
    Save,
    Schedules,
    Seed,
    Stages,
    Strategy,
    SweepSteps,
    TargetCi,
    Threads,
    Trace,
    TrialTimeout,
    VirtualStages,
    Warmup,
    Workload,
    WorkloadOption,
)
from mbtune.cli.support import (
    PROFILE_HINT,
    check_inputs,
    check_run,
    finish,
    launch_settings,
    lead_or_follow,
    probe_config_from,
    sweep_config_from,
    target_folder,
    with_progress,
)


def probe(
    config_file: ConfigFile = None,
    workload: Workload = P.workload,
    option: WorkloadOption = None,
    device: Device = P.device,
    memory_budget: Budget = None,
    margin: Margin = P.margin,
    granularity: Granularity = P.granularity,
    max_batch: MaxBatch = P.max_batch,
    confirm: Confirm = P.confirm,
    resolution: Resolution = P.resolution,
    predict: Predict = P.predict,
    precision: Precision = P.precision,
    optimizer: Optimizer = P.optimizer,
    steps: ProbeSteps = P.steps,
    threads: Threads = P.threads,
    lr: Lr = P.lr,
    seed: Seed = P.seed,
    recompute: Recompute = RECOMPUTE,
    trial_timeout: TrialTimeout = P.trial_timeout_s,
    load_timeout: LoadTimeout = P.load_timeout_s,
    profiles_dir: ProfilesDir = PROFILES,
    save: Save = True,
    resume: Resume = False,
    format: Format = "table",
    output: Output = None,
) -> None:
    """Find the per-device memory ceiling with real training steps, then leave a safety margin."""
    options = dict(locals())
    from mbtune.saving.session import run_probe

    fmt = check_run(format, output, resume=resume, save=save)
    config = probe_config_from(options)
    outcome = with_progress("probe", lambda p: run_probe(config, p, profiles_dir=target_folder(profiles_dir, save),
                                                           resume=resume))
    finish(fmt, outcome, output=output)


def sweep(
    config_file: ConfigFile = None,
    workload: Workload = S.workload,
    option: WorkloadOption = None,
    device: Device = S.device,
    stages: Stages = S.num_ranks,
    schedules: Schedules = None,
    micro_batches: MicroBatches = None,
    accum: Accum = SWEEP_ACCUM,
    micro_batch_size: MicroBatchSizes = None,
    global_batch: GlobalBatch = None,
    data_parallel: DataParallel = SWEEP_DATA_PARALLEL,
    recompute: Recompute = RECOMPUTE,
    balance: Balance = "params",
    from_profile: Annotated[Path | None, typer.Option("--from-profile", help="A saved profile whose probe bounds the micro-batch size (safe batch) and gives the headroom (default: this device's saved profile, if any).")] = None,
    objective: Objective = S.objective,
    strategy: Strategy = S.strategy,
    steps: SweepSteps = S.measured_steps,
    repeats: Repeats = None,
    target_ci: TargetCi = S.target_ci,
    max_time_per_point: MaxTimePerPoint = S.max_time_per_point_s,
    pin_cpus: PinCpus = S.pin_cpus,
    warmup: Warmup = S.warmup_steps,
    virtual_stages: VirtualStages = S.virtual_stages,
    optimizer: Optimizer = S.optimizer,
    precision: Annotated[str, typer.Option("--precision", help="fp32 or bf16 (autocast in every stage).")] = S.precision,
    threads: Annotated[int | None, typer.Option(help="torch threads per stage process (default: cores / stages on CPU).")] = S.threads,
    lr: Lr = S.lr,
    reference_batch: ReferenceBatch = S.reference_batch,
    seed: Seed = S.seed,
    point_timeout: PointTimeout = S.point_timeout_s,
    load_timeout: LoadTimeout = S.load_timeout_s,
    launcher: Launcher = S.launcher,
    nnodes: NNodes = None,
    node_rank: NodeRank = None,
    rdzv_endpoint: RdzvEndpoint = None,
    join_timeout: JoinTimeout = S.join_timeout_s,
    profiles_dir: ProfilesDir = PROFILES,
    save: Save = True,
    resume: Resume = False,
    plot: Plot = None,
    trace: Trace = None,
    format: Format = "table",
    output: Output = None,
) -> None:
    """Run real pipelined training steps across micro-batches, accumulation steps and schedules."""
    options = dict(locals())
    from mbtune.saving.session import run_sweep, with_saved_limits

    fmt = check_run(format, output, resume=resume, save=save, plot=plot, trace=trace)
    launch = launch_settings(launcher, nnodes, node_rank, rdzv_endpoint, join_timeout)
    # The saved probe that bounds the micro-batch size is read here, before anything runs.
    check_inputs({"--from-profile": (from_profile, PROFILE_HINT)})
    config = with_saved_limits(sweep_config_from(options, launch), from_profile=from_profile, profiles_dir=profiles_dir)
    lead_or_follow(launch)
    outcome = with_progress("sweep", lambda p: run_sweep(config, p, profiles_dir=target_folder(profiles_dir, save),
                                                           resume=resume))
    finish(fmt, outcome, plot=plot, trace=trace, output=output)


def tune(
    config_file: ConfigFile = None,
    workload: Workload = P.workload,
    option: WorkloadOption = None,
    device: Device = P.device,
    memory_budget: Budget = None,
    margin: Margin = P.margin,
    granularity: Granularity = P.granularity,
    max_batch: MaxBatch = P.max_batch,
    confirm: Confirm = P.confirm,
    resolution: Resolution = P.resolution,
    predict: Predict = P.predict,
    probe_steps: Annotated[int, typer.Option("--probe-steps", help="Full training steps per probe trial (>= 2).")] = P.steps,
    trial_timeout: TrialTimeout = P.trial_timeout_s,
    stages: Stages = S.num_ranks,
    schedules: Schedules = None,
    micro_batches: MicroBatches = None,
    accum: Accum = SWEEP_ACCUM,
    micro_batch_size: MicroBatchSizes = None,
    global_batch: GlobalBatch = None,
    data_parallel: DataParallel = SWEEP_DATA_PARALLEL,
    recompute: Recompute = RECOMPUTE,
    balance: Balance = "params",
    objective: Objective = S.objective,
    strategy: Strategy = S.strategy,
    steps: SweepSteps = S.measured_steps,
    warmup: Warmup = S.warmup_steps,
    repeats: Repeats = None,
    target_ci: TargetCi = S.target_ci,
    max_time_per_point: MaxTimePerPoint = S.max_time_per_point_s,
    pin_cpus: PinCpus = S.pin_cpus,
    virtual_stages: VirtualStages = S.virtual_stages,
    optimizer: Optimizer = S.optimizer,
    precision: Annotated[str, typer.Option("--precision", help="fp32 or bf16 (autocast), for the probe and the sweep.")] = S.precision,
    threads: Threads = S.threads,
    lr: Lr = S.lr,
    reference_batch: ReferenceBatch = S.reference_batch,
    seed: Seed = S.seed,
    point_timeout: PointTimeout = S.point_timeout_s,
    load_timeout: LoadTimeout = S.load_timeout_s,
    check: Annotated[bool, typer.Option(help="Check the best row's update against the plain model's (mbtune check) and show the verdict.")] = True,
    launcher: Launcher = S.launcher,
    nnodes: NNodes = None,
    node_rank: NodeRank = None,
    rdzv_endpoint: RdzvEndpoint = None,
    join_timeout: JoinTimeout = S.join_timeout_s,
    profiles_dir: ProfilesDir = PROFILES,
    save: Save = True,
    resume: Resume = False,
    plot: Plot = None,
    trace: Trace = None,
    format: Format = "table",
    output: Output = None,
) -> None:
    """Probe the memory ceiling, sweep pipeline configurations around the safe batch, check the best one's update."""
    options = dict(locals())
    from mbtune.saving.session import run_tune
    fmt = check_run(format, output, resume=resume, save=save, plot=plot, trace=trace)
    launch = launch_settings(launcher, nnodes, node_rank, rdzv_endpoint, join_timeout)
    probe_config, sweep_config = probe_config_from(options, steps="probe_steps"), sweep_config_from(options, launch)
    lead_or_follow(launch)
    outcome = with_progress("tune", lambda p: run_tune(probe_config, sweep_config, p, check=check,
                                                         profiles_dir=target_folder(profiles_dir, save), resume=resume))
    finish(fmt, outcome, plot=plot, trace=trace, output=output)


def confirm(
    command: Annotated[list[str], typer.Argument(help="The training command, after --, as you would run it (at the batch size to confirm).", show_default=False)],
    memory_budget: Annotated[str, typer.Option("--memory-budget", help="The budget to hold it to, e.g. 3GiB: the probe's, so the cap is a probe trial's.")],
    runs: Annotated[int, typer.Option("--runs", help="Runs, each in fresh processes.")] = 3,
    device: Device = "auto",
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds a run may take before it is stopped (counts as crashed).")] = 3600.0,
    format: Annotated[str, typer.Option("--format", "-f", help="table (people) or json (machines).")] = "table",
) -> None:
    """Run your own training command under the cap a probe trial runs under (CPU: live tensor bytes; CUDA:
    the per-process memory fraction), set before its first line: exit 0 when every run fits, 1 when one ran
    out of memory, 3 when one crashed otherwise."""
    from mbtune.cli.support import check_format
    from mbtune.device import resolve_device
    from mbtune.probing.confirm import confirm_command
    from mbtune.report import make_console
    from mbtune.report.confirm import print_confirm, print_confirm_run
    from mbtune.settings import MAX_BUDGET_BYTES, MAX_COUNT
    from mbtune.units import parse_bytes
    from mbtune.validation import require

    fmt = check_format(format, allowed=("table", "json"))
    budget = parse_bytes(memory_budget, name="--memory-budget", at_most=MAX_BUDGET_BYTES)
    require(1 <= runs <= MAX_COUNT, "runs", runs, f"an integer from 1 to {MAX_COUNT}")
    require(0 < timeout <= 1e9, "timeout", timeout, "seconds > 0")
    progress = make_console(stderr=True)
    result = confirm_command(command, memory_budget_bytes=budget, runs=runs, device=resolve_device(device),
                             timeout_s=timeout, on_run=None if support.quiet[0] else
                             lambda index, run: print_confirm_run(progress, index, run))
    print_confirm(make_console(), result, fmt)
    raise typer.Exit(result.exit_code)
