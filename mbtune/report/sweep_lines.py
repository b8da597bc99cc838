"""The lines a sweep's table is followed by: how decided the answer is, and the points' warnings by cause."""

from __future__ import annotations

from mbtune.report import fmt_rate
from mbtune.sweeping.records import SweepReport

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
    """How decided the answer is, in one line: `decided`, `equivalent` (the group and the size) or `not
    decided` (how many rows are open, and the repeats and time that would settle them)."""
    best, decision = report.best, report.decision
    if best is None or decision is None or report.objective == "memory":
        return None
    size = f"{decision.size * 100:g}%"
    ranked = {index: position for position, index in enumerate(report.ranking, 1)}
    head = f"{best.point.label} ({fmt_rate(best.samples_per_s)} samples/s)"
    if decision.state == "decided":
        return f"decided: {head} is the best; every other row is told apart from it (95% test)"
    group = ", ".join(f"#{ranked[i]} {report.results[i].point.label}" for i in decision.group)
    if decision.state == "equivalent":
        return (f"equivalent: {head} and {group}, within {size} of each other (95% equivalence test; least memory "
                "first); the rest are told apart")
    settle = ""
    if decision.more_repeats is not None and decision.more_time_s is not None:
        settle = (f"; about {decision.more_repeats} more repeat(s) each, ~{_duration(decision.more_time_s)}, would "
                  f"settle them (--time-budget)")
    why = f"; stopped: {decision.why}" if decision.why else ""
    also = f"; {group} shown within {size}" if group else ""
    return (f"not decided: best so far {head}, {len(decision.open)} row(s) neither told apart from it nor "
            f"shown within {size}{also}{settle}{why}")


def _duration(seconds: float) -> str:
    """A wait in the unit that reads best: seconds, minutes or hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 2 * 3600 else f"{seconds / 3600:.1f} h"
