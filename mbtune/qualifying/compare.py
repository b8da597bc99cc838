"""Two saved profiles side by side, refused where they differ in device model or workload unless allowed."""

from __future__ import annotations

from pathlib import Path

from mbtune.errors import (
    ConfigError,
)
from mbtune.qualifying.records import ComparisonRow
from mbtune.saving.profiles import Profile


def compare_files(a: Path, b: Path, *, allow_different_device: bool = False,
                  allow_different_workload: bool = False) -> tuple[ComparisonRow, ...]:
    """Two saved profiles side by side (ratios B / A), refused where they differ in device model, or in
    workload, options, precision or optimizer, unless allowed."""
    from mbtune.saving.profiles import load_profile

    first, second = load_profile(a), load_profile(b)
    check_same_device(device_model(first), device_model(second), allow=allow_different_device, what="the profiles")
    check_same_workload(first, second, allow=allow_different_workload)
    return compare_profiles(first, second)


def device_model(profile: Profile) -> str | None:
    """The device a profile was measured on, as '<backend>: <name>'."""
    section = profile.probe or profile.sweep
    return f"{section.device.backend}: {section.device.name}" if section else None


def check_same_device(a: str | None, b: str | None, *, allow: bool, what: str) -> None:
    """Refuse to compare measurements from different device models unless allowed."""
    if a and b and a != b and not allow:
        raise ConfigError(f"{what} were measured on different devices ({a} vs {b})",
                          hint="Pass --allow-different-device to compare them anyway.")


def check_same_workload(a: Profile, b: Profile, *, allow: bool) -> None:
    """Refuse to compare profiles of different workloads, workload options, precisions or optimizers (their
    ratios would mean nothing) unless allowed."""
    def setup(profile: Profile) -> tuple:
        run = profile.probe or profile.sweep
        if run is None:
            return ()
        precision = getattr(run, "precision", None)
        optimizer = getattr(run, "optimizer", None)
        return (run.workload, dict(run.workload_options), precision, optimizer)

    names = ("workload", "workload options", "precision", "optimizer")
    for name, x, y in zip(names, setup(a), setup(b)):
        if x is not None and y is not None and x != y and not allow:
            raise ConfigError(f"the profiles measured different {name}s ({x!r} vs {y!r})",
                              hint="Pass --allow-different-workload to compare them anyway.")


def compare_profiles(a: Profile, b: Profile) -> tuple[ComparisonRow, ...]:
    """The probe figures, the best throughput and every sweep point the two profiles share."""
    rows = []
    for name, attr in (("ceiling", "ceiling"), ("safe batch", "safe_batch")):
        rows.append(ComparisonRow(quantity=name, a=getattr(a.probe, attr, None) if a.probe else None,
                                  b=getattr(b.probe, attr, None) if b.probe else None))
    best_a = a.sweep.best if a.sweep else None
    best_b = b.sweep.best if b.sweep else None
    rows.append(ComparisonRow(quantity="best throughput (samples/s)", a=best_a.samples_per_s if best_a else None,
                              b=best_b.samples_per_s if best_b else None))
    points_b = {r.point: r for r in b.sweep.results} if b.sweep else {}
    for result in a.sweep.results if a.sweep else ():
        other = points_b.get(result.point)
        if other is not None:
            rows.append(ComparisonRow(quantity=f"samples/s {result.point.label}", a=result.samples_per_s,
                                      b=other.samples_per_s))
    return tuple(rows)
