"""`mbtune plan`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from mbtune.cli.options import (
    PLAN_MICRO_BATCHES,
    RECOMPUTE,
    Format,
    FormerVirtualStages,
    MicroBatchSize,
    Optimizer,
    Output,
    PlanGlobalBatch,
    Plot,
    Schedules,
    StagesPerRank,
    WorkloadOption,
)
from mbtune.cli.support import check_format, check_output, check_outputs, printing_to, settings_in
from mbtune.pipeline.theory import DEFAULT_STAGES_PER_RANK
from mbtune.planning.config import PlanConfig as PC  # every default is the config's own
from mbtune.planning.defaults import DEFAULT_PLAN_RANKS, DEFAULT_PLAN_SCATTER, DEFAULT_PLAN_VALIDATION
from mbtune.planning.memory_plan import MemoryPlanConfig as M


def plan(
    ctx: typer.Context,
    profile: Annotated[Path | None, typer.Argument(help="A profile with a sweep (profiles/<device>/<workload>.json) to calibrate the simulator on; without one, --workload and --device-memory plan memory alone.", show_default=False)] = None,
    workload: Annotated[str | None, typer.Option("--workload", "-w", help="Without a profile: the workload whose every stage's peak memory to predict (on fake tensors: no memory, no device).")] = None,
    option: WorkloadOption = None,
    device_memory: Annotated[str | None, typer.Option("--device-memory", help="Each device's memory, e.g. 141GB or 80GiB: with a profile, what every rank's memory is checked against (default: the probed ceiling); without one, the plan gives the largest micro-batch size every stage holds in it.")] = None,
    target_device: Annotated[str | None, typer.Option("--target-device", help="Plan for another device than the profiled one (e.g. H200): compute times scaled by the two devices' dense peak FLOP/s, the profiled efficiency carried over, labelled as an estimate; memory is unchanged (--device-memory).")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="Plan a cluster of this many GPUs: every pipeline depth x data-parallel replicas, micro-batch size, count and accumulation that make --global-batch, every schedule (--schedules) and recompute none and full (--recompute), ranked by predicted throughput.")] = None,
    precision: Annotated[str, typer.Option("--precision", help="Without a profile: fp32 or bf16 (autocast).")] = M.precision,
    optimizer: Optimizer = M.optimizer,
    stages: Annotated[int, typer.Option("--stages", "-p", help="Pipeline ranks to plan for (one GPU each).")] = DEFAULT_PLAN_RANKS,
    micro_batches: Annotated[str, typer.Option("--micro-batches", "-m", help="Comma list of micro-batch counts.")] = PLAN_MICRO_BATCHES,
    schedules: Schedules = None,
    data_parallel: Annotated[int, typer.Option("--data-parallel", help="Data-parallel replicas of the pipeline.")] = PC.data_parallel_size,
    micro_batch_size: MicroBatchSize = None,
    global_batch: PlanGlobalBatch = None,
    accum: Annotated[int, typer.Option("--accum", help="Gradient-accumulation steps per optimizer step.")] = PC.grad_accum_steps,
    recompute: Annotated[str | None, typer.Option("--recompute", help="Comma list of none, full: plan each point with and without activation recompute (memory: each block's input held; compute: the forward again in each backward). Default: none; both with --gpus.")] = None,
    blocks: Annotated[int | None, typer.Option("--blocks", help="Plan a model of this many of the workload's blocks (default: the profiled model's count).")] = None,
    stages_per_rank: StagesPerRank = DEFAULT_STAGES_PER_RANK,
    virtual_stages: FormerVirtualStages = None,
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
    """Predict configurations beyond this machine with a simulator calibrated on a saved sweep; without a
    profile, predict every stage's peak memory and the largest micro-batch size each stage holds."""
    from mbtune.pipeline.theory import SCHEDULE_NAMES
    from mbtune.planning.api import plan_from_profile
    from mbtune.planning.config import PlanConfig
    from mbtune.report import make_console
    from mbtune.report.plan import print_plan, write_plan_artifacts
    from mbtune.sweeping.config import DEFAULT_SCHEDULES

    fmt = check_output(check_format(format), output)
    check_outputs(plot_dir=plot, files={"--trace": trace})
    if profile is None:
        from mbtune.errors import ConfigError

        for flag, value in (("--gpus", gpus), ("--target-device", target_device)):
            if value is not None:
                raise ConfigError(f"{flag} plans from a saved profile's measured costs; none was given",
                                  hint="mbtune plan profiles/<device>/<workload>.json " + flag + " ...")
        _memory_plan({**ctx.params, "recompute": recompute or RECOMPUTE,
                      "schedules": schedules or ",".join(DEFAULT_SCHEDULES)}, fmt, output)
        return
    cluster = gpus is not None
    settings = {**ctx.params, "keep_timeline": bool(plot or trace),
                "schedules": schedules or ",".join(SCHEDULE_NAMES if cluster else DEFAULT_SCHEDULES),
                "recompute": recompute or ("none,full" if cluster else RECOMPUTE)}
    config = settings_in(settings, PlanConfig, leave=_MEMORY_PLAN_ONLY)
    report = plan_from_profile(profile, config)
    with printing_to(output):
        print_plan(make_console(), report, fmt)
    if plot or trace:
        write_plan_artifacts(make_console(stderr=True), report, plot_dir=plot, trace_path=trace)


# The options plan takes for a memory plan alone (without a profile), and those it takes with a profile alone.
_MEMORY_PLAN_ONLY = ("profile", "workload", "option", "precision", "optimizer")
_PROFILE_ONLY = ("profile", "target_device", "gpus", "micro_batch_size", "global_batch", "blocks", "link_bandwidth",
                 "link_latency", "ranks_per_node", "validation", "scatter", "plot", "trace")


def _memory_plan(given: dict[str, Any], fmt: str, output: Path | None) -> None:
    from mbtune.errors import ConfigError
    from mbtune.planning.memory_plan import MemoryPlanConfig, plan_memory
    from mbtune.report import make_console
    from mbtune.report.plan import print_memory_plan

    if given["workload"] is None or given["device_memory"] is None:
        raise ConfigError("plan needs a saved profile, or --workload and --device-memory to plan memory alone",
                          hint="mbtune plan profiles/<device>/<workload>.json, or mbtune plan --workload hf:llama "
                               "--device-memory 141GB --stages 8")
    config = settings_in(given, MemoryPlanConfig, leave=_PROFILE_ONLY)
    plan = plan_memory(config)
    with printing_to(output):
        print_memory_plan(make_console(), plan, fmt)
