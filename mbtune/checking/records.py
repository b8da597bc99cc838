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

    @property
    def worst(self) -> BlockCheck | None:
        return max(self.blocks, key=lambda b: b.max_rel_diff, default=None)
