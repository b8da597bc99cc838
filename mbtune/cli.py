"""The typer app. Each command parses options, builds a config, calls one library function and hands the
record to report/. No torch import at module top and no logic here."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from mbtune import __version__, cli_support
from mbtune.cli_support import (
    _as_flag,
    _check_format,
    _check_output,
    _check_outputs,
    _check_resume,
    _finish,
    _finish_serve,
    _interrupted,
    _launch,
    _lead_or_follow,
    _printing_to,
    _probe_config,
    _save_traceback,
    _serve_config,
    _sweep_config,
    _target,
    _with_progress,
)
from mbtune.config import (
    DEFAULT_PLAN_MICRO_BATCHES,
    DEFAULT_PLAN_RANKS,
    DEFAULT_PLAN_SCATTER,
    DEFAULT_PLAN_VALIDATION,
    CheckConfig,
    ProbeConfig,
    QualifySpec,
    SweepConfig,
)
from mbtune.errors import EXIT_CHECK_FAILED, EXIT_COULD_NOT_RUN, Interrupted, MbtuneError
from mbtune.serving.config import DEFAULT_SERVE_MAX_BATCH

T = TypeVar("T")
P, S, C = ProbeConfig, SweepConfig, CheckConfig  # every default is the config's own
PROFILES = Path("profiles")  # where saved profiles go, relative to the current folder


SWEEP_ACCUM, SWEEP_DATA_PARALLEL, RECOMPUTE, PLAN_MICRO_BATCHES = (
    ",".join(map(str, v)) for v in (S.accum_steps, S.data_parallel, S.recompute, DEFAULT_PLAN_MICRO_BATCHES))

app = typer.Typer(
    name="mbtune", no_args_is_help=True, add_completion=True, rich_markup_mode=None, pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Profile real hardware to find the best batch configuration for pipeline-parallel training.",
)

Workload = Annotated[str, typer.Option("--workload", "-w", help="Built-in workload (gpt, mlp) or package.module:factory.")]
WorkloadOption = Annotated[list[str] | None, typer.Option("--option", "-O", help="Workload option KEY=VALUE, repeatable (e.g. -O layers=8).")]
Device = Annotated[str, typer.Option("--device", "-d", envvar="MBTUNE_DEVICE", help="auto, cpu, cuda or cuda:N.")]
Budget = Annotated[str | None, typer.Option("--memory-budget", help="Memory a trial may use, e.g. 3GiB. CPU: address-space cap; CUDA: per-process memory fraction (default: whole device).")]
Format = Annotated[str, typer.Option("--format", "-f", help="table (people), json or csv (machines).")]
Precision = Annotated[str, typer.Option("--precision", help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler, CUDA only).")]
Optimizer = Annotated[str, typer.Option("--optimizer", help="adamw or sgd (optimizer state counts toward memory).")]
ProfilesDir = Annotated[Path, typer.Option("--profiles-dir", envvar="MBTUNE_PROFILES_DIR", help="Folder that holds saved profiles.")]
Save = Annotated[bool, typer.Option(help="Save results to profiles/<device>/<workload>.json, journaling each finished trial as it ends.")]
Plot = Annotated[Path | None, typer.Option("--plot", help="Write PNG pictures (timeline, throughput, bubble, memory) into this folder (needs matplotlib).")]
Trace = Annotated[Path | None, typer.Option("--trace", help="Write the best point's timeline as Chrome trace-event JSON (opens in Perfetto).")]
Output = Annotated[Path | None, typer.Option("--output", "-o", help="Write the json or csv output to this file instead of stdout (a .json or .csv name picks the format).")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run of the same command from its journal, without re-running finished trials.")]
LoadTimeout = Annotated[float, typer.Option("--load-timeout", help="Seconds to import the workload's module and call its factory (in a child process) before giving up.")]
TrialTimeout = Annotated[float, typer.Option("--trial-timeout", help="Seconds before a probe trial is killed.")]
Confirm = Annotated[int, typer.Option("--confirm", help="Fresh runs the ceiling and the safe batch must each pass.")]
ProbeSteps = Annotated[int, typer.Option("--steps", help="Full training steps per probe trial (>= 2).")]
Lr = Annotated[float | None, typer.Option("--lr", help="Learning rate to train with (default: 1e-4 for adamw, 1e-3 for sgd); with --reference-batch, the recipe's, scaled per row.")]
ReferenceBatch = Annotated[int | None, typer.Option("--reference-batch", help="The recipe's global batch: each row's lr is --lr scaled from it (linear for sgd, square root for adamw); default: the smallest global batch that ran.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the model's weights and of the synthetic batches.")]
Threads = Annotated[int | None, typer.Option("--threads", help="torch threads per process (default: all cores for a probe trial, cores / stages for a pipeline stage).")]
Margin = Annotated[float, typer.Option(help="Safety margin below the ceiling, 0-0.5 (usual 0.10-0.20).")]
Granularity = Annotated[int, typer.Option(help="Probe batch sizes are multiples of this.")]
MaxBatch = Annotated[int | None, typer.Option("--max-batch", help="Stop the probe growing at this batch size.")]
Resolution = Annotated[int | None, typer.Option(help="Stop the probe once [ceiling, first failing) is this narrow (default: 1% of the ceiling, at least one granule; 1: the exact answer).")]
Recompute = Annotated[str, typer.Option("--recompute", help="Comma list of none, full: activation recompute of every block (torch.utils.checkpoint). A probe searches once per mode; a sweep runs each point per mode.")]
Balance = Annotated[str, typer.Option("--balance", help="Split blocks over stages by params (compute-bearing parameters) or time (each block's forward + backward, measured once by a timing pass before the sweep).")]
Strategy = Annotated[str, typer.Option("--strategy", help="grid: run every runnable point; quick: the simulator, calibrated on a few points, picks what to run.")]


def _settings_file(ctx: typer.Context, value: Path | None) -> Path | None:
    """--config: the file's settings become this command's defaults, so flags given on the command line win."""
    if value is not None:
        from mbtune.specfile import read_settings

        command = ctx.command.name or ""
        known = {param.name for param in ctx.command.params}
        ctx.default_map = {k: v for k, v in read_settings(value, command).items() if k in known}
    return value


ConfigFile = Annotated[Path | None, typer.Option("--config", is_eager=True, callback=_settings_file, help="TOML settings in qualify's spec schema (workload, device, memory_budget, [options], [probe], [sweep]); flags given on the command line win over it.")]


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
    cli_support.quiet[0] = quiet
    if verbose:
        from mbtune.report import log_to_stderr

        log_to_stderr(verbose)


@app.command()
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
    from mbtune.runs import run_probe

    fmt = _check_output(_check_format(format), output)
    _check_resume(resume, save)
    config = _probe_config(
        workload=workload, option=option, device=device, memory_budget=memory_budget, margin=margin,
        granularity=granularity, max_batch=max_batch, confirm=confirm, resolution=resolution, precision=precision,
        optimizer=optimizer, steps=steps, threads=threads, trial_timeout_s=trial_timeout, load_timeout_s=load_timeout,
        lr=lr, seed=seed, recompute=recompute,
    )
    outcome = _with_progress("probe", lambda p: run_probe(config, p, profiles_dir=_target(profiles_dir, save),
                                                           resume=resume))
    _finish(fmt, outcome, output=output)


Stages = Annotated[int, typer.Option("--stages", "-p", help="Pipeline stages (one process each; one GPU each on CUDA).")]
Schedules = Annotated[str | None, typer.Option("--schedules", help="Comma list of gpipe, 1f1b, interleaved-1f1b, looped-bfs, zero-bubble, zbv (default: gpipe,1f1b,interleaved-1f1b,zero-bubble).")]
MicroBatches = Annotated[str | None, typer.Option("--micro-batches", "-m", help="Comma list of micro-batch counts (default: p,2p,4p).")]
Accum = Annotated[str, typer.Option("--accum", help="Comma list of gradient-accumulation steps.")]
MicroBatchSize = Annotated[int | None, typer.Option("--micro-batch-size", help="Samples per micro-batch (default: probed safe batch / largest micro-batch count, else 4).")]
MicroBatchSizes = Annotated[str | None, typer.Option("--micro-batch-size", help="Comma list of fixed micro-batch sizes; the global batch then varies from row to row (default: the global batch is held fixed, see --global-batch).")]
DataParallel = Annotated[str, typer.Option("--data-parallel", help="Comma list of data-parallel replica counts: each runs stages x N processes, gradients all-reduced across replicas every optimizer step.")]
GlobalBatch = Annotated[str | None, typer.Option("--global-batch", help="Comma list of global batches, each held fixed and split every way the grid allows (the micro-batch size follows per point); default with a probe: the largest power of two the fewest micro-batches, accumulation steps and replicas hold at the safe batch.")]
PlanGlobalBatch = Annotated[int | None, typer.Option("--global-batch", help="Fix the global batch instead; the micro-batch size follows per point.")]
Objective = Annotated[str, typer.Option("--objective", help="Rank by throughput, memory or bubble.")]
SweepSteps = Annotated[int, typer.Option("--steps", help="Measured optimizer steps per point (after warm-up).")]
Warmup = Annotated[int, typer.Option("--warmup", help="Warm-up optimizer steps per point (not timed).")]
VirtualStages = Annotated[int, typer.Option("--virtual-stages", help="Stages per rank for interleaved/looped schedules.")]
PointTimeout = Annotated[float, typer.Option("--point-timeout", help="Seconds before a point's processes are killed.")]
Launcher = Annotated[str, typer.Option("--launcher", help="Who starts each point's ranks: local (mbtune's own, one host, fastest) or torchrun (torch.distributed.run's elastic agent with a c10d rendezvous; needed across nodes).")]
NNodes = Annotated[int | None, typer.Option("--nnodes", help="Nodes the run spans, with --launcher torchrun; the same command runs on every node (default: the scheduler's PET_NNODES or SLURM_JOB_NUM_NODES, else 1).")]
NodeRank = Annotated[int | None, typer.Option("--node-rank", help="This node's number, 0 to nnodes-1: node 0 leads, prints and saves; the others follow it and write nothing (default: PET_NODE_RANK, GROUP_RANK or SLURM_NODEID, else 0).")]
RdzvEndpoint = Annotated[str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT where the nodes meet: node 0's address and a free port (default: PET_RDZV_ENDPOINT, or MASTER_ADDR:MASTER_PORT).")]
JoinTimeout = Annotated[float, typer.Option("--join-timeout", help="Seconds every node gets to join, at the start and at each point's rendezvous.")]
Repeats = Annotated[int, typer.Option("--repeats", help="Runs of each point, each in fresh processes: figures are the median with the range over repeats.")]


@app.command()
def sweep(
    config_file: ConfigFile = None,
    workload: Workload = S.workload,
    option: WorkloadOption = None,
    device: Device = S.device,
    stages: Stages = S.num_stages,
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
    from mbtune.runs import run_sweep

    fmt = _check_output(_check_format(format), output)
    _check_resume(resume, save)
    _check_outputs(plot_dir=plot, files=(trace,))
    launch = _launch(launcher, nnodes, node_rank, rdzv_endpoint, join_timeout)
    config = _sweep_config(
        workload=workload, option=option, device=device, stages=stages, schedules=schedules,
        micro_batches=micro_batches, accum=accum, micro_batch_size=micro_batch_size, global_batch=global_batch,
        data_parallel=data_parallel, recompute=recompute, balance=balance, from_profile=from_profile,
        objective=objective, steps=steps, warmup=warmup, virtual_stages=virtual_stages,
        optimizer=optimizer, precision=precision, threads=threads, point_timeout=point_timeout,
        load_timeout=load_timeout, profiles_dir=profiles_dir, strategy=strategy, repeats=repeats, lr=lr,
        reference_batch=reference_batch, seed=seed, launch=launch,
    )
    _lead_or_follow(launch)
    outcome = _with_progress("sweep", lambda p: run_sweep(config, p, profiles_dir=_target(profiles_dir, save),
                                                           resume=resume))
    _finish(fmt, outcome, plot=plot, trace=trace, output=output)


@app.command()
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
    stages: Stages = S.num_stages,
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
    """Probe the memory ceiling, then sweep pipeline configurations around the safe batch, then check the
    best one's update against the plain model's."""
    from mbtune.runs import run_tune

    fmt = _check_output(_check_format(format), output)
    _check_resume(resume, save)
    _check_outputs(plot_dir=plot, files=(trace,))
    launch = _launch(launcher, nnodes, node_rank, rdzv_endpoint, join_timeout)
    probe_config = _probe_config(workload=workload, option=option, device=device, memory_budget=memory_budget,
                                 margin=margin, granularity=granularity, max_batch=max_batch, confirm=confirm,
                                 resolution=resolution, steps=probe_steps, optimizer=optimizer, precision=precision,
                                 threads=threads, trial_timeout_s=trial_timeout, load_timeout_s=load_timeout,
                                 lr=lr, seed=seed, recompute=recompute)
    sweep_config = _sweep_config(workload=workload, option=option, device=device, stages=stages,
                                 schedules=schedules, micro_batches=micro_batches, accum=accum,
                                 micro_batch_size=micro_batch_size, global_batch=global_batch,
                                 data_parallel=data_parallel, recompute=recompute, balance=balance,
                                 objective=objective,
                                 strategy=strategy, steps=steps, warmup=warmup, repeats=repeats,
                                 virtual_stages=virtual_stages, optimizer=optimizer, precision=precision,
                                 threads=threads, point_timeout=point_timeout, load_timeout=load_timeout,
                                 lr=lr, reference_batch=reference_batch, seed=seed, launch=launch)
    _lead_or_follow(launch)
    outcome = _with_progress("tune", lambda p: run_tune(probe_config, sweep_config, p, check=check,
                                                         profiles_dir=_target(profiles_dir, save), resume=resume))
    _finish(fmt, outcome, plot=plot, trace=trace, output=output)


@app.command()
def serve(
    p99: Annotated[str, typer.Option("--p99", help="The p99 latency budget of one request, end to end, e.g. 50ms.")],
    workload: Workload = P.workload,
    option: WorkloadOption = None,
    device: Device = P.device,
    precision: Annotated[str, typer.Option("--precision", help="fp32, bf16 or fp16 (autocast; inference needs no GradScaler).")] = "fp32",
    rates: Annotated[str | None, typer.Option("--rates", help="Comma list of Poisson request rates per second, run in ascending order until one breaks the budget (default: 20-105% of the largest configuration's capacity).")] = None,
    concurrency: Annotated[str | None, typer.Option("--concurrency", help="Comma list of closed-loop runs too: this many requests always in flight (reported, not ranked).")] = None,
    max_batch_sizes: Annotated[str | None, typer.Option("--max-batch-sizes", help="Comma list of the dynamic batcher's max batch sizes (default: the 3 largest powers of two whose batch takes at most half the budget).")] = None,
    queue_delays: Annotated[str | None, typer.Option("--queue-delays", help="Comma list of max queue delays, e.g. 0,2ms,10ms (default: 0 and 10% of the budget).")] = None,
    preferred: Annotated[str | None, typer.Option("--preferred", help="Comma list of preferred batch sizes: sent at once when the queue fills one (each configuration keeps those within its max).")] = None,
    memory_budget: Budget = None,
    margin: Margin = P.margin,
    max_batch: Annotated[int | None, typer.Option("--max-batch", help="Stop the inference probe growing at this batch size.")] = DEFAULT_SERVE_MAX_BATCH,
    confirm: Confirm = P.confirm,
    threads: Annotated[int | None, typer.Option("--threads", help="torch threads of the model process (default: all cores but one, which the load generator keeps).")] = None,
    window: Annotated[str, typer.Option("--window", help="Measurement window, e.g. 1s (open loop: at least 100 expected arrivals); 3 in a row must agree within 10%.")] = "1s",
    max_windows: Annotated[int, typer.Option("--max-windows", help="Windows per load before it is reported as unstable.")] = 8,
    queue_timeout: Annotated[str | None, typer.Option("--queue-timeout", help="A request waiting longer in the queue is rejected (default: 10 budgets).")] = None,
    strategy: Annotated[str, typer.Option("--strategy", help="grid: measure every configuration; quick: the queueing simulator, calibrated on the service-time curve, picks the 2 most promising.")] = "grid",
    seed: Seed = P.seed,
    trial_timeout: TrialTimeout = P.trial_timeout_s,
    load_timeout: LoadTimeout = P.load_timeout_s,
    profiles_dir: ProfilesDir = PROFILES,
    save: Save = True,
    resume: Resume = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write serve_curve.png (p99 against throughput per configuration) into this folder (needs matplotlib).")] = None,
    format: Format = "table",
    output: Output = None,
) -> None:
    """Tune dynamic batching for inference under a p99 latency budget, on a real server under real load."""
    from mbtune.serving.run import run_serve

    fmt = _check_output(_check_format(format), output)
    _check_resume(resume, save)
    _check_outputs(plot_dir=plot)
    config = _serve_config(p99=p99, workload=workload, option=option, device=device, precision=precision,
                           rates=rates, concurrency=concurrency, max_batch_sizes=max_batch_sizes,
                           queue_delays=queue_delays, preferred=preferred, memory_budget=memory_budget, margin=margin,
                           max_batch=max_batch, confirm=confirm, threads=threads, window=window,
                           max_windows=max_windows, queue_timeout=queue_timeout, strategy=strategy, seed=seed,
                           trial_timeout_s=trial_timeout, load_timeout_s=load_timeout)
    outcome = _with_progress("serve", lambda p: run_serve(config, p, profiles_dir=_target(profiles_dir, save),
                                                           resume=resume))
    _finish_serve(fmt, outcome, plot=plot, output=output)


@app.command()
def show(
    profile: Annotated[Path, typer.Argument(help="A profile file written by probe (profiles/<device>/<workload>.json).")],
    errors: Annotated[bool, typer.Option("--errors", help="Also print every failed trial's and point's whole error tail (traceback and stderr).")] = False,
    format: Format = "table",
    output: Output = None,
) -> None:
    """Print a saved profile again."""
    from mbtune.profiles import load_profile
    from mbtune.report import make_console
    from mbtune.report.profile import print_profile

    fmt = _check_output(_check_format(format), output)
    loaded = load_profile(profile)
    with _printing_to(output):
        print_profile(make_console(), loaded, fmt, path=str(profile), errors=errors)


@app.command()
def qualify(
    baseline: Annotated[Path | None, typer.Option("--baseline", help="Profile to re-run and compare against (profiles/<device>/<workload>.json).")] = None,
    spec: Annotated[Path | None, typer.Option("--spec", help="Qualification spec (TOML): workload, device, budget, sweep lists, thresholds.")] = None,
    tolerance: Annotated[str | None, typer.Option("--tolerance", help="Allowed shortfall against the baseline, e.g. 10% (default 10%, or the spec's).")] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", help="Runs of each sweep point, each in fresh processes; checks use the median and the spread over them (default 3, or the spec's).")] = None,
    allow_different_device: Annotated[bool, typer.Option("--allow-different-device", help="Compare against a baseline measured on another device model.")] = False,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write a JUnit XML file: one testcase per check.")] = None,
    profiles_dir: Annotated[Path, typer.Option("--profiles-dir", help="Where this run's measurements are saved (kept apart from baselines).")] = PROFILES / "qualify-runs",
    save: Save = True,
    format: Annotated[str, typer.Option("--format", "-f", help="table (people) or json (machines).")] = "table",
    launcher: Launcher = S.launcher,
    nnodes: NNodes = None,
    node_rank: NodeRank = None,
    rdzv_endpoint: RdzvEndpoint = None,
    join_timeout: JoinTimeout = S.join_timeout_s,
) -> None:
    """Re-run a baseline's probe and sweep here and give a verdict: exit 0 pass, 1 a check failed, 3 could not run,
    4 inconclusive (the measured spread is wider than the tolerance)."""
    from mbtune.config import parse_fraction
    from mbtune.profiles import command_line
    from mbtune.qualify import exit_code
    from mbtune.report import make_console
    from mbtune.report.qualify import print_verdict, write_junit
    from mbtune.runs import run_qualify
    from mbtune.specfile import read_spec

    fmt = _check_format(format, allowed=("table", "json"))
    _check_outputs(files=(junit,))
    launch = _launch(launcher, nnodes, node_rank, rdzv_endpoint, join_timeout)
    _lead_or_follow(launch)  # before the spec and baseline are read: only node 0 needs those files
    share = parse_fraction(tolerance, name="--tolerance") if tolerance is not None else None
    path = str(baseline) if baseline else None
    if spec is not None:
        plan, repeats = read_spec(spec, baseline=path, tolerance=share, repeats=repeats,
                                  allow_different_device=allow_different_device, command_line=command_line())
    else:
        plan = QualifySpec(baseline=path, tolerance=QualifySpec.tolerance if share is None else share,
                           allow_different_device=allow_different_device)
    verdict = _with_progress("qualify", lambda p: run_qualify(plan, p, profiles_dir=_target(profiles_dir, save),
                                                               repeats=repeats, launch=launch))
    if junit is not None:
        write_junit(verdict, junit)
    print_verdict(make_console(), verdict, fmt)
    raise typer.Exit(exit_code(verdict.status))


@app.command()
def compare(
    a: Annotated[Path, typer.Argument(help="First profile (A).")],
    b: Annotated[Path, typer.Argument(help="Second profile (B); ratios are B / A.")],
    allow_different_device: Annotated[bool, typer.Option("--allow-different-device", help="Compare profiles measured on different device models.")] = False,
    allow_different_workload: Annotated[bool, typer.Option("--allow-different-workload", help="Compare profiles of different workloads, options, precisions or optimizers.")] = False,
    format: Annotated[str, typer.Option("--format", "-f", help="table (people) or json (machines).")] = "table",
) -> None:
    """Print two saved profiles side by side with ratios."""
    from mbtune.report import make_console
    from mbtune.report.qualify import print_comparison
    from mbtune.runs import compare_files

    fmt = _check_format(format, allowed=("table", "json"))
    rows = compare_files(a, b, allow_different_device=allow_different_device,
                         allow_different_workload=allow_different_workload)
    print_comparison(make_console(), rows, str(a), str(b), fmt)


@app.command()
def plan(
    profile: Annotated[Path, typer.Argument(help="A profile with a sweep (profiles/<device>/<workload>.json) to calibrate the simulator on.")],
    stages: Annotated[int, typer.Option("--stages", "-p", help="Pipeline ranks to plan for (one GPU each).")] = DEFAULT_PLAN_RANKS,
    micro_batches: Annotated[str, typer.Option("--micro-batches", "-m", help="Comma list of micro-batch counts.")] = PLAN_MICRO_BATCHES,
    schedules: Schedules = None,
    data_parallel: Annotated[int, typer.Option("--data-parallel", help="Data-parallel replicas of the pipeline.")] = 1,
    micro_batch_size: MicroBatchSize = None,
    global_batch: PlanGlobalBatch = None,
    accum: Annotated[int, typer.Option("--accum", help="Gradient-accumulation steps per optimizer step.")] = 1,
    recompute: Annotated[str, typer.Option("--recompute", help="Comma list of none, full: plan each point with and without activation recompute (memory: each block's input held; compute: the forward again in each backward).")] = RECOMPUTE,
    blocks: Annotated[int | None, typer.Option("--blocks", help="Plan a model of this many of the workload's blocks (default: the profiled model's count).")] = None,
    virtual_stages: VirtualStages = 2,
    link_bandwidth: Annotated[str | None, typer.Option("--link-bandwidth", help="Stage-to-stage bandwidth, e.g. 50GB/s or 400Gbit/s (default: as measured here).")] = None,
    link_latency: Annotated[str | None, typer.Option("--link-latency", help="Stage-to-stage latency, e.g. 5us (default: as measured here).")] = None,
    ranks_per_node: Annotated[int | None, typer.Option("--ranks-per-node", help="Pipeline ranks per node: hand-overs between nodes cost what torchrun sweeps measured across nodes (or --link-*), those within a node what was measured within one.")] = None,
    validation: Annotated[str, typer.Option("--validation", help="Check the simulator against the measured points: leave-one-out, in-sample or none.")] = DEFAULT_PLAN_VALIDATION,
    scatter: Annotated[str, typer.Option("--scatter", help="measured: draw costs from the scatter measured on this machine; none: predict with average costs (a quieter target).")] = DEFAULT_PLAN_SCATTER,
    plot: Plot = None,
    trace: Annotated[Path | None, typer.Option("--trace", help="Write the recommended configuration's simulated timeline as Chrome trace-event JSON.")] = None,
    format: Format = "table",
    output: Output = None,
) -> None:
    """Predict configurations beyond this machine with a simulator calibrated on a saved sweep."""
    from mbtune.config import DEFAULT_SCHEDULES, parse_duration, parse_list, parse_rate
    from mbtune.planning.api import plan_from_profile
    from mbtune.planning.config import PlanConfig
    from mbtune.report import make_console
    from mbtune.report.plan import print_plan, write_plan_artifacts

    fmt = _check_output(_check_format(format), output)
    _check_outputs(plot_dir=plot, files=(trace,))
    config = PlanConfig(
        num_stages=stages, micro_batches=parse_list(micro_batches, name="--micro-batches"),
        schedules=parse_list(schedules, name="--schedules", convert=str) or DEFAULT_SCHEDULES,
        data_parallel=data_parallel, micro_batch_size=micro_batch_size, global_batch=global_batch,
        grad_accum_steps=accum, num_blocks=blocks, virtual_stages=virtual_stages,
        recompute=parse_list(recompute, name="--recompute", convert=str),
        link_bandwidth_bytes_per_s=parse_rate(link_bandwidth, name="--link-bandwidth") if link_bandwidth else None,
        link_latency_s=parse_duration(link_latency, name="--link-latency") if link_latency else None,
        ranks_per_node=ranks_per_node,
        validation_method=None if validation == "none" else validation, scatter=scatter,
        keep_timeline=bool(plot or trace),
    )
    report = plan_from_profile(profile, config)
    with _printing_to(output):
        print_plan(make_console(), report, fmt)
    if plot or trace:
        write_plan_artifacts(make_console(stderr=True), report, plot_dir=plot, trace_path=trace)


@app.command()
def check(
    workload: Workload = C.workload,
    option: WorkloadOption = None,
    device: Device = C.device,
    stages: Stages = C.num_stages,
    schedule: Annotated[str, typer.Option("--schedule", help="One schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, zero-bubble or zbv.")] = C.schedule,
    micro_batches: Annotated[int, typer.Option("--micro-batches", "-m", help="Micro-batches per pipeline step.")] = C.num_microbatches,
    accum: Annotated[int, typer.Option("--accum", help="Gradient-accumulation steps per optimizer step.")] = C.grad_accum_steps,
    data_parallel: Annotated[int, typer.Option("--data-parallel", help="Data-parallel replicas of the pipeline (gradients all-reduced).")] = C.data_parallel,
    recompute: Annotated[str, typer.Option("--recompute", help="none or full: activation recompute in the pipeline (the plain model never recomputes).")] = C.recompute,
    micro_batch_size: Annotated[int | None, typer.Option("--micro-batch-size", help="Samples per micro-batch (default 2, or from --global-batch).")] = C.micro_batch_size,
    global_batch: Annotated[int | None, typer.Option("--global-batch", help="Samples per optimizer step; the micro-batch size follows.")] = C.global_batch,
    virtual_stages: VirtualStages = C.virtual_stages,
    precision: Annotated[str, typer.Option("--precision", help="fp32 or bf16 (autocast), in the pipeline and the plain model.")] = C.precision,
    optimizer: Optimizer = C.optimizer,
    lr: Lr = C.lr,
    seed: Seed = C.seed,
    from_profile: Annotated[Path | None, typer.Option("--from", help="Check a row of a saved profile's sweep instead (with --rank).")] = None,
    rank: Annotated[int, typer.Option("--rank", help="With --from: the row, by rank (1 is the best).")] = 1,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds the pipeline, and then the plain model, may take.")] = C.timeout_s,
    load_timeout: LoadTimeout = C.load_timeout_s,
    format: Annotated[str, typer.Option("--format", "-f", help="table (people) or json (machines).")] = "table",
) -> None:
    """Run one optimizer step through the real pipeline and through the plain model on the same global batch
    and seed, and compare the gradients per block: exit 0 PASS, 1 FAIL (with why), 3 could not run."""
    from mbtune.check import check_update
    from mbtune.config import parse_options
    from mbtune.report import make_console
    from mbtune.report.check import print_check
    from mbtune.runs import check_config_from_profile

    fmt = _check_format(format, allowed=("table", "json"))
    if from_profile is not None:
        config = check_config_from_profile(from_profile, rank, device=device, timeout_s=timeout,
                                           load_timeout_s=load_timeout, seed=seed, lr=lr)
    else:
        config = CheckConfig(workload=workload, workload_options=parse_options(option or []), device=device,
                             schedule=schedule, num_stages=stages, num_microbatches=micro_batches,
                             grad_accum_steps=accum, data_parallel=data_parallel, recompute=recompute,
                             micro_batch_size=micro_batch_size,
                             global_batch=global_batch, virtual_stages=virtual_stages, precision=precision, optimizer=optimizer, lr=lr, seed=seed,
                             timeout_s=timeout, load_timeout_s=load_timeout)
    result = check_update(config)
    print_check(make_console(), result, fmt)
    raise typer.Exit(0 if result.status == "PASS" else EXIT_CHECK_FAILED)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app and map known errors to one line and an exit code."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupted)
    try:
        _run(argv)
    except SystemExit as exc:  # every way out: under torchrun across nodes, the others exit with this code
        if "mbtune.pipeline.torchrun" in sys.modules:
            from mbtune.pipeline.torchrun import close_sessions

            close_sessions(exc.code if isinstance(exc.code, int) else EXIT_COULD_NOT_RUN)
        raise


def _run(argv: list[str] | None) -> None:
    from mbtune.report import print_error

    try:
        app(args=argv, prog_name="mbtune")
    except (MbtuneError, Interrupted) as exc:
        if os.environ.get("MBTUNE_DEBUG"):
            if exc.detail:
                sys.stderr.write(f"{exc.detail}\n")
            raise
        shown = _as_flag(exc) if isinstance(exc, MbtuneError) else exc
        print_error(shown.one_line())
        sys.exit(exc.exit_code)
    except Exception as exc:  # a bug in mbtune: still one line unless debugging
        if os.environ.get("MBTUNE_DEBUG"):
            raise
        print_error(f"internal error: {type(exc).__name__}: {str(exc)[:100]}. The traceback is in "
                    f"{_save_traceback()}; please report it.")
        sys.exit(EXIT_COULD_NOT_RUN)
