"""Typed wrappers over torch.distributed.pipelining: the only module that imports that API.

Besides the public classes (PipelineStage and the schedules), the action timer reaches into stage methods
that torch marks as public but that schedules call internally (forward_one_chunk, backward_one_chunk,
backward_weight_one_chunk). Their signatures are those of torch 2.6-2.14; pyproject pins that range.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from mbtune.pipeline.theory import SINGLE, schedule_info
from mbtune.pipeline.timeline import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, LOSS, ActionRecord

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def schedule_class(schedule: str) -> type:
    """The torch schedule class behind an mbtune schedule name."""
    return getattr(torch_schedules, schedule_info(schedule).torch_class)


def build_stage(module: nn.Module, *, stage_index: int, num_stages: int, device: torch.device) -> PipelineStage:
    """Wrap one stage's module; shapes are inferred by torch from the first micro-batch."""
    return PipelineStage(module, stage_index, num_stages, device)


def build_schedule(schedule: str, stages: Sequence[PipelineStage], *, num_microbatches: int, loss_fn: LossFn) -> Any:
    """Build the torch schedule over this rank's stages (in increasing stage order).

    Gradients are never rescaled by torch (scale_grads=False): torch divides every .grad by the number of
    micro-batches at the end of each step, which would also shrink gradients accumulated over earlier
    steps. The caller scales the loss instead.
    """
    cls = schedule_class(schedule)
    if schedule_info(schedule).layout == SINGLE:
        if len(stages) != 1:
            raise ValueError(f"{schedule} takes one stage per rank, got {len(stages)}")
        return cls(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(list(stages), num_microbatches, loss_fn=loss_fn, scale_grads=False)


def run_schedule_step(schedule: Any, args: tuple[torch.Tensor, ...], *, target: torch.Tensor | None,
                      losses: list[torch.Tensor] | None) -> None:
    """One schedule step: inputs on the first stage's rank, target and losses on the last stage's.

    The last stage's outputs are not kept (they would only add memory) where torch lets us say so.
    """
    if _accepts_return_outputs(type(schedule)):
        schedule.step(*args, target=target, losses=losses, return_outputs=False)
    else:
        schedule.step(*args, target=target, losses=losses)


@functools.cache
def _accepts_return_outputs(cls: type) -> bool:
    return "return_outputs" in inspect.signature(cls.step).parameters


class ActionTimer:
    """Records when each stage computes what, by wrapping the stage's per-micro-batch methods.

    Waiting for activations or gradients happens in the schedule before these calls, so the recorded spans
    are compute only. On CUDA the device is synchronized on both sides of each span.
    """

    def __init__(self, *, synchronize: Callable[[], None] | None = None) -> None:
        self.records: list[ActionRecord] = []
        self._synchronize = synchronize or (lambda: None)
        self._enabled = False
        self._step = 0
        self._accum = 0
        self._origin_s = 0.0
        self._pending_loss: tuple[int, int] | None = None  # (stage, micro-batch) whose loss comes next

    def start(self, *, step: int, accum: int, origin_s: float) -> None:
        """Record from now on, tagging spans with this step and relative to origin_s (perf_counter)."""
        self._enabled, self._step, self._accum, self._origin_s = True, step, accum, origin_s

    def stop(self) -> None:
        self._enabled = False

    def instrument(self, stage: PipelineStage) -> None:
        """Shadow the stage's compute methods with timed versions (instance attributes win over the class)."""
        stage.forward_one_chunk = self._wrap(stage, stage.forward_one_chunk, "fwd_chunk_id", lambda kw: FORWARD)
        stage.backward_one_chunk = self._wrap(
            stage, stage.backward_one_chunk, "bwd_chunk_id",
            lambda kw: BACKWARD if kw.get("full_backward", True) else BACKWARD_INPUT,
        )
        stage.backward_weight_one_chunk = self._wrap(
            stage, stage.backward_weight_one_chunk, "bwd_chunk_id", lambda kw: BACKWARD_WEIGHT
        )

    def wrap_loss(self, loss_fn: LossFn) -> LossFn:
        """Time the loss as its own action. Only losses that follow a timed forward of the last stage count,
        which leaves out the call torch makes while inferring shapes."""

        @functools.wraps(loss_fn)
        def timed_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            pending, self._pending_loss = self._pending_loss, None
            if not self._enabled or pending is None:
                return loss_fn(output, target)
            return self._timed(lambda: loss_fn(output, target), stage=pending[0], kind=LOSS, microbatch=pending[1])

        return timed_loss

    def _wrap(self, stage: PipelineStage, method: Callable[..., Any], chunk_arg: str,
              kind_of: Callable[[dict[str, Any]], str]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._enabled:
                return method(*args, **kwargs)
            microbatch = args[0] if args else kwargs[chunk_arg]
            kind = kind_of(kwargs)
            result = self._timed(lambda: method(*args, **kwargs), stage=stage.stage_index, kind=kind,
                                 microbatch=microbatch)
            if kind == FORWARD and stage.is_last:
                self._pending_loss = (stage.stage_index, microbatch)
            return result

        return timed

    def _timed(self, run: Callable[[], Any], *, stage: int, kind: str, microbatch: int) -> Any:
        self._synchronize()
        start = time.perf_counter()
        result = run()
        self._synchronize()
        end = time.perf_counter()
        self.records.append(ActionRecord(
            step=self._step, accum=self._accum, stage=stage, kind=kind, microbatch=int(microbatch),
            start_s=start - self._origin_s, end_s=end - self._origin_s,
        ))
        return result
