"""The limits a probe sets on a sweep (safe batch, ceiling, peak memory at the ceiling)."""

from __future__ import annotations

from typing import TypedDict

from mbtune.probing.records import ProbeResult


class SweepLimits(TypedDict):
    """The SweepConfig fields a probe sets."""

    safe_batch: int | None
    ceiling: int | None
    ceiling_peak_memory_bytes: int | None
    recompute_safe_batch: int | None


def sweep_limits(probe: ProbeResult) -> SweepLimits:
    """What a sweep takes from a probe: the safe batch, the ceiling and the peak memory at the ceiling."""
    plain, full = probe.ceiling_with("none"), probe.ceiling_with("full")
    return {"safe_batch": plain.safe_batch if plain else None, "ceiling": plain.ceiling if plain else None,
            "ceiling_peak_memory_bytes": plain.peak_memory_bytes if plain else None,
            "recompute_safe_batch": full.safe_batch if full is not None else None}
