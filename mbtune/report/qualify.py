"""Qualification verdicts for people (rich), machines (JSON) and CI systems (JUnit XML); profile comparisons."""

from __future__ import annotations

import re
import socket
import xml.etree.ElementTree as ET
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from mbtune.atomic import write_atomic
from mbtune.errors import ProfileError
from mbtune.qualifying.records import CHECK_ERROR, FAIL, INCONCLUSIVE, PASS, Check, ComparisonRow, Verdict
from mbtune.report import fmt_rate, print_json

_STYLE = {PASS: "green", FAIL: "bold red", CHECK_ERROR: "bold magenta", INCONCLUSIVE: "bold yellow"}
PER_POINT_TITLE = "per point (shown, not gating)"


def _number(value: float | None) -> str:
    if value is None:
        return "n/a"
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.3f}" if abs(value) < 10 else fmt_rate(value)


def _spread(check: Check) -> str:
    return "n/a" if check.spread_pct is None else f"{check.spread_pct:.1f}%"


def _checks_table(checks: list[Check], title: str) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("check", "status", "measured", "expected", "spread", "detail"):
        table.add_column(name, justify="right" if name in ("measured", "spread") else "left")
    for check in checks:
        measured = "" if check.measured is None else _number(check.measured)
        table.add_row(check.name, f"[{_STYLE[check.status]}]{check.status}[/]", measured, check.rule,
                      _spread(check), check.detail)
    return table


def verdict_table(verdict: Verdict) -> Table:
    """One row per gating check, then the overall verdict in the caption."""
    device = f"{verdict.device.backend}: {verdict.device.name}" if verdict.device else "no device"
    gating = [c for c in verdict.checks if c.gating]
    table = _checks_table(gating, f"Qualification on {device}")
    counts = {s: sum(c.status == s for c in gating) for s in (PASS, FAIL, INCONCLUSIVE, CHECK_ERROR)}
    baseline = f" against {verdict.baseline} (tolerance {verdict.tolerance:.0%})" if verdict.baseline else ""
    repeats = f", {verdict.repeats} repeats per point" if verdict.repeats else ""
    table.caption = (f"verdict: [{_STYLE[verdict.status]}]{verdict.status}[/]{baseline}{repeats}; "
                     f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[INCONCLUSIVE]} inconclusive, "
                     f"{counts[CHECK_ERROR]} errors")
    if verdict.until_decided_s is not None:
        decided = "decided" if verdict.status != INCONCLUSIVE else "still INCONCLUSIVE, --max-time left no room for another"
        table.caption += f"\n{verdict.rounds} round(s) measured, each twice as precise as the last: {decided}"
    if verdict.history:
        table.caption += f"\nrun {verdict.run} of the history {verdict.history}"
        table.caption += "".join(f"\n{change.words}" for change in verdict.changes) if verdict.changes else \
            "; no step found in it"
    return table


def per_point_table(verdict: Verdict) -> Table | None:
    """The checks that are shown but do not decide the verdict (each sweep point on its own), or None."""
    rows = [c for c in verdict.checks if not c.gating]
    return _checks_table(rows, PER_POINT_TITLE) if rows else None


def print_verdict(console: Console, verdict: Verdict, fmt: str) -> None:
    """The verdict as JSON (every check, gating or not), or as the per-point table then the verdict table."""
    if fmt == "json":
        print_json({"status": verdict.status, **verdict.to_dict()})
        return
    points = per_point_table(verdict)
    if points is not None:
        console.print(points)
    console.print(verdict_table(verdict))


# Characters XML 1.0 cannot hold (every C0 control but tab, newline and carriage return), and terminal
# escape sequences (a workload's coloured error text) whose ESC is one of them.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]")
_NOT_XML = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def xml_text(text: str) -> str:
    """Text an XML 1.0 file can hold: terminal escapes dropped, other control characters removed."""
    return _NOT_XML.sub("", _ANSI.sub("", text))


