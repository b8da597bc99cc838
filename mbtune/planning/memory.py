"""The memory side of the cost model: optimizer state, gradients all-reduced, activations held, and the fixed
bytes of each rank fitted on what the sweep measured."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.split import split_blocks
from mbtune.pipeline.theory import stage_to_rank
from mbtune.planning.fit import median_or
from mbtune.planning.orders import RankOrders
from mbtune.planning.records import (
    BlockFacts,
)
from mbtune.planning.simulate import peak_in_flight
from mbtune.sweeping.records import PointResult

# A plan splits the same blocks over the same stages for every micro-batch count and twice per point, and a
# weighted split costs about the square of the blocks: keep the recent ones (they are immutable tuples).
_split = functools.lru_cache(maxsize=64)(split_blocks)

STATE_BYTES_PER_PARAMETER = {"adamw": 16.0, "sgd": 8.0}  # fp32 weights + gradients (+ AdamW's two moments)


GRAD_BYTES_PER_PARAMETER = 4  # fp32 gradients are what data-parallel replicas all-reduce


def allreduce_volume_bytes(parameters: int, replicas: int) -> float:
    """Bytes one rank sends in a ring all-reduce of its gradients over the replicas: 2(d-1)/d of them."""
    return 2 * (replicas - 1) / replicas * parameters * GRAD_BYTES_PER_PARAMETER


def activation_bytes(facts: BlockFacts, blocks: Sequence[int], held: int, micro_batch_size: int,
                     recompute: str = "none") -> float:
    """Peak activation bytes of a stage of these blocks holding `held` micro-batches (see stage_memory_bytes)."""
    saved = facts.saved_bytes_per_sample
    if not saved:
        return 0.0
    if recompute != "full":
        return held * micro_batch_size * sum(saved[b] for b in blocks)
    outputs = facts.output_bytes_per_sample
    inputs = sum(outputs[b - 1] for b in blocks if b > 0) if outputs else 0
    return micro_batch_size * (held * inputs + max(saved[b] for b in blocks))


def base_bytes(runs: Sequence[PointResult], facts: BlockFacts, state: float,
                orders_of: Callable[[SweepPoint], RankOrders]) -> float:
    bases = []
    for result in runs:
        point = result.point
        split = result.stage_blocks or point_split(point, facts)
        owners = stage_to_rank(point.schedule, point.num_ranks, len(split))
        try:
            held = peak_in_flight(orders_of(point), len(split))
        except ValueError:
            held = (0,) * len(split)
        params = rank_parameters(split, owners, facts)
        activations = [0.0] * len(params)
        for stage, blocks in enumerate(split):
            activations[owners[stage]] += activation_bytes(facts, blocks, held[stage], point.micro_batch_size,
                                                           point.recompute)
        for rank, peak in enumerate(result.peak_memory_bytes):
            if peak is not None and rank < len(params):
                bases.append(peak - state * params[rank] - activations[rank])
    return max(0.0, median_or(bases))


def point_split(point: SweepPoint, facts: BlockFacts) -> tuple[tuple[int, ...], ...]:
    """The blocks of every stage of a point, split as the runner splits them (by the facts' balance weights:
    compute-bearing parameters, or the block times a sweep balanced by)."""
    weights = facts.balance_weights
    return _split(facts.num_blocks, point.num_ranks * point.stages_per_rank,
                  None if weights is None else tuple(weights))


def rank_parameters(split: Sequence[Sequence[int]], owners: Sequence[int], facts: BlockFacts) -> list[int]:
    params = [0] * (max(owners) + 1)
    for stage, blocks in enumerate(split):
        params[owners[stage]] += sum(facts.parameters[b] for b in blocks)
    return params
