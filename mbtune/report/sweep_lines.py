"""The lines a sweep's table is followed by: how decided the answer is, and the points' warnings by cause."""

from __future__ import annotations

from mbtune.report import fmt_rate
from mbtune.sweeping.records import PointResult, SweepReport

# A point's warnings by cause (their first words, as sweeping/measured.py and device/machine_load.py word
# them): the table summarises each cause in one line; `show --warnings` and --format json give them all.
_CAUSES = {"the machine was busy": "measured while the machine was busy (other processes took its CPUs or GPU)",
           "step time varies": "measured with step times varying over the stability threshold",
           "throughput varies": "whose throughput varied across repeats over the stability threshold"}


def point_warnings(report: SweepReport, *, every: bool = False) -> list[str]:
    """The points' warnings: each one with its point's label (every), or one line per cause with how many
    points it touched (a cause that touched one point keeps its own words)."""
    lines = [(r.point.label, w) for r in report.results for w in r.warnings]
    if every:
        return [f"{label}: {warning}" for label, warning in lines]
    by_cause: dict[str, list[tuple[str, str]]] = {}
    for label, warning in lines:
        cause = next((c for c in _CAUSES if warning.startswith(c)), warning)
        by_cause.setdefault(cause, []).append((label, warning))
    summary = []
    for cause, found in by_cause.items():
        if len(found) == 1 or cause not in _CAUSES:
            summary += [f"{label}: {warning}" for label, warning in found]
        else:
            summary.append(f"{len({label for label, _ in found})} points {_CAUSES[cause]}: their figures are less "
                           "certain (mbtune show --warnings lists them)")
    return summary


def decision_line(report: SweepReport) -> str | None:
    """How decided the answer is: the best alone, or the rows still tied with it, with their intervals."""
    best = report.best
    if best is None or report.objective == "memory":
        return None

    def figure(result: PointResult) -> str:
        spread = f" ±{result.ci_half_pct:.1f}%" if result.ci_half_pct is not None else ""
        return f"{result.point.label} ({fmt_rate(result.samples_per_s)}{spread} samples/s)"

    if not report.ties:
        return f"decided: {figure(best)} is the best; no other row is tied with it"
    ranked = {index: position for position, index in enumerate(report.ranking, 1)}
    tied = "; ".join(f"#{ranked[i]} {figure(report.results[i])}" for i in report.ties)
    return (f"not decided: {len(report.ties)} row(s) tied with the best, #1 {figure(best)}: {tied} "
            "(more time, --time-budget, would separate them or show they are alike)")
