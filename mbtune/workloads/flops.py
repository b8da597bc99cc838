"""Training FLOPs per sample, counted rather than typed: one forward and backward of the whole chain and its
loss under torch.utils.flop_counter.FlopCounterMode, at batch sizes 1 and 2 on the meta device (no memory,
no arithmetic); the difference is per sample. FlopCounterMode counts matmuls, convolutions and attention
(the work that dominates); elementwise work is left out, as MFU conventions leave it out."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils.flop_counter import FlopCounterMode

from mbtune.workloads.chain import batch_to

if TYPE_CHECKING:
    from mbtune.workloads import Workload

DISAGREE_FRACTION = 0.10  # a typed figure further than this from the counted one gets a warning


def count_flops_per_sample(workload: Workload) -> float | None:
    """Forward + backward FLOPs per sample of the workload's training step, or None where the meta device
    cannot run it (or counts nothing)."""
    try:
        counts = [_count(workload, batch) for batch in (1, 2)]
    except (Exception, SystemExit):  # noqa: BLE001 - user code the meta device cannot run: no count, not an error
        return None
    per_sample = counts[1] - counts[0]
    return float(per_sample) if per_sample > 0 else None


def _count(workload: Workload, batch: int) -> int:
    inputs, targets = workload.make_batch(batch, torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = workload.build()
    with FlopCounterMode(display=False) as counter:
        loss = workload.loss(model(batch_to(inputs, "meta")), targets.to("meta"))
        loss.backward()
    return counter.get_total_flops()


def flops_warning(name: str, typed: float | None, counted: float | None) -> str | None:
    """A warning where the workload's own figure and the counted one disagree by more than 10%."""
    if typed is None or counted is None or abs(typed - counted) <= DISAGREE_FRACTION * counted:
        return None
    return (f"workload {name!r} says {typed / 1e9:.4g} GFLOP per sample, the counter {counted / 1e9:.4g} "
            f"({typed / counted - 1:+.0%}): MFU uses the workload's figure")
