"""`mbtune plan`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mbtune.cli.options import (
    PLAN_MICRO_BATCHES,
    RECOMPUTE,
    Format,
    MicroBatchSize,
    Optimizer,
    Output,
    PlanGlobalBatch,
    Plot,
    Schedules,
    VirtualStages,
    WorkloadOption,
)
from mbtune.cli.support import check_format, check_output, check_outputs, printing_to
from mbtune.planning.defaults import DEFAULT_PLAN_RANKS, DEFAULT_PLAN_SCATTER, DEFAULT_PLAN_VALIDATION


def plan(
    profile: Annotated[Path | None, typer.Argument(help="A profile with a sweep (profiles/<device>/<workload>.json) to calibrate the simulator on; without one, --workload and --device-memory plan memory alone.", show_default=False)] = None,
    workload: Annotated[str | None, typer.Option("--workload", "-w", help="Without a profile: the workload whose every stage's peak memory to predict (on fake tensors: no memory, no device).")] = None,
    option: WorkloadOption = None,
    device_memory: Annotated[str | None, typer.Option("--device-memory", help="Each device's memory, e.g. 141GB or 80GiB: with a profile, what every rank's memory is checked against (default: the probed ceiling); without one, the plan gives the largest micro-batch size every stage holds in it.")] = None,
    target_device: Annotated[str | None, typer.Option("--target-device", help="Plan for another device than the profiled one (e.g. H200): compute times scaled by the two devices' dense peak FLOP/s, the profiled efficiency carried over, labelled as an estimate; memory is unchanged (--device-memory).")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="Plan a cluster of this many GPUs: every pipeline depth x data-parallel replicas, micro-batch size, count and accumulation that make --global-batch, every schedule (--schedules) and recompute none and full (--recompute), ranked by predicted throughput.")] = None,
    precision: Annotated[str, typer.Option("--precision", help="Without a profile: fp32 or bf16 (autocast).")] = "fp32",
    optimizer: Optimizer = "adamw",
    stages: Annotated[int, typer.Option("--stages", "-p", help="Pipeline ranks to plan for (one GPU each).")] = DEFAULT_PLAN_RANKS,
    micro_batches: Annotated[str, typer.Option("--micro-batches", "-m", help="Comma list of micro-batch counts.")] = PLAN_MICRO_BATCHES,
    schedules: Schedules = None,
    data_parallel: Annotated[int, typer.Option("--data-parallel", help="Data-parallel replicas of the pipeline.")] = 1,
    micro_batch_size: MicroBatchSize = None,
    global_batch: PlanGlobalBatch = None,
    accum: Annotated[int, typer.Option("--accum", help="Gradient-accumulation steps per optimizer step.")] = 1,
    recompute: Annotated[str | None, typer.Option("--recompute", help="Comma list of none, full: plan each point with and without activation recompute (memory: each block's input held; compute: the forward again in each backward). Default: none; both with --gpus.")] = None,
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
    """Predict configurations beyond this machine with a simulator calibrated on a saved sweep; without a
    profile, predict every stage's peak memory and the largest micro-batch size each stage holds."""
    from mbtune.pipeline.theory import SCHEDULE_NAMES
    from mbtune.planning.api import plan_from_profile
    from mbtune.planning.config import PlanConfig
    from mbtune.report import make_console
    from mbtune.report.plan import print_plan, write_plan_artifacts
    from mbtune.settings import MAX_BUDGET_BYTES
    from mbtune.sweeping.config import DEFAULT_SCHEDULES
    from mbtune.units import parse_bytes, parse_duration, parse_list, parse_rate

    fmt = check_output(check_format(format), output)
    check_outputs(plot_dir=plot, files={"--trace": trace})
    if profile is None:
        from mbtune.errors import ConfigError

        for flag, value in (("--gpus", gpus), ("--target-device", target_device)):
            if value is not None:
                raise ConfigError(f"{flag} plans from a saved profile's measured costs; none was given",
                                  hint="mbtune plan profiles/<device>/<workload>.json " + flag + " ...")
        _memory_plan(workload, option, device_memory, stages, micro_batches, schedules, data_parallel, accum,
                     recompute or RECOMPUTE, virtual_stages, precision, optimizer, fmt, output)
        return
    cluster = gpus is not None
    config = PlanConfig(
        num_ranks=stages, micro_batches=parse_list(micro_batches, name="--micro-batches"),
        schedules=parse_list(schedules, name="--schedules", convert=str) or (SCHEDULE_NAMES if cluster else DEFAULT_SCHEDULES),
        data_parallel_size=data_parallel, micro_batch_size=micro_batch_size, global_batch=global_batch,
        grad_accum_steps=accum, num_blocks=blocks, virtual_stages=virtual_stages,
        recompute=parse_list(recompute or ("none,full" if cluster else RECOMPUTE), name="--recompute", convert=str),
        num_gpus=gpus, target_device=target_device, device_memory_bytes=parse_bytes(device_memory, name="--device-memory", at_most=MAX_BUDGET_BYTES)
        if device_memory else None,
        link_bandwidth_bytes_per_s=parse_rate(link_bandwidth, name="--link-bandwidth") if link_bandwidth else None,
        link_latency_s=parse_duration(link_latency, name="--link-latency") if link_latency else None,
        ranks_per_node=ranks_per_node,
        validation_method=None if validation == "none" else validation, scatter=scatter,
        keep_timeline=bool(plot or trace),
    )
    report = plan_from_profile(profile, config)
    with printing_to(output):
        print_plan(make_console(), report, fmt)
    if plot or trace:
        write_plan_artifacts(make_console(stderr=True), report, plot_dir=plot, trace_path=trace)


