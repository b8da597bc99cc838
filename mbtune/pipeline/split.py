"""Balanced contiguous split of a workload's blocks over pipeline stages. Pure: no torch."""

from __future__ import annotations

import math
from collections.abc import Sequence

from mbtune.errors import ConfigError

StageBlocks = tuple[tuple[int, ...], ...]


def split_blocks(num_blocks: int, num_model_stages: int, weights: Sequence[float] | None = None) -> StageBlocks:
    """Split blocks 0..num_blocks-1 into `num_model_stages` contiguous, non-empty runs.

    Without weights, run lengths differ by at most one (stage i starts at floor(i*N/S)). With weights (for
    example per-block parameter counts), the heaviest stage is as light as possible and, among such splits,
    the stage weights are as even as possible (least sum of squares).
    """
    _check_counts(num_blocks, num_model_stages)
    if weights is not None:
        if len(weights) != num_blocks:
            raise ValueError(f"got {len(weights)} block weights for {num_blocks} blocks")
        if any(not math.isfinite(w) or w < 0 for w in weights):
            raise ValueError("block weights must be finite and non-negative")
    if weights is None or not any(weights):
        bounds = [i * num_blocks // num_model_stages for i in range(num_model_stages + 1)]
    else:
        bounds = _weighted_bounds([float(w) for w in weights], num_model_stages)
    return tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(num_model_stages))


def _check_counts(num_blocks: int, num_model_stages: int) -> None:
    if num_model_stages < 1:
        raise ConfigError(f"num_model_stages={num_model_stages} is out of range: expected an integer >= 1",
                          hint="Fix --stages.")
    if num_model_stages > num_blocks:
        raise ConfigError(
            f"cannot split {num_blocks} blocks over {num_model_stages} stages: every stage needs at least one block",
            hint=f"Use at most {num_blocks} stages, or a workload with more layers (for example --option layers=N).",
        )


def _weighted_bounds(weights: list[float], num_model_stages: int) -> list[int]:
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    limit = _min_bottleneck(weights, prefix, num_model_stages)
    return _least_squares_bounds(prefix, num_model_stages, limit)


def _min_bottleneck(weights: list[float], prefix: list[float], num_model_stages: int) -> float:
    """The smallest achievable heaviest-stage weight: binary search over the contiguous sums."""
    n = len(weights)
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    low, high = 0, len(candidates) - 1
    while low < high:
        mid = (low + high) // 2
        if _stages_needed(weights, candidates[mid]) <= num_model_stages:
            high = mid
        else:
            low = mid + 1
    return candidates[low]


def _stages_needed(weights: list[float], limit: float) -> int:
    """Fewest contiguous runs with weight <= limit (infinite when one block alone is heavier)."""
    count, load = 1, 0.0
    for w in weights:
        if w > limit:
            return 1 << 30
        if load + w > limit:
            count, load = count + 1, 0.0
        load += w
    return count


def _least_squares_bounds(prefix: list[float], num_model_stages: int, limit: float) -> list[int]:
    """Exact DP: the split under `limit` with the least sum of squared stage weights."""
    n = len(prefix) - 1
    tolerance = 1e-9 * max(1.0, limit)
    inf = float("inf")
    # cost[s][j]: best cost of the first j blocks in s stages; choice[s][j]: where stage s starts.
    cost = [[inf] * (n + 1) for _ in range(num_model_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_model_stages + 1)]
    cost[0][0] = 0.0
    for s in range(1, num_model_stages + 1):
        for j in range(s, n - (num_model_stages - s) + 1):
            for i in range(j - 1, s - 2, -1):
                load = prefix[j] - prefix[i]
                if load > limit + tolerance:
                    break  # loads only grow as the stage reaches further back
                if cost[s - 1][i] == inf:
                    continue
                total = cost[s - 1][i] + load * load
                if total < cost[s][j]:
                    cost[s][j], choice[s][j] = total, i
    bounds = [n]
    for s in range(num_model_stages, 0, -1):
        bounds.append(choice[s][bounds[-1]])
    return bounds[::-1]
