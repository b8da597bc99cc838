"""The options the commands share, as Annotated typer types with their help, and their defaults (each the
config's own)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from mbtune.checking.config import CheckConfig
from mbtune.pipeline.theory import SCHEDULE_NAMES
from mbtune.planning.defaults import DEFAULT_PLAN_MICRO_BATCHES
from mbtune.probing.config import ProbeConfig
from mbtune.sweeping.config import SweepConfig

T = TypeVar("T")


P, S, C = ProbeConfig, SweepConfig, CheckConfig  # every default is the config's own


PROFILES = Path("profiles")  # where saved profiles go, relative to the current folder


SWEEP_ACCUM, SWEEP_DATA_PARALLEL, RECOMPUTE, PLAN_MICRO_BATCHES = (
    ",".join(map(str, v)) for v in (S.grad_accum_steps, S.data_parallel_size, S.recompute, DEFAULT_PLAN_MICRO_BATCHES))


Workload = Annotated[str, typer.Option("--workload", "-w", help="Built-in workload (gpt, mlp) or package.module:factory.")]


WorkloadOption = Annotated[list[str] | None, typer.Option("--option", "-O", help="Workload option KEY=VALUE, repeatable (e.g. -O layers=8).")]


Device = Annotated[str, typer.Option("--device", "-d", envvar="MBTUNE_DEVICE", help="auto, cpu, cuda or cuda:N.")]


Budget = Annotated[str | None, typer.Option("--memory-budget", help="Memory a trial may use, e.g. 3GiB. CPU: the live tensor bytes of every thread, counted as a GPU's allocator counts them; CUDA: the per-process memory fraction (default: the whole device).")]


Format = Annotated[str, typer.Option("--format", "-f", help="table (people), json or csv (machines).")]


Precision = Annotated[str, typer.Option("--precision", help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler: CUDA only, probe only; a sweep's stages run fp32 or bf16).")]


Optimizer = Annotated[str, typer.Option("--optimizer", help="adamw or sgd (optimizer state counts toward memory).")]


ProfilesDir = Annotated[Path, typer.Option("--profiles-dir", envvar="MBTUNE_PROFILES_DIR", help="Folder that holds saved profiles.")]


Save = Annotated[bool, typer.Option(help="Save results to profiles/<device>/<workload>.json, journaling each finished trial as it ends.")]


Plot = Annotated[Path | None, typer.Option("--plot", help="Write PNG pictures (timeline, throughput, bubble, memory) into this folder (needs matplotlib).")]


Trace = Annotated[Path | None, typer.Option("--trace", help="Write the best point's timeline as Chrome trace-event JSON (opens in Perfetto).")]


Output = Annotated[Path | None, typer.Option("--output", "-o", help="Write the json or csv output to this file instead of stdout (a .json or .csv name picks the format).")]


Resume = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run of the same command from its journal, without re-running finished trials.")]


LoadTimeout = Annotated[float, typer.Option("--load-timeout", help="Seconds to import the workload's module and call its factory (in a child process) before giving up (default: 120, or the trial's or point's timeout where shorter).")]


TrialTimeout = Annotated[float, typer.Option("--trial-timeout", help="Seconds before a probe trial is killed.")]


Confirm = Annotated[int | None, typer.Option("--confirm", help="Fresh runs the ceiling and the safe batch must each pass (default: 1 on the CPU, where a size fits or fails the same way every run; 2 on CUDA).")]


ProbeSteps = Annotated[int, typer.Option("--steps", help="Full training steps per probe trial (>= 2).")]


Lr = Annotated[float | None, typer.Option("--lr", help="Learning rate to train with (default: 1e-4 for adamw, 1e-3 for sgd); with --reference-batch, the recipe's, scaled per row.")]


ReferenceBatch = Annotated[int | None, typer.Option("--reference-batch", help="The recipe's global batch: each row's lr is --lr scaled from it (linear for sgd, square root for adamw); default: the smallest global batch that ran.")]


Seed = Annotated[int, typer.Option("--seed", help="Seed of the model's weights and of the synthetic batches.")]


Threads = Annotated[int | None, typer.Option("--threads", help="torch threads per process (default: all cores for a probe trial, cores / stages for a pipeline stage on the CPU).")]


Margin = Annotated[float, typer.Option(help="Safety margin below the ceiling, 0-0.5 (usual 0.10-0.20).")]


Granularity = Annotated[int, typer.Option(help="Probe batch sizes are multiples of this.")]


MaxBatch = Annotated[int | None, typer.Option("--max-batch", help="Stop the probe growing at this batch size.")]


Predict = Annotated[bool, typer.Option("--predict/--no-predict", help="Start the search from the ceiling the trial's own steps on fake tensors predict (no memory, no trial); --no-predict grows from one granule.")]
Resolution = Annotated[int | None, typer.Option(help="Stop the probe once [ceiling, first failing) is this narrow (default: 1% of the ceiling, at least one granule; 1: the exact answer).")]


Recompute = Annotated[str, typer.Option("--recompute", help="Comma list of none, full: activation recompute of every block (torch.utils.checkpoint). A probe searches once per mode; a sweep runs each point per mode.")]


Balance = Annotated[str, typer.Option("--balance", help="Split blocks over stages by params (compute-bearing parameters) or time (each block's forward + backward, measured once by a timing pass before the sweep).")]


Strategy = Annotated[str, typer.Option("--strategy", help="grid: run every runnable point; quick: the simulator, calibrated on a few points, picks what to run.")]


def _settings_file(ctx: typer.Context, value: Path | None) -> Path | None:
    """--config: the file's settings become this command's defaults, so flags given on the command line win."""
    if value is not None:
        from mbtune.cli.outputs import check_readable
        from mbtune.qualifying.specfile import read_settings

        check_readable(value, flag="--config", hint="Pass the path of a TOML settings file.")

        command = ctx.command.name or ""
        known = {param.name for param in ctx.command.params}
        ctx.default_map = {k: v for k, v in read_settings(value, command).items() if k in known}
    return value


ConfigFile = Annotated[Path | None, typer.Option("--config", is_eager=True, callback=_settings_file, help="TOML settings in qualify's spec schema (workload, device, memory_budget, [options], [probe], [sweep]); flags given on the command line win over it.")]


Stages = Annotated[int, typer.Option("--stages", "-p", help="Pipeline stages (one process each; one GPU each on CUDA).")]


Schedules = Annotated[str | None, typer.Option("--schedules", help=f"Comma list of {', '.join(SCHEDULE_NAMES)} (default: gpipe,1f1b,interleaved-1f1b,zero-bubble).")]


MicroBatches = Annotated[str | None, typer.Option("--micro-batches", "-m", help="Comma list of micro-batch counts (default: p,2p,4p).")]


Accum = Annotated[str, typer.Option("--accum", help="Comma list of gradient-accumulation steps.")]


MicroBatchSize = Annotated[int | None, typer.Option("--micro-batch-size", help="Samples per micro-batch (default: probed safe batch / largest micro-batch count, else 4).")]


MicroBatchSizes = Annotated[str | None, typer.Option("--micro-batch-size", help="Comma list of fixed micro-batch sizes; the global batch then varies from row to row (default: the global batch is held fixed, see --global-batch).")]


DataParallel = Annotated[str, typer.Option("--data-parallel", help="Comma list of data-parallel replica counts: each runs stages x N processes, gradients all-reduced across replicas every optimizer step.")]


GlobalBatch = Annotated[str | None, typer.Option("--global-batch", help="Comma list of global batches, each held fixed and split every way the grid allows (the micro-batch size follows per point); default with a probe: the largest power of two the fewest micro-batches, accumulation steps and replicas hold at the safe batch.")]


PlanGlobalBatch = Annotated[int | None, typer.Option("--global-batch", help="Fix the global batch instead; the micro-batch size follows per point.")]


Objective = Annotated[str, typer.Option("--objective", help="Rank by throughput, memory or bubble.")]


SweepSteps = Annotated[int, typer.Option("--steps", help="Measured optimizer steps per point (after warm-up); measured until known, the fewest per repeat.")]


Warmup = Annotated[int, typer.Option("--warmup", help="Warm-up optimizer steps per point (not timed).")]


StagesPerRank = Annotated[int, typer.Option("--stages-per-rank", help="Stages each rank holds in the looped schedules (interleaved-1f1b, looped-bfs, zero-bubble); gpipe and 1f1b hold 1, zbv 2.")]


# A setting's former flag, kept working (with a note) for a release.
FormerVirtualStages = Annotated[int | None, typer.Option("--virtual-stages", hidden=True, help="The former name of --stages-per-rank.")]


PointTimeout = Annotated[float, typer.Option("--point-timeout", help="Seconds before a point's processes are killed.")]


Launcher = Annotated[str, typer.Option("--launcher", help="Who starts each point's ranks: local (mbtune's own, one host, fastest) or torchrun (torch.distributed.run's elastic agent with a c10d rendezvous; needed across nodes).")]


NNodes = Annotated[int | None, typer.Option("--nnodes", help="Nodes the run spans, with --launcher torchrun; the same command runs on every node (default: the scheduler's PET_NNODES or SLURM_JOB_NUM_NODES, else 1).")]


NodeRank = Annotated[int | None, typer.Option("--node-rank", help="This node's number, 0 to nnodes-1: node 0 leads, prints and saves; the others follow it and write nothing (default: PET_NODE_RANK, GROUP_RANK or SLURM_NODEID, else 0).")]


RdzvEndpoint = Annotated[str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT where the nodes meet: node 0's address and a free port (default: PET_RDZV_ENDPOINT, or MASTER_ADDR:MASTER_PORT).")]


JoinTimeout = Annotated[float, typer.Option("--join-timeout", help="Seconds every node gets to join, at the start and at each point's rendezvous.")]


Repeats = Annotated[int | None, typer.Option("--repeats", help="Runs of each point, every point exactly this many (default: raced, each until its throughput is known or it is beaten, see --target-ci and --time-budget).")]
TargetCi = Annotated[float, typer.Option("--target-ci", help="Measure each point until the 95% interval of its samples/s is at most this wide, a share of it (0.05: 5%).")]
MaxTimePerPoint = Annotated[float, typer.Option("--max-time-per-point", help="Seconds a point is measured for at most, repeats included, when measured until known and not raced (the race's --time-budget bounds a raced sweep).")]
PinCpus = Annotated[bool, typer.Option("--pin-cpus/--no-pin-cpus", help="On the CPU, pin each rank process to its own cores.")]
TimeBudget = Annotated[str | None, typer.Option("--time-budget", help="Time the sweep may measure for, e.g. 3m or 90s (default: 90s): every point is measured once, then repeats go to the points still tied with the best until it is spent. A tune's probe and check come on top.")]
Race = Annotated[bool, typer.Option("--race/--no-race", help="Race the grid (the default, measured until known and ranked by throughput): after one repeat of every point, repeats only for the points a 95% test cannot yet separate from the best; --no-race measures every point until known.")]
Equivalence = Annotated[str, typer.Option("--equivalence", help="The smallest difference worth your attention, e.g. 3%: what is shown within it of the best is equivalent to it, and the answer is decided (sweep: samples/s, by a 95% equivalence test; serve: the highest rate within the p99 budget).")]
MeasureAll = Annotated[bool, typer.Option("--measure-all", help="Measure every point of the grid; by default a raced sweep measures a few points first and races only those the simulator's prediction cannot rule out (the rest are shown as predicted).")]
FreshProcesses = Annotated[bool, typer.Option("--fresh-processes/--warm-processes", help="Start every repeat's rank processes afresh, instead of keeping them (and their process group) for the next repeat and point; a set is always started afresh after a failure.")]
AsBaseline = Annotated[bool, typer.Option("--as-baseline", help="Measure for a qualify baseline: every point until its 95% interval is a quarter of qualify's default 10% tolerance wide (or 30 s per point), none dropped by the race, no time budget.")]


FromProfile = Annotated[Path | None, typer.Option("--from-profile", help="A saved profile whose probe bounds the micro-batch size (safe batch) and gives the headroom (default: this device's saved profile, if any).")]


ProbeStepsInTune = Annotated[int, typer.Option("--probe-steps", help="Full training steps per probe trial (>= 2).")]


Check = Annotated[bool, typer.Option(help="Check the best row's update against the plain model's (mbtune check) and show the verdict.")]


TrainingCommand = Annotated[list[str] | None, typer.Argument(help="Your own training command, after --, as you run it, run as it is instead of a workload: for a probe with {batch} where the per-process batch size goes; for a sweep with what it varies ({micro_batch_size}, {micro_batches}, {accum}, {schedule}, {batch} = micro-batch size x micro-batches, {stages}, {stages_per_rank}, {data_parallel}).", show_default=False)]


StepsFromOutput = Annotated[str | None, typer.Option("--steps-from-output", metavar="REGEX", help="With a command that steps no torch optimizer: a line it prints once a step (a regular expression, searched in each line of its output); its steps are counted and timed from those lines.")]


GridOption = Annotated[list[str] | None, typer.Option("--grid", metavar="NAME=v1,v2", help="With a command: one more of its own settings to sweep, filled into its {NAME} (repeat for more), e.g. --grid lr=1e-4,3e-4.")]


ConfirmDuration = Annotated[str | None, typer.Option("--confirm-duration", metavar="DURATION", help="With a command: after the search, run it at the safe batch for this long (e.g. 30m), through its evaluation passes and checkpoints, as mbtune confirm --duration does; its peak over time is reported.")]


CommandName = Annotated[str | None, typer.Option("--name", help="With a command: its name in the profile (default: its script's name).")]


def option(name: str, kind: Any, default: Any = None) -> inspect.Parameter:
    """One command-line option, declared once: its name (the setting's), its Annotated type and default."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=kind, default=default)


# The options the training commands share, each declared once, in the order --help lists them. A command is
# the groups it takes (see command()).
WORKLOAD_OPTIONS = (option("config_file", ConfigFile), option("workload", Workload, P.workload),
                    option("option", WorkloadOption), option("device", Device, P.device))
BUDGET_OPTIONS = (option("memory_budget", Budget), option("margin", Margin, P.margin),
                  option("granularity", Granularity, P.granularity), option("max_batch", MaxBatch, P.max_batch),
                  option("confirm", Confirm, P.confirm), option("resolution", Resolution, P.resolution),
                  option("predict", Predict, P.predict))
PROBE_STEPS = (option("steps", ProbeSteps, P.steps),)
TRIAL_TIMEOUT = (option("trial_timeout", TrialTimeout, P.trial_timeout_s),)
GRID_OPTIONS = (option("stages", Stages, S.num_ranks), option("schedules", Schedules),
                option("micro_batches", MicroBatches), option("accum", Accum, SWEEP_ACCUM),
                option("micro_batch_size", MicroBatchSizes), option("global_batch", GlobalBatch),
                option("data_parallel", DataParallel, SWEEP_DATA_PARALLEL), option("balance", Balance, "params"))
MEASURE_OPTIONS = (option("objective", Objective, S.objective), option("strategy", Strategy, S.strategy),
                   option("steps", SweepSteps, S.measured_steps), option("warmup", Warmup, S.warmup_steps),
                   option("repeats", Repeats), option("target_ci", TargetCi, S.target_ci),
                   option("max_time_per_point", MaxTimePerPoint, S.max_time_per_point_s),
                   option("time_budget", TimeBudget), option("race", Race, S.race),
                   option("equivalence", Equivalence, f"{S.equivalence:.0%}"),
                   option("measure_all", MeasureAll, S.measure_all),
                   option("fresh_processes", FreshProcesses, S.fresh_processes),
                   option("as_baseline", AsBaseline, S.as_baseline),
                   option("pin_cpus", PinCpus, S.pin_cpus), option("stages_per_rank", StagesPerRank, S.stages_per_rank),
                   option("virtual_stages", FormerVirtualStages),
                   option("reference_batch", ReferenceBatch, S.reference_batch),
                   option("point_timeout", PointTimeout, S.point_timeout_s))
TRAINING_OPTIONS = (option("precision", Precision, P.precision), option("optimizer", Optimizer, P.optimizer),
                    option("threads", Threads, P.threads), option("lr", Lr, P.lr), option("seed", Seed, P.seed),
                    option("recompute", Recompute, RECOMPUTE), option("load_timeout", LoadTimeout, P.load_timeout_s))
LAUNCH_OPTIONS = (option("launcher", Launcher, S.launcher), option("nnodes", NNodes), option("node_rank", NodeRank),
                  option("rdzv_endpoint", RdzvEndpoint), option("join_timeout", JoinTimeout, S.join_timeout_s))
SAVE_OPTIONS = (option("profiles_dir", ProfilesDir, PROFILES), option("save", Save, True),
                option("resume", Resume, False))
PICTURE_OPTIONS = (option("plot", Plot), option("trace", Trace))
OUTPUT_OPTIONS = (option("format", Format, "table"), option("output", Output))


def command(run: Callable[[dict[str, Any]], None], *groups: tuple[inspect.Parameter, ...]) -> Callable[..., None]:
    """A typer command of `run`, taking the options of `groups`: typer reads the signature, and `run` gets
    what was given as one mapping, by the options' names (the settings' names)."""

    def given(**options: Any) -> None:
        run(options)

    given.__signature__ = inspect.Signature([p for group in groups for p in group])  # type: ignore[attr-defined]
    given.__name__, given.__doc__, given.__module__ = run.__name__.lstrip("_"), run.__doc__, run.__module__
    return given
