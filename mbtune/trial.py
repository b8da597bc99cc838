"""The body of one training trial, run inside a fresh trial process (see worker.py).

Imported by the trial forkserver at start-up so each trial begins with torch already loaded.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import traceback
from typing import Any

import torch

from mbtune.config import INFER, TRAIN, TrialConfig, lr_for
from mbtune.device import classify_error, get_backend
from mbtune.errors import NonFiniteLossError
from mbtune.records import NONFINITE, OK, WORKLOAD_FAULT, TrialOutcome
from mbtune.workloads import Workload, load_workload

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    flops: float | None = None
    status, error, tail = OK, "", ""
    try:
        workload = load_workload(config.workload, config.workload_options)
        if config.mode == INFER:
            step_times_s = _infer(workload, config)
        for step, (step_s, loss) in enumerate(_train(workload, config, backend) if config.mode == TRAIN else (), 1):
            if not math.isfinite(loss):
                raise NonFiniteLossError(loss, step)
            step_times_s.append(step_s)
            loss_value = loss
        if config.count_flops:  # after the steps: the count is not in what they measured
            from mbtune.workloads.flops import count_flops_per_sample

            flops = count_flops_per_sample(workload)
    except NonFiniteLossError as exc:
        status, error, tail = NONFINITE, str(exc), _traceback_tail()
    except Exception as exc:  # noqa: BLE001 - every failure becomes data
        status = classify_error(exc)
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        tail = _traceback_tail()
        if os.environ.get("MBTUNE_DEBUG"):
            error += "\n" + traceback.format_exc()
    # The exception and its frames are gone here, so the peaks are read with the memory released.
    return TrialOutcome(
        status=status, batch_size=config.batch_size, step_times_s=tuple(step_times_s), loss=loss_value,
        wall_s=time.perf_counter() - started, error=error, device=backend.info(),
        error_kind=WORKLOAD_FAULT if status != OK else "", error_tail=tail, flops_counted=flops, **backend.peaks(),
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


def _train(workload: Workload, config: TrialConfig, backend: Any):
    """Yield (step seconds, loss) for each full training step: forward, backward, optimizer step."""
    device = torch.device(backend.torch_device)
    model = workload.build(seed=config.seed, recompute=config.recompute).to(device)
    model.train()
    optimizer = make_optimizer(config.optimizer, list(model.parameters()), lr=lr_for(config.optimizer, config.lr))
    use_scaler = config.precision == "fp16"
    scaler = torch.amp.GradScaler("cuda") if use_scaler else None
    generator = torch.Generator().manual_seed(config.seed)
    _create_optimizer_state(model, optimizer)
    for _ in range(config.steps):
        inputs, targets = (t.to(device) for t in workload.make_batch(config.batch_size, generator))
        backend.synchronize()
        start = time.perf_counter()
        with autocast_for(config.precision, device):
            loss = workload.loss(model(inputs), targets)
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
        yield step_s, float(loss.detach())
        del inputs, targets, loss


def _infer(workload: Workload, config: TrialConfig) -> list[float]:
    """Seconds of each of `config.steps` forward passes under torch.inference_mode, in eval mode."""
    from mbtune.serving.infer import InferenceModel

    model = InferenceModel(workload, device=config.device, precision=config.precision, seed=config.seed)
    times = []
    for _ in range(config.steps):
        inputs = model.inputs(config.batch_size)
        times.append(model.run(inputs))
        del inputs
    return times


def _create_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state before the first step, by one step on zero gradients.

    Optimizers create their state (AdamW's two moments, SGD's momentum) in their first step, so without
    this the first training step peaks lower than every later one, and a batch too large for training
    fails only in the second step, a whole step later. With the state in place every step, the first
    included, peaks as training does, and an out-of-memory comes in the first. Zero gradients leave
    SGD's weights as they were and move AdamW's only by its weight decay (1 - lr x decay)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_optimizer(name: str, params: list[torch.nn.Parameter], *, lr: float) -> torch.optim.Optimizer:
    """The optimizer a probe trial and every pipeline rank train with (the same state, so the same memory)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr)


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision in _AUTOCAST_DTYPES:
        return torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()


def describe_device(device: str) -> Any:
    """DeviceInfo of a resolved device, read inside a child so the parent never initialises CUDA."""
    return get_backend(device).info()
