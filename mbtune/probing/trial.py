"""The body of one training trial, run inside a fresh trial process (see worker.py).

Imported by the trial forkserver at start-up so each trial begins with torch already loaded.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from dataclasses import replace
from typing import Any

import torch

from mbtune.device import classify_error, get_backend
from mbtune.device.oom_figures import oom_fields
from mbtune.errors import MbtuneError, NonFiniteLossError
from mbtune.probing.config import TrialConfig
from mbtune.probing.records import TrialOutcome
from mbtune.records import ERROR, HARNESS_FAULT, NONFINITE, OK, OOM, WORKLOAD_FAULT
from mbtune.settings import INFER, TRAIN, lr_for
from mbtune.training import autocast_for, create_optimizer_state, make_optimizer, on_device
from mbtune.worker import failure_tail, run_isolated
from mbtune.workloads import Workload, failed_part, load_workload
from mbtune.workloads.chain import batch_to


def run_training_trial(config: TrialConfig) -> TrialOutcome:
    """Build the workload, run `config.steps` full training steps, and report how it went.

    Never raises for a failure of the trial itself: OOM and other errors come back as the outcome's
    status, classified by type at the device boundary; a NaN or infinite loss ends the trial as nonfinite.
    """
    started = time.perf_counter()
    backend = get_backend(config.device)
    _import_before_cap(config.workload)
    backend.limit_memory(config.memory_budget_bytes)
    torch.set_num_threads(config.threads or os.cpu_count() or 1)
    step_times_s: list[float] = []
    loss_value: float | None = None
    status, error, tail = OK, "", ""
    try:
        workload = load_workload(config.workload, config.workload_options)
        if config.mode == INFER:
            step_times_s = _infer(workload, config)
        for step, (step_s, loss_tensor) in enumerate(train_steps(workload, config, backend) if config.mode == TRAIN else (), 1):
            loss = float(loss_tensor)
            if not math.isfinite(loss):
                raise NonFiniteLossError(loss, step)
            step_times_s.append(step_s)
            loss_value = loss
    except NonFiniteLossError as exc:
        status, error, tail = NONFINITE, str(exc), _traceback_tail()
    except Exception as exc:  # noqa: BLE001 - every failure becomes data
        status = classify_error(exc)
        error = (exc.message if isinstance(exc, MbtuneError) else
                 "".join(traceback.format_exception_only(type(exc), exc)).strip())
        part = failed_part(exc)
        if part is not None and status != OOM:
            error = f"in {part}: {error}" if part.startswith("block") else f"in the workload's {part}: {error}"
        tail = _traceback_tail()
        if os.environ.get("MBTUNE_DEBUG"):
            error += "\n" + traceback.format_exc()
    # The exception and its frames are gone here, so the peaks are read with the memory released.
    return TrialOutcome(
        status=status, batch_size=config.batch_size, step_times_s=tuple(step_times_s), loss=loss_value,
        wall_s=time.perf_counter() - started, error=error, device=backend.info(),
        error_kind=WORKLOAD_FAULT if status != OK else "", error_tail=tail, **backend.peaks(),
        **(oom_fields(error) if status == OOM else {}),
    )


def _import_before_cap(workload: str) -> None:
    """Import the workload's library before the memory cap, so the budget measures training, not imports
    (a plain training loop would have its libraries imported before it starts, too). Failures are left to
    the load that follows, which classifies them."""
    if workload.startswith("hf:"):
        from mbtune.workloads.hf import preload

        preload(workload[3:])
        return
    module, sep, _ = workload.partition(":")
    if sep and module:
        import importlib

        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - reported, with its cause, by load_workload
            pass


def _traceback_tail() -> str:
    """The last lines of the exception being handled, with its traceback."""
    from mbtune.worker import tail_lines

    return tail_lines(traceback.format_exc())


def train_steps(workload: Workload, config: TrialConfig, backend: Any):
    """Yield (step seconds, the loss, detached) for each full training step: forward, backward, optimizer
    step. `backend`: torch_device and synchronize() of the trial's device."""
    device = torch.device(backend.torch_device)
    # The model as the user wrote it where there is one (from_module, hf:), so no block boundary holds a
    # byte their loop would not; recompute wraps blocks, so it trains the chain of them.
    whole = workload.whole_model(seed=config.seed) if config.recompute == "none" else None
    model = on_device(whole if whole is not None else workload.build(seed=config.seed, recompute=config.recompute),
                      device)
    model.train()
    optimizer = make_optimizer(config.optimizer, list(model.parameters()), lr=lr_for(config.optimizer, config.lr))
    use_scaler = config.precision == "fp16"
    scaler = torch.amp.GradScaler("cuda") if use_scaler else None
    generator = torch.Generator().manual_seed(config.seed)
    create_optimizer_state(list(model.parameters()), optimizer)
    # Where the workload's users' loop holds a step's outputs until the next forward returns (`logits, loss =
    # model(x, y)`), so does the trial: the logits of a language model are the largest tensor of its step, and
    # a batch that leaves no room for them would fit mbtune and fail the user's loop (Workload.holds_outputs).
    outputs: Any = None
    for _ in range(config.steps):
        inputs, targets = workload.make_batch(config.batch_size, generator)
        inputs, targets = batch_to(inputs, device), targets.to(device)
        backend.synchronize()
        start = time.perf_counter()
        with autocast_for(config.precision, device):
            if whole is not None:
                outputs, loss = model(inputs, targets)
            else:
                outputs = model(inputs)
                loss = workload.loss(outputs, targets)
        if not workload.holds_outputs:
            outputs = None
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        backend.synchronize()
        step_s = time.perf_counter() - start
        yield step_s, loss.detach()
        del inputs, targets, loss


