"""Qualification verdicts for people (rich), machines (JSON) and CI systems (JUnit XML); profile comparisons."""

from __future__ import annotations

import os
import socket
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from mbtune.errors import ProfileError
from mbtune.records import CHECK_ERROR, FAIL, PASS, ComparisonRow, Verdict
from mbtune.report import fmt_rate, print_json

_STYLE = {PASS: "green", FAIL: "bold red", CHECK_ERROR: "bold magenta"}


def _number(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if float(value).is_integer() else fmt_rate(value)


def verdict_table(verdict: Verdict) -> Table:
    """One row per check, then the overall verdict in the caption."""
    device = f"{verdict.device.backend}: {verdict.device.name}" if verdict.device else "no device"
    table = Table(title=f"Qualification on {device}", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("check", "status", "measured", "rule", "detail"):
        table.add_column(name, justify="right" if name == "measured" else "left")
    for check in verdict.checks:
        measured = "" if check.measured is None else _number(check.measured)
        table.add_row(check.name, f"[{_STYLE[check.status]}]{check.status}[/]", measured, check.rule, check.detail)
    counts = {s: sum(c.status == s for c in verdict.checks) for s in (PASS, FAIL, CHECK_ERROR)}
    baseline = f" against {verdict.baseline} (tolerance {verdict.tolerance:.0%})" if verdict.baseline else ""
    table.caption = (f"verdict: [{_STYLE[verdict.status]}]{verdict.status}[/]{baseline}; {counts[PASS]} passed, "
                     f"{counts[FAIL]} failed, {counts[CHECK_ERROR]} errors")
    return table


def print_verdict(console: Console, verdict: Verdict, fmt: str) -> None:
    if fmt == "json":
        print_json({"status": verdict.status, **verdict.to_dict()})
    else:
        console.print(verdict_table(verdict))


def junit_xml(verdict: Verdict) -> str:
    """JUnit XML: one testcase per check; a missed threshold is a failure, a crash or timeout an error."""
    device = verdict.device.name if verdict.device else "unknown device"
    failures = sum(c.status == FAIL for c in verdict.checks)
    errors = sum(c.status == CHECK_ERROR for c in verdict.checks)
    attrs = {"name": "mbtune qualify", "tests": str(len(verdict.checks)), "failures": str(failures),
             "errors": str(errors)}
    suites = ET.Element("testsuites", attrs)
    suite = ET.SubElement(suites, "testsuite", {**attrs, "name": f"mbtune qualify on {device}",
                                                "hostname": socket.gethostname()})
    properties = ET.SubElement(suite, "properties")
    for name, value in (("baseline", verdict.baseline or ""), ("baseline_device", verdict.baseline_device or ""),
                        ("tolerance", f"{verdict.tolerance:g}")):
        ET.SubElement(properties, "property", {"name": name, "value": value})
    for check in verdict.checks:
        case = ET.SubElement(suite, "testcase", {"classname": f"mbtune.qualify.{device}", "name": check.name,
                                                 "time": "0"})
        message = f"measured {_number(check.measured)}, expected {check.rule}".strip()
        if check.status == FAIL:
            ET.SubElement(case, "failure", {"message": message, "type": "threshold"}).text = check.detail or message
        elif check.status == CHECK_ERROR:
            ET.SubElement(case, "error", {"message": check.detail or message, "type": "run"}).text = check.detail
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def write_junit(verdict: Verdict, path: Path) -> Path:
    """Write the JUnit file atomically."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as handle:
            handle.write(junit_xml(verdict))
        os.replace(tmp, path)
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