def junit_xml(verdict: Verdict) -> str:
    """JUnit XML, as Jenkins' xUnit (junit-10.xsd) and GitLab read it: one testcase per check. A gating FAIL
    is a <failure>, an ERROR an <error>, an INCONCLUSIVE check <skipped> with the figures in its message and
    its text; a check that does not gate is never a failure: when it did not pass, it is <skipped> with its
    status, so the counts agree with the exit code. Classnames are fixed words (a tool splits them at their
    last dot: the device's name, free text, is a property); times are the seconds what each check judged
    took to measure."""
    device = verdict.device.name if verdict.device else "unknown device"
    failures = sum(c.status == FAIL and c.gating for c in verdict.checks)
    errors = sum(c.status == CHECK_ERROR and c.gating for c in verdict.checks)
    skipped = sum(c.status != PASS and not (c.gating and c.status in (FAIL, CHECK_ERROR)) for c in verdict.checks)
    total = f"{verdict.wall_s:.3f}"
    counts = {"tests": str(len(verdict.checks)), "failures": str(failures), "errors": str(errors)}
    suites = ET.Element("testsuites", {"name": "mbtune qualify", **counts, "time": total})
    suite = ET.SubElement(suites, "testsuite", {
        "name": xml_text(f"mbtune qualify on {device}"), **counts, "skipped": str(skipped), "time": total,
        "timestamp": verdict.started_at, "hostname": xml_text(socket.gethostname())})
    properties = ET.SubElement(suite, "properties")
    for name, value in (("device", device), ("baseline", verdict.baseline or ""),
                        ("baseline_device", verdict.baseline_device or ""), ("tolerance", f"{verdict.tolerance:g}"),
                        ("repeats", str(verdict.repeats or "until known")), ("verdict", verdict.status),
                        ("history", verdict.history or ""), ("run", str(verdict.run or "")),
                        ("rounds", str(verdict.rounds)),
                        *((f"change: {c.check}", c.words) for c in verdict.changes)):
        ET.SubElement(properties, "property", {"name": name, "value": xml_text(value)})
    times = _check_times(verdict)
    for check in verdict.checks:
        _testcase(suite, check, times.get(check.name, 0.0))
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def _check_times(verdict: Verdict) -> dict[str, float]:
    """Seconds each check's measurement took: a point's own runs, the probe's trials, every point for the
    checks over the whole sweep."""
    from mbtune.qualifying.judge import AGGREGATE, BEST

    times: dict[str, float] = {}
    if verdict.probe is not None:
        probe_s = sum(t.wall_s for t in verdict.probe.trials)
        times.update({"ceiling": probe_s, "safe batch": probe_s, "probe ran": probe_s})
    if verdict.sweep is not None:
        sweep_s = sum(r.wall_s for r in verdict.sweep.results)
        times.update({AGGREGATE: sweep_s, BEST: sweep_s})
        for result in verdict.sweep.results:
            times[f"throughput {result.point.label}"] = result.wall_s
            times[f"ran {result.point.label}"] = result.wall_s
    return times


def _testcase(suite: ET.Element, check: Check, time_s: float) -> None:
    kind = "gating" if check.gating else "per_point"
    case = ET.SubElement(suite, "testcase", {"classname": f"mbtune.qualify.{kind}", "name": xml_text(check.name),
                                             "time": f"{time_s:.3f}"})
    spread = f", spread {check.spread_pct:.1f}%" if check.spread_pct is not None else ""
    message = xml_text(f"measured {_number(check.measured)}, expected {check.rule}{spread}".strip())
    detail = xml_text(check.detail)
    text = f"{message}: {detail}" if detail else message
    if check.status == PASS:
        return
    if not check.gating:
        reason = f"not gating: {check.status}: {text}"
        ET.SubElement(case, "skipped", {"message": reason}).text = reason
    elif check.status == FAIL:
        ET.SubElement(case, "failure", {"message": message, "type": "threshold"}).text = detail or message
    elif check.status == CHECK_ERROR:
        ET.SubElement(case, "error", {"message": detail or message, "type": "run"}).text = detail
    else:
        reason = f"{INCONCLUSIVE}: {text}"
        ET.SubElement(case, "skipped", {"message": reason}).text = reason


def write_junit(verdict: Verdict, path: Path) -> Path:
    """Write the JUnit file atomically."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, junit_xml(verdict))
    except OSError as exc:
        raise ProfileError(f"cannot write the JUnit file {path}: {exc.strerror or exc}",
                           hint="Choose a writable path for --junit.") from exc
    return path


def comparison_table(rows: tuple[ComparisonRow, ...], a: str, b: str) -> Table:
    table = Table(title="Profiles side by side", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("quantity", "A", "B", "B / A"):
        table.add_column(name, justify="left" if name == "quantity" else "right")
    for row in rows:
        ratio = row.ratio
        style = "" if ratio is None else "green" if ratio >= 1 else "red"
        table.add_row(row.quantity, _number(row.a), _number(row.b),
                      "n/a" if ratio is None else f"[{style}]{ratio:.3f}[/]")
    table.caption = f"A = {a}\nB = {b}"
    return table


def print_comparison(console: Console, rows: tuple[ComparisonRow, ...], a: str, b: str, fmt: str) -> None:
    if fmt == "json":
        print_json({"a": a, "b": b, "rows": [{**r.to_dict(), "ratio": r.ratio} for r in rows]})
    else:
        console.print(comparison_table(rows, a, b))
