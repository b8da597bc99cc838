"""Qualification checks: pure comparisons of what was measured now against a baseline and thresholds.

Each check is PASS or FAIL; a quantity that could not be measured (a crash, a timeout) is an ERROR.
"""

from __future__ import annotations

from collections.abc import Mapping

from mbtune.errors import ConfigError
from mbtune.records import (
    CHECK_ERROR,
    FAIL,
    OK,
    OOM,
    PASS,
    Check,
    ComparisonRow,
    ProbeResult,
    Profile,
    SweepReport,
)

# Threshold keys of a qualification spec and the quantity each bounds.
MINIMUMS = {"min_ceiling": "ceiling", "min_safe_batch": "safe batch", "min_best_samples_per_s": "best throughput"}
MAXIMUMS = {"max_best_bubble": "best point's measured bubble"}


def at_least(name: str, measured: float | None, bound: float, rule: str) -> Check:
    if measured is None:
        return Check(name=name, status=CHECK_ERROR, expected=bound, rule=rule, detail="not measured")
    return Check(name=name, status=PASS if measured >= bound else FAIL, measured=measured, expected=bound, rule=rule)


def at_most(name: str, measured: float | None, bound: float, rule: str) -> Check:
    if measured is None:
        return Check(name=name, status=CHECK_ERROR, expected=bound, rule=rule, detail="not measured")
    return Check(name=name, status=PASS if measured <= bound else FAIL, measured=measured, expected=bound, rule=rule)


def against_baseline(baseline_probe: ProbeResult | None, baseline_sweep: SweepReport | None,
                     probe: ProbeResult | None, sweep: SweepReport | None, *, tolerance: float) -> list[Check]:
    """Ceiling, safe batch, best throughput and every point both ran, each within tolerance of the baseline."""
    keep = 1.0 - tolerance
    rule = f">= {keep:.0%} of baseline"
    checks = []
    if baseline_probe is not None:
        for name, attr in (("ceiling", "ceiling"), ("safe batch", "safe_batch")):
            was = getattr(baseline_probe, attr)
            now = getattr(probe, attr) if probe else None
            checks.append(at_least(name, now, was * keep, f"{rule} {was}"))
    if baseline_sweep is not None and baseline_sweep.best is not None:
        was = baseline_sweep.best.samples_per_s
        now = sweep.best.samples_per_s if sweep and sweep.best else None
        checks.append(at_least("best throughput (samples/s)", now, was * keep, f"{rule} {was:,.1f}"))
        checks += _points(baseline_sweep, sweep, keep, rule)
    return checks


def _points(baseline: SweepReport, sweep: SweepReport | None, keep: float, rule: str) -> list[Check]:
    """Every point the baseline ran: within tolerance now. A point skipped here (the safe batch shrank)
    or out of memory fails; one that crashed is an ERROR, reported once by run_errors."""
    now = {r.point: r for r in sweep.results} if sweep else {}
    skipped = {s.point: s.reason for s in sweep.skipped} if sweep else {}
    checks = []
    for before in baseline.results:
        after = now.get(before.point)
        if not before.ok or (after is not None and after.status not in (OK, OOM)):
            continue
        name, bound = f"throughput {before.point.label}", before.samples_per_s * keep
        point_rule = f"{rule} {before.samples_per_s:,.1f}"
        if after is None:
            why = skipped.get(before.point, "not in this run")
            checks.append(Check(name=name, status=FAIL, expected=bound, rule=point_rule, detail=f"not run: {why}"))
        else:
            checks.append(at_least(name, after.samples_per_s if after.ok else 0.0, bound, point_rule))
    return checks


def against_thresholds(thresholds: Mapping[str, float], probe: ProbeResult | None,
                       sweep: SweepReport | None) -> list[Check]:
    """Absolute bounds from a qualification spec."""
    best = sweep.best if sweep else None
    measured = {
        "min_ceiling": probe.ceiling if probe else None,
        "min_safe_batch": probe.safe_batch if probe else None,
        "min_best_samples_per_s": best.samples_per_s if best else None,
        "max_best_bubble": best.bubble_measured if best else None,
    }
    checks = []
    for key, bound in thresholds.items():
        if key in MINIMUMS:
            checks.append(at_least(MINIMUMS[key], measured[key], bound, f">= minimum {bound:g}"))
        else:
            checks.append(at_most(MAXIMUMS[key], measured[key], bound, f"<= maximum {bound:g}"))
    return checks


def run_errors(probe_error: str | None, sweep: SweepReport | None) -> list[Check]:
    """Whether the runs themselves completed: the probe, and every sweep point (a crash, hang or kill is
    an ERROR; running out of memory is a measurement and is judged by the other checks)."""
    if probe_error is not None:
        return [Check(name="probe ran", status=CHECK_ERROR, detail=probe_error)]
    checks = [Check(name="probe ran", status=PASS)]
    for result in sweep.results if sweep else ():
        if result.status not in (OK, OOM):
            checks.append(Check(name=f"ran {result.point.label}", status=CHECK_ERROR,
                                detail=f"{result.status}: {result.error}"))
    return checks




def device_model(profile: Profile) -> str | None:
    """The device a profile was measured on, as '<backend>: <name>'."""
    section = profile.probe or profile.sweep
    return f"{section.device.backend}: {section.device.name}" if section else None


def check_same_device(a: str | None, b: str | None, *, allow: bool, what: str) -> None:
    """Refuse to compare measurements from different device models unless allowed."""
    if a and b and a != b and not allow:
        raise ConfigError(f"{what} were measured on different devices ({a} vs {b})",
                          hint="Pass --allow-different-device to compare them anyway.")


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
