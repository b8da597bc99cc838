"""The check's records: each block's gradient difference and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mbtune.pipeline.point import SweepPoint
from mbtune.recordio import (
    Record,
)


@dataclass(frozen=True, kw_only=True)
class BlockCheck(Record):
    """One block's gradients from the pipeline against the plain model's."""

    block: int
    max_abs_diff: float
    max_rel_diff: float  # max |pipeline - plain| / max |plain| over the block's parameters
    ok: bool


@dataclass(frozen=True, kw_only=True)
class CheckResult(Record):
    """`mbtune check`: one optimizer step through the real pipeline against the plain model on the same
    global batch and seed (checking/run.py). status PASS or FAIL; cause and hint say why it failed."""

    __repr__ = Record.__repr__

    workload: str
    workload_options: dict[str, Any] = field(default_factory=dict)
    device: str
    precision: str
    point: SweepPoint
    status: str  # PASS | FAIL
    loss_pipeline: float
    loss_plain: float
    loss_rel_diff: float
    rtol: float
    atol: float
    blocks: tuple[BlockCheck, ...] = ()
    cause: str = ""
    hint: str = ""
    handovers_compared: int = 0  # tensors that crossed a stage boundary, forward and backward, held to what was sent
    handover_difference: str = ""  # the first that arrived other than it was sent ("": none)

    @property
    def worst(self) -> BlockCheck | None:
        return max(self.blocks, key=lambda b: b.max_rel_diff, default=None)


@dataclass(frozen=True, kw_only=True)
class BlockValidation(Record):
    """One block of a validated workload (checking/workload.py)."""

    block: int
    name: str
    parameters: int  # a tie's copies counted once
    flops_per_sample: float  # training (forward + backward), as FlopCounterMode counts
    hands_over: str  # shapes and dtypes of its output
    crosses: str  # "yes", or "no: why" (the last block hands over to the loss: "")
    gradient_back: bool  # its input, received as a stage receives it, gets a gradient
    max_rel_diff: float  # its gradients through stage boundaries against the whole chain's
    ok: bool


@dataclass(frozen=True, kw_only=True)
class ValidationResult(Record):
    """The workload validated before any pipeline: PASS or FAIL with the cause naming the block."""

    __repr__ = Record.__repr__

    workload: str
    workload_options: dict[str, Any] = field(default_factory=dict)
    status: str
    batch_size: int
    loss: float  # the blocks' loss on the batch
    model_loss: float | None = None  # the user's own model's, where mbtune split it
    blocks: tuple[BlockValidation, ...] = ()
    ties: tuple[tuple[str, ...], ...] = ()
    cause: str = ""
