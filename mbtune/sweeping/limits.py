"""The limits a probe sets on a sweep (safe batch, ceiling, peak memory at the ceiling)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TypedDict

from mbtune.probing.records import ProbeResult
from mbtune.sweeping.config import SweepConfig


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


def limits_from_profile(path: str, config: SweepConfig) -> SweepLimits:
    """sweep_limits of the probe saved in a profile: an error when it holds no probe, or a probe of another
    workload, other workload options or another precision than this sweep's."""
    from mbtune.errors import ProfileError
    from mbtune.profiles import load_profile

    probe = load_profile(path).probe
    if probe is None:
        raise ProfileError(f"profile {path} holds no probe", hint="Run mbtune probe first, or use mbtune tune.")
    ours = (config.workload, dict(config.workload_options), config.precision)
    theirs = (probe.workload, dict(probe.workload_options), probe.precision)
    for what, mine, saved in zip(("workload", "workload options", "precision"), ours, theirs):
        if mine != saved:
            raise ProfileError(f"--from-profile {path} probed {what} {saved!r}, this sweep runs {mine!r}",
                               hint="Give the profile of the same workload, options and precision.")
    return sweep_limits(probe)


def with_saved_limits(config: SweepConfig, *, from_profile: str | Path | None = None,
                      profiles_dir: str | Path | None = None) -> SweepConfig:
    """The sweep's config bounded by a saved probe, read here, where the command line or the Python API
    names the file (the sweep itself reads no file): `from_profile`'s probe; else, without a safe batch,
    this device's saved probe of the same workload and options under `profiles_dir`, if there is one.
    A wrong `from_profile` is bad input; a damaged saved profile is skipped with a warning."""
    from mbtune.device import resolve_device
    from mbtune.device.describe import describe
    from mbtune.errors import ProfileError
    from mbtune.profiles import load_profile, profile_path

    if from_profile is not None:
        return replace(config, **limits_from_profile(str(from_profile), config))
    if config.safe_batch is not None or profiles_dir is None:
        return config
    path = profile_path(profiles_dir, describe(resolve_device(config.device)), config.workload)
    if not path.exists():
        return config
    try:
        probe = load_profile(path).probe
    except ProfileError as exc:
        return replace(config, extra_warnings=(*config.extra_warnings, f"ignored the saved probe: {exc.one_line()}"))
    if probe is None or dict(config.workload_options) != probe.workload_options:
        return config
    note = f"micro-batch sizes are bounded by the safe batch {probe.safe_batch} probed in {path}"
    return replace(config, **sweep_limits(probe), extra_warnings=(*config.extra_warnings, note))
