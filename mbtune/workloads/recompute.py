"""Activation recompute (checkpointing) per block: what `--recompute full` builds.

A block under recompute keeps only its input through the forward; its backward runs the block's forward
again (torch.utils.checkpoint, non-reentrant) to rebuild the activations it needs. Peak activation memory
then grows with the blocks' inputs (one tensor each) instead of everything each block saves, at the cost of
one more forward per block in every backward. The module is an nn.Sequential of the same blocks, so
parameter names, weights and gradients are the plain model's.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from mbtune.errors import ConfigError
from mbtune.records import RECOMPUTE_MODES


def check_recompute(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute={mode!r} is not a recompute mode", field="recompute", given=mode,
                          expected=" | ".join(RECOMPUTE_MODES), hint="Use --recompute none or full.")


class Recomputed(nn.Sequential):
    """Blocks in order, each an activation checkpoint while gradients are being recorded."""

    def forward(self, value: Any) -> Any:
        for block in self:
            if self.training and _records_grad(block, value):
                value = checkpoint(block, value, use_reentrant=False)
            else:
                value = block(value)
        return value


def _records_grad(block: nn.Module, value: Any) -> bool:
    import torch

    if not torch.is_grad_enabled():
        return False
    return any(p.requires_grad for p in block.parameters()) or getattr(value, "requires_grad", False)