def _memory_plan(workload: str | None, option: list[str] | None, device_memory: str | None, stages: int,
                 micro_batches: str, schedules: str | None, data_parallel: int, accum: int, recompute: str,
                 virtual_stages: int, precision: str, optimizer: str, fmt: str, output: Path | None) -> None:
    from mbtune.errors import ConfigError
    from mbtune.planning.memory_plan import MemoryPlanConfig, plan_memory
    from mbtune.report import make_console
    from mbtune.report.plan import print_memory_plan
    from mbtune.settings import MAX_BUDGET_BYTES, OPTIMIZERS
    from mbtune.sweeping.config import DEFAULT_SCHEDULES
    from mbtune.units import parse_bytes, parse_list, parse_options

    if workload is None or device_memory is None:
        raise ConfigError("plan needs a saved profile, or --workload and --device-memory to plan memory alone",
                          hint="mbtune plan profiles/<device>/<workload>.json, or mbtune plan --workload hf:llama "
                               "--device-memory 141GB --stages 8")
    for name, value, allowed in (("precision", precision, ("fp32", "bf16")), ("optimizer", optimizer, OPTIMIZERS)):
        if value not in allowed:
            raise ConfigError(f"--{name} {value!r} is not one of {', '.join(allowed)}", field=name)
    if stages < 1 or data_parallel < 1 or accum < 1:
        raise ConfigError("--stages, --data-parallel and --accum must be at least 1")
    config = MemoryPlanConfig(
        workload=workload, workload_options=parse_options(option or []),
        device_memory_bytes=parse_bytes(device_memory, name="--device-memory", at_most=MAX_BUDGET_BYTES),
        num_ranks=stages, schedules=parse_list(schedules, name="--schedules", convert=str) or DEFAULT_SCHEDULES,
        micro_batches=parse_list(micro_batches, name="--micro-batches"), data_parallel_size=data_parallel,
        grad_accum_steps=accum, recompute=parse_list(recompute, name="--recompute", convert=str),
        virtual_stages=virtual_stages, precision=precision, optimizer=optimizer)
    plan = plan_memory(config)
    with printing_to(output):
        print_memory_plan(make_console(), plan, fmt)
