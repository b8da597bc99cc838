"""Qualification checks: pure comparisons of what was measured now against a baseline and thresholds.

What decides the verdict. Against a baseline, four checks gate it: the ceiling, the safe batch, the best
throughput, and one aggregate over every sweep point both runs completed, the geometric mean of the
per-point ratios now / baseline. Each sweep point is also checked on its own, but those rows are shown
and kept with `gating=False`: with many points, some miss the tolerance by chance alone, so one noisy
point cannot fail the job. Whether the runs themselves completed (`probe ran`, `ran <point>`) and the
spec's absolute thresholds also gate.

Best throughput compares the fastest point now with the fastest point of the baseline (its median over
the repeats). The baseline's best is the maximum of many noisy points, so it sits above that point's
typical throughput; the same point re-run now would be judged against that lucky draw and look slower
by the noise alone. The fastest point now is a maximum too, over the same points, so both sides carry
the same kind of selection. The detail names both points and what the baseline's best point gives now.

Uncertainty: every check carries the spread of what it compares (qualifying/spreads.py).

Decision, with r = measured / bound (bound / measured for an upper bound) and s the spread:

- FAIL when r x (1 + s) < 1: the shortfall is larger than the spread, so noise cannot explain it;
- PASS when r >= 1 and s <= the tolerance, or when r x (1 - s) >= 1 (it clears even the low end);
- INCONCLUSIVE otherwise: the spread is wider than the tolerance and reaches across the bound, or the
  measurement is short by less than its own spread. The detail names the figures.

Load. When the machine was busy with other work while a throughput was measured (the point's
`load.busy`: other processes took over a quarter of the CPUs, or shared its GPU; for the aggregate, more
than half of its points), that load could explain a slowdown down to 1 - (the other processes' share of
the CPUs), or any slowdown when they shared a GPU. A shortfall is then FAIL only when r x (1 + s) is
below that too; otherwise it is INCONCLUSIVE, and the detail says what the load was.

An unknown spread counts as 0 and the detail says so. Absolute thresholds have no tolerance (0). A
quantity that could not be measured (a crash, a timeout) is an ERROR.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from mbtune.errors import EXIT_CHECK_FAILED, EXIT_COULD_NOT_RUN, EXIT_INCONCLUSIVE, EXIT_OK
from mbtune.probing.records import ProbeResult
from mbtune.qualifying.records import CHECK_ERROR, FAIL, INCONCLUSIVE, PASS, Check
from mbtune.qualifying.spreads import (
    Spread,
    bubble_spread,
    point_spread,
    pool_ratios,
    probe_spread,
    ratio_spread,
    wider,
)
from mbtune.records import OK, OOM
from mbtune.serving.records import ServeReport
from mbtune.sweeping.records import PointResult, SweepReport

AGGREGATE = "throughput, all common points (geometric mean of now/baseline ratios)"
BEST = "best throughput (samples/s)"

# Threshold keys of a qualification spec and the quantity each bounds.
MINIMUMS = {"min_ceiling": "ceiling", "min_safe_batch": "safe batch", "min_best_samples_per_s": "best throughput"}
MAXIMUMS = {"max_best_bubble": "best point's measured bubble"}


@dataclass(frozen=True)
class Busy:
    """How busy the machine was with other work while a quantity was measured."""

    reason: str
    other_share: float  # the largest share of the CPUs other processes took (1.0: unknown, or a GPU shared)


def exit_code(status: str) -> int:
    """The process exit code of a verdict: 0 PASS, 1 FAIL, 3 ERROR, 4 INCONCLUSIVE."""
    return {PASS: EXIT_OK, FAIL: EXIT_CHECK_FAILED, CHECK_ERROR: EXIT_COULD_NOT_RUN,
            INCONCLUSIVE: EXIT_INCONCLUSIVE}[status]


def judge(name: str, measured: float | None, bound: float, *, rule: str, spread: Spread | None = None,
          tolerance: float = 0.0, upper: bool = False, gating: bool = True, note: str = "",
          busy: Busy | None = None) -> Check:
    """One check of a measurement against a bound (a minimum, or a maximum when upper), decided against
    the measurement's own spread as the module docstring says; busy: how busy the machine was while it
    was measured (a shortfall the load could explain is INCONCLUSIVE, not FAIL)."""
    if measured is None:
        return Check(name=name, status=CHECK_ERROR, expected=bound, rule=rule, detail="not measured",
                     gating=gating)
    if upper:
        ratio = math.inf if measured <= 0 else bound / measured
    else:
        ratio = math.inf if bound <= 0 else measured / bound
    share = spread.share if spread else 0.0
    figures = f"spread {share:.0%} ({spread.basis})" if spread else "spread unknown"
    if ratio * (1 + share) < 1:
        status = FAIL
        reason = f"short by more than the {figures}" if share > tolerance else ""
    elif ratio * (1 - share) >= 1 or (ratio >= 1 and share <= tolerance):
        status = PASS
        reason = f"clears the bound by more than the {figures}" if share > tolerance else ""
    elif share > tolerance:
        status = INCONCLUSIVE
        reason = f"{figures} is wider than the {tolerance:.0%} tolerance{_decider(ratio, share, tolerance)}"
    else:
        status = INCONCLUSIVE
        reason = f"short of the bound by less than the {figures}{_decider(ratio, share, tolerance)}"
    more = more_measurements(ratio, share, tolerance) if status == INCONCLUSIVE else None
    if spread is None:
        reason = figures
    if status == FAIL and busy is not None and ratio * (1 + share) >= 1 - busy.other_share:
        status, reason = INCONCLUSIVE, f"measured while the machine was busy ({busy.reason}): the load may explain it"
        more = None
    detail = "; ".join(part for part in (note, reason) if part)
    return Check(name=name, status=status, measured=measured, expected=bound, rule=rule, detail=detail,
                 spread_pct=100.0 * spread.share if spread else None, gating=gating, more_measurements=more)


def more_measurements(ratio: float, share: float, tolerance: float) -> float | None:
    """How many times the measurements an INCONCLUSIVE figure needs for its spread to decide it (an interval
    narrows as one over the square root of them); None where it sits at the bound."""
    needed = max(tolerance, 1 - 1 / ratio) if ratio >= 1 else 1 / ratio - 1
    return None if needed < 0.001 else (share / needed) ** 2


def _decider(ratio: float, share: float, tolerance: float) -> str:
    """What would decide an INCONCLUSIVE check: the spread under which the same figure passes or fails, and
    how many times the measurements that takes (an interval narrows as one over the square root of them)."""
    if ratio >= 1:
        needed, verdict = max(tolerance, 1 - 1 / ratio), "pass"
    else:
        needed, verdict = 1 / ratio - 1, "fail"
    if needed < 0.001:
        return "; it sits at the bound, where no spread decides it"
    return f"; a spread under {needed:.1%} would {verdict} it (about {(share / needed) ** 2:.1f}x the measurements)"


def at_least(name: str, measured: float | None, bound: float, rule: str, spread: Spread | None = None) -> Check:
    """measured >= bound, against the measurement's spread (an absolute threshold: no tolerance)."""
    return judge(name, measured, bound, rule=rule, spread=spread)


