"""Learning-rate advice: the learning rate each global batch implies, scaled from the recipe's.

SGD-family optimizers scale it linearly with the global batch (Goyal et al., "Accurate, Large Minibatch
SGD"), Adam-family ones by its square root (Malladi et al., "On the SDEs and Scaling Rules for Adaptive
Gradient Algorithms"). Either way a larger batch wants warm-up kept or lengthened. Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from mbtune.sweeping.records import LrAdvice

LINEAR, SQUARE_ROOT = "linear", "square-root"
RULES = {"sgd": LINEAR, "adamw": SQUARE_ROOT}
WARMUP_NOTE = "keep the recipe's warm-up, or lengthen it, where the global batch grows"


def scale_for(rule: str, global_batch: int, reference_batch: int) -> float:
    """How much the learning rate grows from the reference batch to this one under the rule."""
    ratio = global_batch / reference_batch
    return ratio if rule == LINEAR else math.sqrt(ratio)


def lr_advice(optimizer: str, global_batches: Iterable[int], *, lr: float | None = None,
              reference_batch: int | None = None) -> tuple[LrAdvice, ...]:
    """One LrAdvice per distinct global batch, smallest first. The reference is the recipe's batch when
    given, else the smallest batch here; the advised rate is the recipe's `lr` scaled, or None (then only
    the scale factor is known)."""
    batches = sorted(set(global_batches))
    if not batches:
        return ()
    rule = RULES[optimizer]
    reference = reference_batch or batches[0]
    return tuple(LrAdvice(global_batch=b, reference_batch=reference, rule=rule,
                          scale=(scale := scale_for(rule, b, reference)),
                          lr=lr * scale if lr is not None else None) for b in batches)
