"""Stages balanced by measured cost: each block's forward and backward time, and how even the stages came out.

Parameter counts (Workload.compute_weights) tell a block's cost only where every parameter does the same
work per sample; a block that reuses its weights (a loop, attention over a long sequence) costs far more
than its count says, and the stage holding it sets the pace of the whole pipe. The timing pass measures
every block as a pipeline stage runs it, in a fresh process, so split_blocks can weigh blocks by seconds.

No torch import at module top: the parent only starts the pass and reads its figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from mbtune.actions import COMPUTE_KINDS, LOSS

if TYPE_CHECKING:
    import torch
    from torch import nn

# The loss is timed as its own action after the last stage's forward; it is that stage's work.
STAGE_WORK_KINDS = (*COMPUTE_KINDS, LOSS)


class TimedAction(Protocol):
    """What stage_compute_s reads of an action (timeline.ActionRecord and records.TimelineAction have it)."""

    @property
    def stage(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def start_s(self) -> float: ...
    @property
    def end_s(self) -> float: ...


def time_blocks(workload: str, workload_options: tuple[tuple[str, Any], ...], *, micro_batch_size: int,
                device: str = "cpu", seed: int = 0, precision: str = "fp32", repeats: int = 5,
                threads: int | None = None) -> tuple[float, ...]:
    """Per block, the median seconds of its forward and backward on one micro-batch, measured in THIS
    process (the body a timing child runs; call measure_block_times from a parent).

    Each block is built alone, as a stage builds its own, and fed what the blocks before it make of one
    batch. Blocks after the first also compute their input's gradient and the last backs through the
    loss, as pipeline stages do. One untimed warm-up pass, then `repeats` timed passes; each pass times
    every block once, so noise that drifts over the run spreads over all blocks alike.
    """
    import torch

    from mbtune.workloads import load_workload
    from mbtune.workloads.chain import batch_to

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if threads is not None:
        torch.set_num_threads(threads)
    loaded = load_workload(workload, workload_options)
    target = torch.device("cuda:0" if device.startswith("cuda") else "cpu")
    modules = [loaded.build([i], seed=seed).to(target) for i in range(loaded.num_blocks)]
    inputs, targets = loaded.make_batch(micro_batch_size, torch.Generator().manual_seed(seed))
    block_inputs = _block_inputs(modules, batch_to(inputs, target), precision, target)
    targets = targets.to(target)

    def last_loss(out: torch.Tensor) -> torch.Tensor:
        return loaded.loss(out, targets)

    last = len(modules) - 1
    samples: list[list[float]] = [[] for _ in modules]
    for timed in [False] + [True] * repeats:
        for i, (module, x) in enumerate(zip(modules, block_inputs)):
            seconds = _time_block(module, x, precision, target, loss=last_loss if i == last else None)
            if timed:
                samples[i].append(seconds)
    return tuple(statistics.median(s) for s in samples)


def _block_inputs(modules: Sequence[nn.Module], inputs: torch.Tensor, precision: str,
                  device: torch.device) -> list[Any]:
    """Each block's input (a hand-over: a tensor, a tuple or a dict of them, see workloads/chain.py): what
    the blocks before it make of the batch, detached as a stage receives it. Floating tensors handed to
    later blocks require grad, so their backward computes the input gradient a stage hands back."""
    import torch

    from mbtune.training import autocast_for
    from mbtune.workloads.chain import as_received, call_block

    found: list[Any] = [inputs]
    with torch.enable_grad(), autocast_for(precision, device):  # grad, so each hand-over says what needs one
        for module in modules[:-1]:
            found.append(as_received(call_block(module, found[-1])))
    return found


def _time_block(module: nn.Module, x: Any, precision: str, device: torch.device, *,
                loss: Callable[[Any], torch.Tensor] | None) -> float:
    """Seconds of one forward and backward of `module` on `x`: backward of `loss` (the last block, whose
    stage also computes the loss), else of the output with a gradient of ones. The device is synchronized
    around it: one block runs alone here, so there is no overlap for the synchronize to remove."""
    import torch

    from mbtune.training import autocast_for
    from mbtune.workloads.chain import call_block, tensors_of

    module.zero_grad(set_to_none=True)
    for tensor in tensors_of(x):
        tensor.grad = None
    _synchronize(device)
    start = time.perf_counter()
    with autocast_for(precision, device):
        out = call_block(module, x)
    # The loss runs outside autocast, as the pipeline's last stage computes it on the stage's output.
    results = [loss(out)] if loss is not None else [t for t in tensors_of(out) if t.requires_grad]
    if results and results[0].requires_grad:
        torch.autograd.backward(results, grad_tensors=[torch.ones_like(r) for r in results])
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_block_times(workload: str, workload_options: Sequence[tuple[str, Any]], *, micro_batch_size: int,
                        device: str = "cpu", seed: int = 0, precision: str = "fp32", repeats: int = 5,
                        threads: int | None = None, timeout_s: float = 120.0) -> tuple[float, ...]:
    """Per block, the median forward and backward seconds (see time_blocks), measured in a fresh process
    under `timeout_s`, so the workload's code and allocations never touch this one.

    A timing pass that fails raises TrialFailedError where the workload is at fault (it raised, hung or
    killed its process) and HarnessError where the process died before it reached the workload.
    """
    from mbtune.errors import HarnessError, TrialFailedError
    from mbtune.records import HARNESS_FAULT, OK
    from mbtune.worker import run_isolated

    settings = {"micro_batch_size": micro_batch_size, "device": device, "seed": seed, "precision": precision,
                "repeats": repeats, "threads": threads}
    result = run_isolated(_timing_child, workload, tuple(workload_options), settings, timeout_s=timeout_s)
    if result.status == OK:
        return tuple(float(s) for s in result.value)
    lines = (result.error or "").strip().splitlines()
    message = f"the timing pass for balancing stages ended as {result.status}: {lines[-1] if lines else 'no error text'}"
    if result.error_kind == HARNESS_FAULT:
        raise HarnessError(message, detail=result.error_tail)
    # A short hint leaves the one-line message room for the cause (MBTUNE_DEBUG=1 shows the detail).
    raise TrialFailedError(message, detail=result.error_tail, hint="Fix the workload, or balance stages by parameters.")


def _timing_child(workload: str, workload_options: tuple[tuple[str, Any], ...],
                  settings: dict[str, Any]) -> tuple[float, ...]:
    """time_blocks with its keyword settings passed as one positional value (run_isolated passes args only)."""
    return time_blocks(workload, workload_options, **settings)


def stage_imbalance(stage_compute_s: Sequence[float]) -> float | None:
    """Slowest over fastest stage compute time: 1.0 is perfectly even, and the pipe runs at the slowest's
    pace. None with fewer than two stages, or when the fastest did no measurable work."""
    if len(stage_compute_s) < 2:
        return None
    fastest = min(stage_compute_s)
    if fastest <= 0:
        return None
    return max(stage_compute_s) / fastest


def stage_compute_s(actions: Iterable[TimedAction], num_model_stages: int) -> tuple[float, ...]:
    """Per model stage (virtual stages included, 0 .. num_model_stages-1), the summed seconds of its compute
    actions over the given records; the loss counts as the last stage's work. 0.0 where a stage has none.
    Pass one step's actions to compare stages within a step, or all of them for a total."""
    totals = [0.0] * num_model_stages
    for action in actions:
        if action.kind not in STAGE_WORK_KINDS:
            continue
        if not 0 <= action.stage < num_model_stages:
            raise ValueError(f"an action of stage {action.stage} is outside the {num_model_stages} model stages")
        totals[action.stage] += action.end_s - action.start_s
    return tuple(totals)