def at_most(name: str, measured: float | None, bound: float, rule: str, spread: Spread | None = None) -> Check:
    """measured <= bound, against the measurement's spread (an absolute threshold: no tolerance)."""
    return judge(name, measured, bound, rule=rule, spread=spread, upper=True)


def busy_reason(results: list[PointResult]) -> Busy | None:
    """How busy the machine was, when it was busy while more than half of these results were measured."""
    busy = [r.load for r in results if r.load is not None and r.load.busy]
    if not busy or 2 * len(busy) <= len(results):
        return None
    shares = [1.0 if load.other_cpu_share is None or load.other_gpu_processes else load.other_cpu_share
              for load in busy]
    reason = busy[0].reason or "busy"
    if len(results) > 1:
        reason = f"{len(busy)} of {len(results)} points, e.g. {reason}"
    return Busy(reason=reason, other_share=max(shares))


def fastest(sweep: SweepReport | None) -> PointResult | None:
    """The point with the highest samples/s (whatever the sweep's objective ranked first)."""
    ok = [r for r in sweep.results if r.ok and r.samples_per_s] if sweep else []
    return max(ok, key=_rate) if ok else None


def _rate(result: PointResult) -> float:
    """The samples/s of a result already known to have one."""
    assert result.samples_per_s is not None, "only results that measured a throughput get here"
    return result.samples_per_s


