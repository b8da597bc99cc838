"""Machine output is mbtune's alone: with --format json|csv, stdout holds the document and nothing else,
whatever the user's code prints (its factory, its blocks' constructors, its forward, its batch maker, its
training script) in the main process, trial workers, ranks or servers; what it prints goes to stderr."""

from __future__ import annotations

import csv
import io
import json
import sys

import pytest

from tests.fixtures.workloads import CHATTER
from tests.unit.test_cli import mbtune

pytestmark = pytest.mark.integration

CHATTY = ["-w", "tests.fixtures.workloads:chatty", "-d", "cpu"]


def document(result, fmt="json"):
    """The parsed document on stdout; fails unless stdout is that document and nothing else."""
    assert result.returncode in (0, 4), result.stderr[-2000:]
    assert CHATTER not in result.stdout
    if fmt == "json":
        return json.loads(result.stdout)
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert rows and all(None not in row for row in rows)  # every row as wide as the header
    return rows


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """`tune` of the chatty workload, as json: a probe's trials and a sweep's ranks all print."""
    root = tmp_path_factory.mktemp("chatty")
    result = mbtune("tune", *CHATTY, "--memory-budget", "64MiB", "--max-batch", "16", "-p", "2", "--schedules",
                    "gpipe", "-m", "2", "--accum", "1", "--steps", "2", "--repeats", "1", "--profiles-dir", str(root),
                    "-f", "json")
    made = document(result)
    assert made and f"{CHATTER}: forward" in result.stderr  # the ranks' prints went to stderr
    [path] = [p for p in root.rglob("*.json") if "chatty" in p.name]
    return path


def test_tune_json(profile):
    assert json.loads(profile.read_text())["schema_version"]


def test_probe_json_and_csv():
    probe = ["probe", *CHATTY, "--memory-budget", "64MiB", "--max-batch", "16", "--no-save"]
    made = document(result := mbtune(*probe, "-f", "json"))
    assert made["ceiling"] == 16 and f"{CHATTER}: factory called" in result.stderr
    rows = document(mbtune(*probe, "--format=csv"), "csv")
    assert len(rows) == len(made["trials"])


def test_sweep_csv():
    rows = document(mbtune("sweep", *CHATTY, "-p", "2", "--schedules", "gpipe", "-m", "2", "--accum", "1",
                           "--micro-batch-size", "2", "--steps", "2", "--repeats", "1", "--no-save", "-f", "csv"), "csv")
    assert rows[0]["status"] == "ok"


def test_check_json():
    made = document(mbtune("check", *CHATTY, "-p", "2", "--schedule", "1f1b", "-m", "2", "-f", "json"))
    assert made["status"] == "PASS" and made["handovers_compared"] > 0


def test_serve_json():
    made = document(mbtune("serve", *CHATTY, "--p99", "1s", "--rates", "50", "--max-batch-sizes", "4",
                           "--queue-delays", "0", "--max-batch", "16", "--memory-budget", "64MiB", "--max-windows",
                           "3", "--min-requests", "0", "--window", "0.5s", "--no-save", "-f", "json"))
    assert made["configs"] if "configs" in made else made


def test_qualify_show_compare_and_plan_json(profile, tmp_path):
    qualified = document(mbtune("qualify", "--baseline", str(profile), "--tolerance", "90%", "--repeats", "1",
                                "--profiles-dir", str(tmp_path), "-f", "json"))
    assert qualified["status"] in ("PASS", "INCONCLUSIVE", "FAIL")
    assert document(mbtune("show", str(profile), "-f", "json"))
    assert document(mbtune("compare", str(profile), str(profile), "-f", "json"))
    assert document(mbtune("plan", str(profile), "--stages", "4", "-m", "4,8", "-f", "json"))


def test_confirm_json_keeps_the_user_script_prints_off_stdout():
    head, tail = CHATTER[:5], CHATTER[5:]  # the command line (in the document) does not hold what it prints
    script = f"print('{head}' + '{tail}: my script'); import torch; torch.zeros(8)"
    result = mbtune("confirm", "--memory-budget", "64MiB", "--runs", "1", "-d", "cpu", "-f", "json", "--",
                    sys.executable, "-c", script)
    assert document(result)["exit_code"] == 0  # confirm keeps the script's own output as its runs' tail
