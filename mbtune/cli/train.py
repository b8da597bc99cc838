"""The training commands: probe, sweep and tune."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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
    MicroBatches,
    MicroBatchSizes,
    NNodes,
    NodeRank,
    Objective,
    Optimizer,
    Output,
    P,
    Plot,
    PointTimeout,
    Precision,
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
    Threads,
    Trace,
    TrialTimeout,
    VirtualStages,
    Warmup,
    Workload,
    WorkloadOption,
)
from mbtune.cli.support import (
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
    from mbtune.session import run_probe

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
    repeats: Repeats = S.repeats,
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
    from mbtune.session import run_sweep, with_saved_limits

    fmt = check_run(format, output, resume=resume, save=save, plot=plot, trace=trace)
    launch = launch_settings(launcher, nnodes, node_rank, rdzv_endpoint, join_timeout)
    # The saved probe that bounds the micro-batch size is read here, before anything runs.
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
    repeats: Repeats = S.repeats,
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
    from mbtune.session import run_tune
    fmt = check_run(format, output, resume=resume, save=save, plot=plot, trace=trace)
    launch = launch_settings(launcher, nnodes, node_rank, rdzv_endpoint, join_timeout)
    probe_config, sweep_config = probe_config_from(options, steps="probe_steps"), sweep_config_from(options, launch)
    lead_or_follow(launch)
    outcome = with_progress("tune", lambda p: run_tune(probe_config, sweep_config, p, check=check,
                                                         profiles_dir=target_folder(profiles_dir, save), resume=resume))
    finish(fmt, outcome, plot=plot, trace=trace, output=output)