def against_baseline(baseline_probe: ProbeResult | None, baseline_sweep: SweepReport | None,
                     probe: ProbeResult | None, sweep: SweepReport | None, *, tolerance: float) -> list[Check]:
    """The gating checks (ceiling, safe batch, best throughput, the aggregate over common points), then
    every point both ran, shown but not gating."""
    keep = 1.0 - tolerance
    rule = f">= {keep:.0%} of baseline"
    checks = []
    if baseline_probe is not None:
        spread = wider(probe_spread(baseline_probe, "baseline"), probe_spread(probe, "now") if probe else None)
        for name, attr in (("ceiling", "ceiling"), ("safe batch", "safe_batch")):
            was = getattr(baseline_probe, attr)
            now = getattr(probe, attr) if probe else None
            checks.append(judge(name, now, was * keep, rule=f"{rule} {was}", spread=spread, tolerance=tolerance))
    if baseline_sweep is not None and (baseline_best := fastest(baseline_sweep)) is not None:
        checks.append(_best(baseline_best, sweep, tolerance, rule))
        checks.append(_aggregate(baseline_sweep, sweep, tolerance))
        checks += _points(baseline_sweep, sweep, tolerance, rule)
    return checks


def _best(was: PointResult, sweep: SweepReport | None, tolerance: float, rule: str) -> Check:
    """The fastest point now against the fastest of the baseline, `was` (see the module docstring)."""
    now = fastest(sweep)
    keep = 1.0 - tolerance
    name, point_rule = BEST, f"{rule} {was.samples_per_s:,.1f}"
    if now is None or sweep is None:
        measured = 0.0 if sweep is not None and sweep.results else None
        return judge(name, measured, _rate(was) * keep, rule=point_rule, note="no point completed here")
    same = {r.point: r for r in sweep.results}.get(was.point)
    if now.point == was.point:
        note = f"best point {was.point.label} in both"
    else:
        note = f"baseline best {was.point.label}; now best {now.point.label}"
        if same is not None and same.ok:
            note += f" (the baseline's best point now: {same.samples_per_s:,.1f})"
    spread = ratio_spread(point_spread(was, "baseline"), point_spread(now, "now"))
    return judge(name, now.samples_per_s, _rate(was) * keep, rule=point_rule, spread=spread,
                 tolerance=tolerance, note=note, busy=busy_reason([now]))


def _aggregate(baseline: SweepReport, sweep: SweepReport | None, tolerance: float) -> Check:
    """The points' now/baseline ratios pooled into one, with its 95% interval (see the module docstring)."""
    keep = 1.0 - tolerance
    rule = f">= {keep:.2f}"
    now = {r.point: r for r in sweep.results if r.ok and r.samples_per_s} if sweep else {}
    pairs = [(was, now[was.point]) for was in baseline.results
             if was.ok and was.samples_per_s and was.point in now]
    if not pairs:
        measured = 0.0 if sweep is not None and sweep.results else None
        return judge(AGGREGATE, measured, keep, rule=rule, note="no point the baseline ran completed here")
    logs = [math.log(_rate(after) / _rate(before)) for before, after in pairs]
    pooled, spread = pool_ratios(logs, [ratio_spread(point_spread(b, "baseline"), point_spread(a, "now"))
                                        for b, a in pairs])
    missing = sum(1 for r in baseline.results if r.ok and r.samples_per_s) - len(pairs)
    note = f"{len(pairs)} points, ratios {math.exp(min(logs)):.2f}-{math.exp(max(logs)):.2f}"
    if missing:
        note += f"; {missing} baseline point(s) did not complete here (see per point)"
    return judge(AGGREGATE, math.exp(pooled), keep, rule=rule, spread=spread, tolerance=tolerance, note=note,
                 busy=busy_reason([after for _, after in pairs]))


