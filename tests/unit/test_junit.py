"""qualify's JUnit as CI servers read it: valid against the format's schema (tests/fixtures/junit.xsd, the
rules Jenkins xUnit validates with), read by junitparser with the verdict's counts, reasons in the text
GitLab shows, fixed classnames, real times, and no character XML cannot hold."""

from __future__ import annotations

import datetime as dt
import xml.etree.ElementTree as ET
from pathlib import Path

import junitparser
import pytest
import xmlschema

from mbtune.qualifying.judge import AGGREGATE, BEST
from mbtune.qualifying.records import CHECK_ERROR, FAIL, INCONCLUSIVE, PASS, Check, Verdict
from mbtune.records import DeviceInfo
from mbtune.report.qualify import junit_xml, write_junit

SCHEMA = xmlschema.XMLSchema(str(Path(__file__).resolve().parents[1] / "fixtures" / "junit.xsd"))
INTEL = DeviceInfo(backend="cpu", name="Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz", num_cpus=2)


def verdict(*checks: Check) -> Verdict:
    return Verdict(checks=checks, device=INTEL, baseline="base.json", tolerance=0.1, repeats=None,
                   started_at="2026-12-04T10:00:00", wall_s=61.5)


def parsed(result: Verdict) -> ET.Element:
    """The JUnit of a verdict, validated, as an element tree."""
    text = junit_xml(result)
    SCHEMA.validate(text)
    return ET.fromstring(text)


CHECKS = (
    Check(name="ceiling", status=PASS, measured=4, rule=">= 90% of baseline 4"),
    Check(name=BEST, status=INCONCLUSIVE, measured=95.0, rule=">= 90% of baseline 100.0", spread_pct=12.0,
          detail="spread 12% (now, 95% interval over 5 repeats) is wider than the 10% tolerance"),
    Check(name=AGGREGATE, status=FAIL, measured=0.7, rule=">= 0.90", spread_pct=2.0, detail="4 points"),
    Check(name="probe ran", status=CHECK_ERROR, rule="completes", detail="killed by SIGKILL"),
    Check(name="throughput gpipe p=2 m=2 accum=1 mbs=4", status=FAIL, measured=50.0, rule=">= 90%", gating=False),
)


def test_the_file_is_valid_junit_and_junitparser_reads_the_verdicts_counts(tmp_path):
    path = write_junit(verdict(*CHECKS), tmp_path / "q.xml")
    SCHEMA.validate(str(path))  # raises on the first rule broken
    xml = junitparser.JUnitXml.fromfile(str(path))
    [suite] = list(xml)
    assert (suite.tests, suite.failures, suite.errors, suite.skipped) == (5, 1, 1, 2)
    results = {case.name: [type(r).__name__ for r in case.result] for case in suite}
    assert results == {"ceiling": [], BEST: ["Skipped"], AGGREGATE: ["Failure"], "probe ran": ["Error"],
                       "throughput gpipe p=2 m=2 accum=1 mbs=4": ["Skipped"]}


def test_an_inconclusive_checks_reason_is_in_the_text_as_well_as_the_message():
    root = parsed(verdict(*CHECKS))
    [skipped] = [c.find("skipped") for c in root.iter("testcase") if c.get("name") == BEST]
    assert skipped.text == skipped.get("message")
    assert skipped.text.startswith("INCONCLUSIVE: measured 95, expected >= 90% of baseline 100.0, spread 12.0%")
    assert "wider than the 10% tolerance" in skipped.text


def test_classnames_are_fixed_words_and_the_device_is_a_property():
    root = parsed(verdict(*CHECKS))
    assert {c.get("classname") for c in root.iter("testcase")} == {"mbtune.qualify.gating", "mbtune.qualify.per_point"}
    properties = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert properties["device"] == INTEL.name and properties["repeats"] == "until known"


def test_times_and_the_timestamp_are_real():
    root = parsed(verdict(*CHECKS))
    suite = root.find("testsuite")
    assert float(suite.get("time")) == pytest.approx(61.5) and float(root.get("time")) == pytest.approx(61.5)
    assert dt.datetime.fromisoformat(suite.get("timestamp")) == dt.datetime(2026, 12, 4, 10, 0, 0)


def test_control_characters_and_terminal_escapes_never_reach_the_file(tmp_path):
    coloured = Check(name="probe ran", status=CHECK_ERROR, rule="completes",
                     detail="\x1b[31mRuntimeError\x1b[0m: bad\x00 byte\x07 in \x1b]0;title\x07 a workload\x0c")
    path = write_junit(verdict(coloured), tmp_path / "q.xml")
    SCHEMA.validate(str(path))
    text = path.read_text()
    assert "\x1b" not in text and "\x00" not in text and "\x07" not in text and "\x0c" not in text
    [error] = [r for case in list(junitparser.JUnitXml.fromfile(str(path)))[0] for r in case.result]
    assert "RuntimeError: bad byte in" in error.message
