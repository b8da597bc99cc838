"""Activation recompute (checkpointing) per block: what `--recompute full` builds.

A block under recompute keeps only its input through the forward; its backward runs the block's forward
again (torch.utils.checkpoint, non-reentrant) to rebuild the activations it needs. Peak activation memory
then grows with the blocks' inputs (one hand-over each) instead of everything each block saves, at the
cost of one more forward per block in every backward (two where a zero-bubble schedule splits the
backward in an input and a weight part: each part is an autograd call of its own and recomputes). The module is a Chain of the same blocks, so
parameter names, weights and gradients are the plain model's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mbtune.errors import ConfigError
from mbtune.records import RECOMPUTE_MODES
from mbtune.workloads.chain import Chain, call_block


def check_recompute(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute={mode!r} is not a recompute mode", field="recompute", given=mode,
                          expected=" | ".join(RECOMPUTE_MODES), hint="Use --recompute none or full.")


class Recomputed(Chain):
    """A Chain whose blocks are each an activation checkpoint while gradients are being recorded."""

    def step(self, block: nn.Module, value: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return call_block(block, value)
        # The hand-over goes in whole (a dict's keys can never clash with checkpoint's own keywords).
        return checkpoint(call_block, block, value, use_reentrant=False)
