"""`mbtune serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mbtune.cli.options import (
    PROFILES,
    Budget,
    Confirm,
    Device,
    Equivalence,
    Format,
    LoadTimeout,
    Margin,
    Output,
    P,
    ProfilesDir,
    Resume,
    Save,
    Seed,
    TrialTimeout,
    Workload,
    WorkloadOption,
)
from mbtune.cli.support import (
    check_format,
    check_output,
    check_outputs,
    check_resume,
    finish_serve,
    settings_in,
    target_folder,
    with_progress,
)
from mbtune.serving.config import ServeConfig as SV  # every default is the config's own


def serve(
    ctx: typer.Context,
    p99: Annotated[str, typer.Option("--p99", help="The p99 latency budget of one request, end to end, e.g. 50ms.")],
    workload: Workload = P.workload,
    option: WorkloadOption = None,
    device: Device = P.device,
    precision: Annotated[str, typer.Option("--precision", help="fp32, bf16 or fp16 (autocast; inference needs no GradScaler).")] = SV.precision,
    rates: Annotated[str | None, typer.Option("--rates", help="Comma list of Poisson request rates per second, run in ascending order until one breaks the budget (default: 20-105% of the largest configuration's capacity).")] = None,
    concurrency: Annotated[str | None, typer.Option("--concurrency", help="Comma list of closed-loop runs too: this many requests always in flight (reported, not ranked).")] = None,
    max_batch_sizes: Annotated[str | None, typer.Option("--max-batch-sizes", help="Comma list of the dynamic batcher's max batch sizes (default: the 3 largest powers of two whose batch takes at most half the budget).")] = None,
    queue_delays: Annotated[str | None, typer.Option("--queue-delays", help="Comma list of max queue delays, e.g. 0,2ms,10ms (default: 0 and 10% of the budget).")] = None,
    preferred: Annotated[str | None, typer.Option("--preferred", help="Comma list of preferred batch sizes: sent at once when the queue fills one (each configuration keeps those within its max).")] = None,
    memory_budget: Budget = None,
    margin: Margin = P.margin,
    max_batch: Annotated[int | None, typer.Option("--max-batch", help="Stop the inference probe growing at this batch size.")] = SV.max_batch,
    confirm: Confirm = P.confirm,
    threads: Annotated[int | None, typer.Option("--threads", help="torch threads of the model process (default: all cores but one, which the load generator keeps).")] = None,
    pin_cpus: Annotated[bool, typer.Option("--pin-cpus/--no-pin-cpus", help="On the CPU, run the server on its threads' cores and the load generator on the others, so neither takes the other's time.")] = SV.pin_cpus,
    window: Annotated[str, typer.Option("--window", help="Measurement window, e.g. 1s (open loop: at least 100 expected arrivals); 3 in a row must agree within 10%.")] = f"{SV.window_s:g}s",
    max_windows: Annotated[int, typer.Option("--max-windows", help="Windows per load at most: until 3 in a row agree, then until the p99's 95% interval is within 10% of it.")] = SV.max_windows,
    min_requests: Annotated[int, typer.Option("--min-requests", help="Requests a Poisson load measures at least before its p99 counts as known, running past --max-windows where its rate is too low (0: --max-windows alone).")] = SV.min_requests,
    queue_timeout: Annotated[str | None, typer.Option("--queue-timeout", help="A request waiting longer in the queue is rejected (default: 10 budgets).")] = None,
    strategy: Annotated[str, typer.Option("--strategy", help="grid: measure every configuration; quick: the queueing simulator, calibrated on the service-time curve, picks the 2 most promising.")] = SV.strategy,
    seed: Seed = P.seed,
    equivalence: Equivalence = f"{SV.equivalence:.0%}",
    trial_timeout: TrialTimeout = P.trial_timeout_s,
    load_timeout: LoadTimeout = P.load_timeout_s,
    profiles_dir: ProfilesDir = PROFILES,
    save: Save = True,
    resume: Resume = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write serve_curve.png (p99 against throughput per configuration) into this folder (needs matplotlib).")] = None,
    format: Format = "table",
    output: Output = None,
    export: Annotated[Path | None, typer.Option("--export", help="Write the chosen configuration's serving files into this folder: triton/<model>/config.pbtxt, torchserve/model-config.yaml and config.properties.")] = None,
) -> None:
    """Tune dynamic batching for inference under a p99 latency budget, on a real server under real load."""
    from mbtune.saving.session import run_serve

    fmt = check_output(check_format(format), output)
    check_resume(resume, save)
    check_outputs(plot_dir=plot, export_dir=export)
    config = settings_in(ctx.params, SV)
    outcome = with_progress("serve", lambda p: run_serve(config, p, profiles_dir=target_folder(profiles_dir, save),
                                                           resume=resume))
    finish_serve(fmt, outcome, plot=plot, output=output, export=export)
