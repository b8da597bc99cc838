"""The training commands: probe, confirm, sweep and tune."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from mbtune.cli import support
from mbtune.cli.options import (
    BUDGET_OPTIONS,
    GRID_OPTIONS,
    LAUNCH_OPTIONS,
    MEASURE_OPTIONS,
    OUTPUT_OPTIONS,
    PICTURE_OPTIONS,
    PROBE_STEPS,
    SAVE_OPTIONS,
    TRAINING_OPTIONS,
    TRIAL_TIMEOUT,
    WORKLOAD_OPTIONS,
    Check,
    CommandName,
    ConfirmDuration,
    Device,
    FromProfile,
    GridOption,
    ProbeStepsInTune,
    StepsFromOutput,
    TrainingCommand,
    command,
    option,
)
from mbtune.cli.support import PROFILE_HINT, Given, check_inputs, finish, say_on_stderr, settings_in, with_progress


def _probe(given: dict[str, Any]) -> None:
    """Find the per-device memory ceiling with real training steps, then leave a safety margin: of a workload, or
    of your own training command as it is (mbtune probe -- python train.py --batch-size {batch})."""
    from mbtune.probing.config import ProbeConfig
    from mbtune.saving.session import run_probe

    run = Given.of(given)
    config = settings_in(given, ProbeConfig)
    outcome = with_progress("probe", lambda p: run_probe(config, p, profiles_dir=run.folder, resume=run.resume))
    finish(run.fmt, outcome, output=run.output)


def _sweep(given: dict[str, Any]) -> None:
    """Run real pipelined training steps across micro-batches, accumulation steps and schedules."""
    from mbtune.saving.session import run_sweep
    from mbtune.sweeping.config import SweepConfig

    run = Given.of(given)
    # The saved probe that bounds the micro-batch size is read before anything runs.
    check_inputs({"--from-profile": (given["from_profile"], PROFILE_HINT)})
    config = settings_in(given, SweepConfig)
    outcome = with_progress("sweep", lambda p: run_sweep(config, p, profiles_dir=run.folder, resume=run.resume,
                                                           from_profile=given["from_profile"],
                                                           probes_dir=given["profiles_dir"], say=say_on_stderr))
    finish(run.fmt, outcome, plot=run.plot, trace=run.trace, output=run.output)


def _tune(given: dict[str, Any]) -> None:
    """Probe the memory ceiling, sweep pipeline configurations around the safe batch, check the best one's update:
    of a workload, or of your own pipelined training command (mbtune tune -- torchrun ... train.py
    --micro-batch-size {micro_batch_size} --micro-batches {micro_batches} --schedule {schedule}), probed at the
    grid's hungriest point and swept under the probed budget."""
    from mbtune.saving.session import run_tune
    from mbtune.sweeping.tune import tune_configs

    run = Given.of(given)
    probe_config, sweep_config = settings_in(given, tune_configs)
    outcome = with_progress("tune", lambda p: run_tune(probe_config, sweep_config, p, check=given["check"],
                                                         profiles_dir=run.folder, resume=run.resume,
                                                         say=say_on_stderr))
    finish(run.fmt, outcome, plot=run.plot, trace=run.trace, output=run.output)


COMMAND_OPTIONS = (option("command", TrainingCommand), option("name", CommandName),
                   option("steps_from_output", StepsFromOutput))
probe = command(_probe, COMMAND_OPTIONS, (option("confirm_duration", ConfirmDuration),), WORKLOAD_OPTIONS,
                BUDGET_OPTIONS, PROBE_STEPS, TRAINING_OPTIONS, TRIAL_TIMEOUT, SAVE_OPTIONS, OUTPUT_OPTIONS)
sweep = command(_sweep, (*COMMAND_OPTIONS, option("grid", GridOption)), WORKLOAD_OPTIONS, GRID_OPTIONS, (option("from_profile", FromProfile),), MEASURE_OPTIONS,
                TRAINING_OPTIONS, LAUNCH_OPTIONS, SAVE_OPTIONS, PICTURE_OPTIONS, OUTPUT_OPTIONS)
tune = command(_tune, (*COMMAND_OPTIONS, option("grid", GridOption)), WORKLOAD_OPTIONS, BUDGET_OPTIONS, (option("probe_steps", ProbeStepsInTune, PROBE_STEPS[0].default),),
               TRIAL_TIMEOUT, GRID_OPTIONS, MEASURE_OPTIONS, TRAINING_OPTIONS, (option("check", Check, True),),
               LAUNCH_OPTIONS, SAVE_OPTIONS, PICTURE_OPTIONS, OUTPUT_OPTIONS)


def confirm(
    ctx: typer.Context,
    command: Annotated[list[str], typer.Argument(help="The training command, after --, as you would run it (at the batch size to confirm).", show_default=False)],
    memory_budget: Annotated[str, typer.Option("--memory-budget", help="The budget to hold it to, e.g. 3GiB: the probe's, so the cap is a probe trial's.")],
    runs: Annotated[int | None, typer.Option("--runs", help="Runs, each in fresh processes (default: 3; 1 with --duration).")] = None,
    duration: Annotated[str | None, typer.Option("--duration", help="Run each for this long (e.g. 30m, 2h), through its evaluation passes and checkpoints, then ask it to stop; it fits when nothing went past the budget (as does a run that ends sooner). Default: until it ends.")] = None,
    device: Device = "auto",
    timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds a run may take before it is stopped (counts as crashed); with --duration, longer than it (default: 3600, or the duration and the time to stop).")] = None,
    format: Annotated[str, typer.Option("--format", "-f", help="table (people) or json (machines).")] = "table",
) -> None:
    """Run your own training command under the cap a probe trial runs under (CPU: live tensor bytes; CUDA:
    the per-process memory fraction), set before its first line: exit 0 when every run fits, 1 when one ran
    out of memory, 3 when one crashed otherwise. Each run's peak over time is reported: a high-water mark that
    rose after the first steps is named with when it rose, the evaluation passes and checkpoints seen, and on
    CUDA the allocator's retries and fragmentation."""
    from mbtune.cli.support import check_format
    from mbtune.probing.confirm import ConfirmConfig, confirm_command
    from mbtune.report import make_console
    from mbtune.report.confirm import print_confirm, print_confirm_run, print_confirm_start

    fmt = check_format(format, allowed=("table", "json"))
    config = settings_in(ctx.params, ConfirmConfig)
    progress = make_console(stderr=True)
    if not support.quiet[0]:
        print_confirm_start(progress, config)
    result = confirm_command(config, on_run=None if support.quiet[0] else
                             lambda index, run: print_confirm_run(progress, index, run))
    print_confirm(make_console(), result, fmt)
    raise typer.Exit(result.exit_code)