def _infer(workload: Workload, config: TrialConfig) -> list[float]:
    """Seconds of each of `config.steps` forward passes under torch.inference_mode, in eval mode."""
    from mbtune.probing.inference import InferenceModel

    model = InferenceModel(workload, device=config.device, precision=config.precision, seed=config.seed)
    times = []
    for _ in range(config.steps):
        inputs = model.inputs(config.batch_size)
        times.append(model.run(inputs))
        del inputs
    return times


# When a trial under a memory cap fails with an error that is not a recognised OOM, it is run once more
# with this much more room: if it then runs (or fails for memory), the first failure was memory too.
# Under a tight cap the allocation can fail deep inside a library (oneDNN's "could not create a
# primitive", OpenMP's thread creation) with no allocator message to recognise.
RECHECK_BUDGET_FACTOR = 2


def run_classified_trial(trial: TrialConfig, timeout_s: float) -> TrialOutcome:
    """run_trial, with errors under a memory cap re-checked with more room before they count as errors."""

    outcome = run_trial(trial, timeout_s=timeout_s)
    if outcome.status != ERROR or trial.memory_budget_bytes is None or outcome.error_kind == HARNESS_FAULT:
        return outcome
    roomier = replace(trial, memory_budget_bytes=trial.memory_budget_bytes * RECHECK_BUDGET_FACTOR + 64 * 2**20)
    recheck = run_trial(roomier, timeout_s=timeout_s)
    if recheck.status not in (OK, OOM):
        return outcome
    return replace(outcome, status=OOM, error=f"{outcome.error} [out of memory: the same trial "
                   f"{'ran' if recheck.ok else 'ran out of memory'} with {RECHECK_BUDGET_FACTOR}x the budget]")


def run_trial(config: TrialConfig, *, timeout_s: float) -> TrialOutcome:
    """One isolated training trial; always returns a TrialOutcome, whatever happens."""

    result = run_isolated(run_training_trial, config, timeout_s=timeout_s)
    if result.status == OK:
        outcome = result.value
        if outcome.ok or not result.stderr_tail:
            return outcome
        return replace(outcome, error_tail=failure_tail(outcome.error_tail, result.stderr_tail))
    return TrialOutcome(status=result.status, batch_size=config.batch_size, wall_s=result.wall_s,
                        error=result.error, error_kind=result.error_kind, error_tail=result.error_tail)