def _points(baseline: SweepReport, sweep: SweepReport | None, tolerance: float, rule: str) -> list[Check]:
    """Every point the baseline ran, within tolerance now: shown, not gating. A point skipped here (the
    safe batch shrank) or out of memory fails; one that crashed is an ERROR, reported once by run_errors."""
    keep = 1.0 - tolerance
    now = {r.point: r for r in sweep.results} if sweep else {}
    skipped = {s.point: s.reason for s in sweep.skipped} if sweep else {}
    checks = []
    for before in baseline.results:
        after = now.get(before.point)
        if not before.ok or not before.samples_per_s or (after is not None and after.status not in (OK, OOM)):
            continue
        name, bound = f"throughput {before.point.label}", before.samples_per_s * keep
        point_rule = f"{rule} {before.samples_per_s:,.1f}"
        if after is None:
            why = skipped.get(before.point, "not in this run")
            checks.append(Check(name=name, status=FAIL, expected=bound, rule=point_rule, detail=f"not run: {why}",
                                gating=False))
        elif not after.ok:
            checks.append(judge(name, 0.0, bound, rule=point_rule, gating=False, note="out of memory here"))
        else:
            spread = ratio_spread(point_spread(before, "baseline"), point_spread(after, "now"))
            checks.append(judge(name, after.samples_per_s, bound, rule=point_rule, spread=spread,
                                tolerance=tolerance, gating=False, busy=busy_reason([after])))
    return checks


def against_thresholds(thresholds: Mapping[str, float], probe: ProbeResult | None,
                       sweep: SweepReport | None) -> list[Check]:
    """Absolute bounds from a qualification spec, each against its measurement's own spread."""
    best, top = (sweep.best if sweep else None), fastest(sweep)
    probed = probe_spread(probe, "now") if probe else None
    measured = {
        "min_ceiling": (probe.ceiling if probe else None, probed),
        "min_safe_batch": (probe.safe_batch if probe else None, probed),
        "min_best_samples_per_s": (top.samples_per_s if top else None, point_spread(top, "now") if top else None),
        "max_best_bubble": (best.bubble_measured if best else None, bubble_spread(best)),
    }
    checks = []
    for key, bound in thresholds.items():
        if key not in measured:  # a serving threshold: serve_thresholds judges it
            continue
        value, spread = measured[key]
        if key == "min_best_samples_per_s":
            checks.append(judge(MINIMUMS[key], value, bound, rule=f">= minimum {bound:g}", spread=spread,
                                busy=busy_reason([top]) if top else None))
        elif key in MINIMUMS:
            checks.append(at_least(MINIMUMS[key], value, bound, f">= minimum {bound:g}", spread))
        else:
            checks.append(at_most(MAXIMUMS[key], value, bound, f"<= maximum {bound:g}", spread))
    return checks


def serve_thresholds(thresholds: Mapping[str, float], report: ServeReport | None, error: str | None) -> list[Check]:
    """min_rate_at_p99: the best serving configuration's highest Poisson rate within the p99 budget. The
    rate is one the run measured at (it ascends through its rates), so the check has no spread of its own;
    one whose measurement was unstable is INCONCLUSIVE rather than a PASS."""
    if "min_rate_at_p99" not in thresholds:
        return []
    bound = thresholds["min_rate_at_p99"]
    name = "highest Poisson rate within the p99 budget (requests/s)"
    if error is not None:
        return [Check(name=name, status=CHECK_ERROR, expected=bound, rule=f">= minimum {bound:g}", detail=error)]
    winner = report.winner if report else None
    failed = [f"{run.config.label}: {run.error}" for run in report.runs if run.error] if report else []
    if report is not None and (report.interrupted or (winner is None and failed)):
        why = "the run was interrupted" if report.interrupted else "; ".join(failed)
        return [Check(name=name, status=CHECK_ERROR, expected=bound, rule=f">= minimum {bound:g}", detail=why)]
    if winner is None or winner.max_rate_per_s is None:
        return [Check(name=name, status=FAIL, expected=bound, rule=f">= minimum {bound:g}",
                      detail="no configuration met the budget at any rate it ran")]
    check = at_least(name, winner.max_rate_per_s, bound, f">= minimum {bound:g}")
    detail = f"{winner.config.label}, p99 {winner.p99_at_max_s * 1e3:.1f} ms" if winner.p99_at_max_s else winner.config.label
    if check.status == PASS and not winner.stable:
        return [dataclasses.replace(check, status=INCONCLUSIVE, detail=f"{detail}; the windows at that rate disagreed "
                                                                         "by more than 10% (unstable)")]
    return [dataclasses.replace(check, detail="; ".join(p for p in (detail, check.detail) if p))]


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
