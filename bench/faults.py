"""Benchmark: fault survival. Injects each fault mbtune must survive N times against the real CLI (fresh
subprocesses, CPU, small workloads) and counts per fault: injected; survived (the documented exit code and
outcome, nothing lost, nothing left running); result rows lost (trials reported finished but missing from
what was saved; must be 0); orphan processes left (carrying the injection's tag after it ended; must be 0).

First every bad command line of tests/fixtures/bad_inputs.py is run and counted as handled (exit 2, one
line, no traceback, nothing written). Run: .venv/bin/python bench/faults.py [--repeats 3] [--skip-inputs] [--only TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbtune.pipeline.point import SweepPoint  # noqa: E402
from tests.fixtures.bad_inputs import catalogue, make_files  # noqa: E402
from tests.fixtures.commands import GRID, PROBE, SMALL, SWEEP  # noqa: E402
from tests.fixtures.processes import orphans  # noqa: E402

TWO_POINTS = ["-d", "cpu", "-p", "2", "--schedules", "gpipe", "-m", "2,4", "--accum", "1", "--micro-batch-size", "2",
              "--steps", "1", "--format", "json"]
ORPHANS_AFTER_S = 5.0  # a run's processes must all be gone this long after it ended
TRIAL_LINE = re.compile(r"^\s*trial (\d+): (.+?) -> (\w+)", re.MULTILINE)


@dataclass
class Injection:
    """One injected fault: a tag in every process it starts, a scratch folder, and what it found."""

    work: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    problems: list[str] = field(default_factory=list)
    lost: int = 0
    left: set[int] = field(default_factory=set)

    @property
    def profiles(self) -> Path:
        """The --profiles-dir this injection's runs write to."""
        return self.work / "profiles"

    def start(self, *args: str) -> subprocess.Popen:
        """Start mbtune with the tag in its environment."""
        env = {**os.environ, "COLUMNS": "200", "MBTUNE_TEST_TAG": self.tag}
        return subprocess.Popen([sys.executable, "-m", "mbtune", *args], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run mbtune to the end and collect its output."""
        process = self.start(*args)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            stderr += f"\n[bench: killed after {timeout} s]"
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    def check(self, ok: bool, expected: str, result: subprocess.CompletedProcess | None = None) -> None:
        """Record a problem unless ok, with the command, exit code and stderr tail that showed it."""
        if not ok:
            self.problems.append(expected + (f"\n    {describe(result)}" if result is not None else ""))

    @property
    def survived(self) -> bool:
        """The documented outcome, nothing lost and nothing left running."""
        return not (self.problems or self.lost or self.left)

    def reap(self) -> None:
        """Add the tagged processes still alive 5 s after the run ended to the orphans."""
        self.left |= orphans(self.tag, wait_s=ORPHANS_AFTER_S)


def describe(result: subprocess.CompletedProcess) -> str:
    """The command, its exit code and the tail of its stderr."""
    command = " ".join(str(a) for a in result.args[2:])
    tail = "\n      ".join(result.stderr.strip().splitlines()[-6:])
    return f"command: {command}\n    exit code: {result.returncode}\n    stderr tail:\n      {tail}"


def finished(stderr: str) -> Counter[str]:
    """Labels of the trials mbtune reported as ended ("trial k: LABEL -> STATUS"), each k counted once; the
    probe's prediction on fake tensors is no row (nothing measured: the profile keeps it as its prediction)."""
    by_number = {number: label for number, label, _ in TRIAL_LINE.findall(stderr)
                 if not label.startswith("predicting the ceiling")}
    return Counter(by_number.values())


def journal_records(profiles: Path, kind: str) -> list[dict]:
    """The records of one kind in every journal under a profiles folder."""
    records = []
    for journal in profiles.glob("*/*.journal.jsonl"):
        for line in journal.read_text().splitlines()[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a last line cut short by a kill
                continue
            records += [entry["record"]] if entry.get("kind") == kind else []
    return records


def row_label(kind: str, record: dict) -> str:
    """The progress label of a saved probe trial or sweep result."""
    return f"batch {record['batch_size']}" if kind == "probe_trial" else SweepPoint.from_dict(record["point"]).label


def saved(profiles: Path, skip: tuple[Path, ...] = ()) -> Counter[str]:
    """Labels of every trial held by the profiles (except skip) or by a journal beside them."""
    in_profiles: Counter[str] = Counter()
    for path in profiles.glob("*/*.json"):
        if path in skip:
            continue
        data = json.loads(path.read_text())
        in_profiles += Counter(row_label("probe_trial", t) for t in (data.get("probe") or {}).get("trials", []))
        in_profiles += Counter(row_label("sweep_point", r) for r in (data.get("sweep") or {}).get("results", []))
    journaled = Counter(row_label(kind, r) for kind in ("probe_trial", "sweep_point")
                        for r in journal_records(profiles, kind))
    return in_profiles | journaled


def count_lost(injection: Injection, stderr: str, skip: tuple[Path, ...] = ()) -> None:
    """Add the trials reported finished on stderr but missing from what was saved."""
    injection.lost += sum((finished(stderr) - saved(injection.profiles, skip)).values())


def results_of(injection: Injection, result: subprocess.CompletedProcess) -> list[dict]:
    """The sweep results in a --format json stdout (none, and a problem, when it does not parse)."""
    try:
        return json.loads(result.stdout)["results"]
    except (json.JSONDecodeError, KeyError):
        injection.check(False, "expected a JSON report on stdout", result)
        return []


def oom_at_batch_1(inj: Injection) -> None:
    """Probe under a 64 KiB budget (less than the weights and their optimizer state): exit 2, "runs out of
    memory"."""
    result = inj.run("probe", *SMALL, "--memory-budget", "64KiB", "--profiles-dir", str(inj.profiles))
    inj.check(result.returncode == 2 and "runs out of memory" in result.stderr,
              "expected exit 2 and 'runs out of memory'", result)
    count_lost(inj, result.stderr)


def oom_above_ceiling(inj: Injection) -> None:
    """Probe where large batches run out of memory: exit 0, at least one trial ended as oom."""
    result = inj.run("probe", "-w", "mlp", "-O", "layers=2", "-O", "width=256", "-d", "cpu", "--memory-budget",
                     "200MiB", "--threads", "1", "--granularity", "256", "--profiles-dir", str(inj.profiles))
    statuses = [status for _, _, status in TRIAL_LINE.findall(result.stderr)]
    inj.check(result.returncode == 0 and "oom" in statuses, "expected exit 0 with an oom trial", result)
    count_lost(inj, result.stderr)


def oom_killed(inj: Injection) -> None:
    """A trial SIGKILLed like the kernel's OOM killer does: exit 3, SIGKILL named, no traceback."""
    result = inj.run("probe", "-w", "tests.fixtures.workloads:oom_killed", "-d", "cpu",
                     "--profiles-dir", str(inj.profiles))
    inj.check(result.returncode == 3 and "SIGKILL" in result.stderr and "Traceback" not in result.stderr,
              "expected exit 3 naming SIGKILL, without a traceback", result)
    count_lost(inj, result.stderr)


def rank_fault(workload: str, first: str) -> Callable[[Injection], None]:
    """A two-point sweep whose first point hangs or crashes in one rank: that point `first`, then ok, exit 0."""
    def inject(inj: Injection) -> None:
        result = inj.run("sweep", "-w", f"tests.fixtures.workloads:{workload}", "-O", f"marker={inj.work / 'marker'}",
                         *TWO_POINTS, "--point-timeout", "8", "--profiles-dir", str(inj.profiles))
        statuses = [r["status"] for r in results_of(inj, result)]
        inj.check(result.returncode == 0 and statuses == [first, "ok"],
                  f"expected exit 0 and statuses [{first}, ok], got {statuses}", result)
        count_lost(inj, result.stderr)
    inject.__doc__ = f"A rank fault ({workload}): the point ends as {first}, the sweep goes on."
    return inject


def start_sweep_until(inj: Injection, marker: str) -> tuple[subprocess.Popen, str]:
    """Start SWEEP and read its stderr until marker shows; returns the process and what it read.

    Reads the pipe unbuffered, so that communicate() afterwards gets exactly the rest."""
    process = inj.start(*SWEEP, "--profiles-dir", str(inj.profiles))
    seen = b""
    while marker.encode() not in seen:
        chunk = os.read(process.stderr.fileno(), 4096)
        if not chunk:
            break
        seen += chunk
    return process, seen.decode(errors="replace")


def sigint_mid_sweep(inj: Injection) -> None:
    """Ctrl-C during a sweep: exit 130; the saved profile holds every finished point, marked interrupted."""
    process, seen = start_sweep_until(inj, "trial 3:")
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, seen + stderr)
    saved_profiles = list(inj.profiles.glob("*/mlp.json"))
    interrupted = bool(saved_profiles) and json.loads(saved_profiles[0].read_text())["sweep"]["interrupted"]
    inj.check(result.returncode == 130 and interrupted, "expected exit 130 and a profile marked interrupted", result)
    count_lost(inj, result.stderr)


def sigkill_then_resume(inj: Injection) -> None:
    """kill -9 during a sweep, then --resume: nothing finished is lost or run again, the grid completes."""
    process, seen = start_sweep_until(inj, "trial 3:")
    process.kill()
    _, stderr = process.communicate(timeout=60)
    inj.reap()
    journaled = journal_records(inj.profiles, "sweep_point")
    count_lost(inj, seen + stderr)
    result = inj.run(*SWEEP, "--profiles-dir", str(inj.profiles), "--resume", "--format", "json")
    results = results_of(inj, result)
    replayed = result.stderr.count("replayed from the journal")
    ran_again = finished(result.stderr).total() - replayed
    inj.check(result.returncode == 0 and len(results) == GRID and replayed == len(journaled) >= 3
              and ran_again == GRID - len(journaled),
              f"expected exit 0, {GRID} results, {len(journaled)} replayed and {GRID - len(journaled)} run; got "
              f"{len(results)} results, {replayed} replayed, {ran_again} run", result)
    inj.lost += sum(record not in results for record in journaled)


def damaged_profile(damage: str) -> Callable[[Injection], None]:
    """A saved profile made corrupt or of a newer schema: show exits 2; a new probe exits 0 and leaves it as it was."""
    def inject(inj: Injection) -> None:
        probe = ["probe", *SMALL, "--max-batch", "2", "--profiles-dir", str(inj.profiles)]
        first = inj.run(*probe)
        profiles = list(inj.profiles.glob("*/mlp.json"))
        inj.check(first.returncode == 0 and len(profiles) == 1, "expected the first probe to save mlp.json", first)
        if not profiles:
            return
        path, text = profiles[0], profiles[0].read_text()
        data = json.loads(text)
        data["schema_version"] += 1
        path.write_text(text[:100] if damage == "corrupt" else json.dumps(data))
        damaged = path.read_bytes()
        shown = inj.run("show", str(path))
        inj.check(shown.returncode == 2, "expected show to exit 2", shown)
        again = inj.run(*probe)
        inj.check(again.returncode == 0 and path.read_bytes() == damaged,
                  "expected the new probe to exit 0 and leave the damaged profile byte-identical", again)
        count_lost(inj, again.stderr, skip=(path,))
    inject.__doc__ = f"A {damage} profile is reported and never overwritten."
    return inject


def nvml_missing(inj: Injection) -> None:
    """No NVIDIA driver: the sweep completes and every result says NVML is not available."""
    result = inj.run(*SWEEP, "--profiles-dir", str(inj.profiles), "--format", "json")
    results = results_of(inj, result)
    inj.check(result.returncode == 0 and len(results) == GRID and not any(r["nvml"]["available"] for r in results),
              "expected exit 0 and every result with nvml.available false", result)
    count_lost(inj, result.stderr)


def unwritable_output(inj: Injection) -> None:
    """--profiles-dir is a regular file: exit 2, "cannot write under", before any trial."""
    blocker = inj.work / "not-a-folder"
    blocker.write_text("x")
    result = inj.run("probe", *SMALL, "--profiles-dir", str(blocker))
    inj.check(result.returncode == 2 and "cannot write under" in result.stderr and "trial 1" not in result.stderr,
              "expected exit 2 with 'cannot write under' before any trial", result)


TUNE = ["tune", *SMALL, "--memory-budget", "200MiB", "--max-batch", "64", "-p", "2", "--schedules", "gpipe,1f1b",
        "-m", "2,4", "--accum", "1", "--steps", "2"]
SERVE = ["serve", *SMALL, "--p99", "1s", "--memory-budget", "200MiB", "--max-batch", "64", "--rates", "50,100",
         "--max-batch-sizes", "4,8", "--queue-delays", "0,2ms", "--max-windows", "3", "--min-requests", "0",
         "--window", "0.3s"]
COMMANDS = {"probe": PROBE, "sweep": SWEEP, "tune": TUNE, "serve": SERVE}
# Where in a run the signal comes: at the probe's third trial, or after it at the first line of a later phase.
PHASES = {"sweep phase": " p=2 m=", "configuration phase": "max 4, delay"}
STOPPED = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129, signal.SIGKILL: -signal.SIGKILL}
# A finished run's exit codes: qualify's verdicts (0 pass, 1 a check failed, 4 inconclusive) are all complete.
COMPLETED = {"qualify": (0, 1, 4)}
ROW_KINDS = ("probe_trial", "sweep_point", "service_curve", "serve_config")


def qualify_args(inj: Injection) -> list[str]:
    """A qualification against a tuned baseline made first (in its own folder: its rows are not counted)."""
    baseline_dir = inj.work / "baseline"
    if not list(baseline_dir.glob("*/mlp.json")):
        made = inj.run(*TUNE, "--profiles-dir", str(baseline_dir), "--repeats", "1")
        inj.check(made.returncode == 0, "expected the baseline's tune to exit 0", made)
    [baseline] = list(baseline_dir.glob("*/mlp.json")) or [baseline_dir / "missing.json"]
    return ["qualify", "--baseline", str(baseline), "--tolerance", "90%", "--repeats", "1"]


def read_until(process: subprocess.Popen, marker: str) -> bytes:
    """What the process wrote to stderr from now until `marker` showed, read unbuffered."""
    seen = b""
    while marker.encode() not in seen and (chunk := os.read(process.stderr.fileno(), 4096)):
        seen += chunk
    return seen


def rows_of(report: dict) -> list[dict]:
    """Every finished row a json report holds: probe trials, sweep results, serve's curve and runs."""
    parts = [report, *(report.get(k) or {} for k in ("probe", "sweep", "serve"))]
    parts += [part["ceiling"] for part in list(parts) if isinstance(part.get("ceiling"), dict)]  # serve's probe
    rows = [r for part in parts for key in ("trials", "results", "runs") for r in part.get(key) or []]
    return rows + [part["curve"] for part in parts if isinstance(part.get("curve"), dict)]


def kept_in(record: dict, row: dict) -> bool:
    """Whether a journaled record is this row of the final report: the same, or (a serving configuration's
    run) the same configuration whose loads hold the journaled ones, the report adding the simulator's
    prediction to each and the second look's loads beside them."""
    if record == row:
        return True
    if "loads" not in record or record.get("config") != row.get("config"):
        return False
    def measured(load: dict) -> dict:
        return {k: v for k, v in load.items() if not k.startswith("predicted_")}
    return all(measured(load) in [measured(other) for other in row.get("loads", [])] for load in record["loads"])


def stop_then_resume(command: str, signum: int, phase: str | None = None) -> Callable[[Injection], None]:
    """A signal mid-run (in `phase`), then --resume: the documented exit code, every journaled trial or point
    kept and replayed, and the resumed run completes."""
    def inject(inj: Injection) -> None:
        base = qualify_args(inj) if command == "qualify" else COMMANDS[command]
        args = [*base, "--profiles-dir", str(inj.profiles)]
        process = inj.start(*args)
        seen = read_until(process, "trial 3:")
        if phase is not None:
            seen += read_until(process, PHASES[phase])
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=180)
        result = subprocess.CompletedProcess(process.args, process.returncode, stdout, seen.decode() + stderr)
        inj.reap()
        inj.check(result.returncode == STOPPED[signum], f"expected exit {STOPPED[signal.Signals(signum)]}", result)
        journaled = [r for kind in ROW_KINDS for r in journal_records(inj.profiles, kind)]
        announced = len(journaled) - len(journal_records(inj.profiles, "service_curve"))  # the curve: silently
        resumed = inj.run(*args, "--resume", "--format", "json")
        replayed = resumed.stderr.count("replayed from the journal")
        completed = resumed.returncode in COMPLETED.get(command, (0,))
        inj.check(completed and replayed == announced,
                  f"expected the resume to complete and replay {announced} records, replayed {replayed}", resumed)
        if completed:
            rows = rows_of(json.loads(resumed.stdout))
            inj.lost += sum(not any(kept_in(record, row) for row in rows) for record in journaled)
    inject.__doc__ = f"{signal.Signals(signum).name} during {command}{f' ({phase})' if phase else ''}, then --resume."
    return inject


def killed_trial_runs_again(inj: Injection) -> None:
    """A trial SIGKILLed from outside (as the OOM killer does): exit 3, and --resume runs it again."""
    args = ["probe", "-w", "tests.fixtures.workloads:killed_once", "-O", f"marker={inj.work / 'killed'}", "-d", "cpu",
            "--max-batch", "16", "--no-predict", "--profiles-dir", str(inj.profiles)]  # a real trial is killed
    first = inj.run(*args)
    inj.check(first.returncode == 3 and "--resume runs it again" in first.stderr, "expected exit 3 with the hint", first)
    resumed = inj.run(*args, "--resume", "--format", "json")
    statuses = [t["status"] for t in json.loads(resumed.stdout)["trials"]] if resumed.returncode == 0 else []
    inj.check(resumed.returncode == 0 and "killed" not in statuses, "expected the resume to run the trial again",
              resumed)


def two_writers(command: str) -> Callable[[Injection], None]:
    """A second run on the profile another is writing: exit 3; the first, stopped, resumes and completes."""
    def inject(inj: Injection) -> None:
        base = qualify_args(inj) if command == "qualify" else SWEEP if command == "sweep" else COMMANDS[command]
        args = [*base, "--profiles-dir", str(inj.profiles)]
        first = inj.start(*args)
        read_until(first, "trial 2:")  # a trial journaled (the first line may be the prediction, never journaled)
        first.send_signal(signal.SIGSTOP)  # held mid-run, its lock with it, however short the run would be
        second = inj.run(*args)
        first.send_signal(signal.SIGINT)
        first.send_signal(signal.SIGCONT)
        first.communicate(timeout=120)
        resumed = inj.run(*args, "--resume")
        # qualify tells it as an ERROR check of its verdict (stdout), exit 3 as the others
        refused = "another mbtune run is writing" in second.stderr + second.stdout
        inj.check(second.returncode == 3 and refused and first.returncode == 130,
                  "expected the second writer refused and the first stopped", second)
        inj.check(resumed.returncode in COMPLETED.get(command, (0,)), "expected the first run to resume", resumed)
    inject.__doc__ = f"Two runs of {command} on one profile."
    return inject


def full_disk(inj: Injection) -> None:
    """The profiles folder's disk fills mid-sweep: the run ends in one line, nothing it reported finished is
    lost once there is room again, and --resume completes."""
    disk = inj.work / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode:
        inj.problems.append("not injected: mounting a small tmpfs needs root")
        return
    try:
        args = [*SWEEP, "--profiles-dir", str(disk / "profiles")]
        process = inj.start(*args)
        seen = read_until(process, "trial 3:")
        filler = disk / "filler"
        with open(filler, "wb") as handle:
            try:
                while True:
                    handle.write(b"\0" * 65536)
                    handle.flush()
            except OSError:
                pass
        stdout, stderr = process.communicate(timeout=300)
        result = subprocess.CompletedProcess(process.args, process.returncode, stdout, seen.decode() + stderr)
        inj.reap()
        lines = [line for line in stderr.splitlines() if line.startswith("error:")]
        inj.check(result.returncode == 3 and len(lines) == 1 and "No space left on device" in lines[0]
                  and "internal error" not in lines[0] and "Traceback" not in stderr,
                  "expected exit 3 and one line naming the full disk", result)
        filler.unlink()
        inj.profiles.mkdir(parents=True, exist_ok=True)
        finished_rows = finished(result.stderr)
        resumed = inj.run(*args, "--resume", "--format", "json")
        inj.check(resumed.returncode == 0, "expected the resume to complete", resumed)
        kept = Counter(row_label("sweep_point", r) for r in json.loads(resumed.stdout or "{}").get("results", []))
        inj.lost += sum((finished_rows - kept).values())
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def hand_edited_profile(inj: Injection) -> None:
    """A hand-edited profile with a field of the wrong type: show names the field and exits 2; a new probe
    exits 0 and leaves it as it was."""
    probe = ["probe", *SMALL, "--max-batch", "2", "--profiles-dir", str(inj.profiles)]
    first = inj.run(*probe)
    [path] = list(inj.profiles.glob("*/mlp.json")) or [inj.work / "none.json"]
    inj.check(first.returncode == 0 and path.exists(), "expected the first probe to save mlp.json", first)
    if not path.exists():
        return
    data = json.loads(path.read_text())
    data["probe"]["ceiling"] = "lots"
    path.write_text(json.dumps(data))
    edited = path.read_bytes()
    shown = inj.run("show", str(path))
    inj.check(shown.returncode == 2 and "probe.ceiling" in shown.stderr, "expected show to name probe.ceiling", shown)
    again = inj.run(*probe)
    inj.check(again.returncode == 0 and path.read_bytes() == edited, "expected the edited profile left as it was", again)


FAULTS: list[tuple[str, Callable[[Injection], None]]] = [
    ("trial OOM at batch 1 (64 KiB budget)", oom_at_batch_1),
    ("trial OOM above the ceiling", oom_above_ceiling),
    ("trial SIGKILLed (OOM killer)", oom_killed),
    ("rank hangs", rank_fault("hang_once", "timeout")),
    ("rank crashes mid-step", rank_fault("crash_once", "error")),
    ("SIGINT mid-sweep", sigint_mid_sweep),
    ("SIGKILL mid-sweep, then --resume", sigkill_then_resume),
    ("corrupt profile", damaged_profile("corrupt")),
    ("profile of a newer schema", damaged_profile("newer")),
    ("NVML missing", nvml_missing),
    ("unwritable --profiles-dir", unwritable_output),
    *[(f"{signal.Signals(signum).name} mid-{command}, then --resume", stop_then_resume(command, signum))
      for command in ("probe", "sweep", "tune") for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                                                 signal.SIGKILL)],
    ("rank SIGKILLed mid-step", rank_fault("rank_killed_once", "killed")),
    ("rank SIGSTOPped mid-step", rank_fault("rank_stopped_once", "timeout")),
    *[(f"{signal.Signals(signum).name} mid-{name}, then --resume", stop_then_resume(command, signum, phase))
      for name, command, phase in (("tune's sweep", "tune", "sweep phase"), ("serve", "serve", None),
                                   ("serve's configurations", "serve", "configuration phase"),
                                   ("qualify", "qualify", None), ("qualify's sweep", "qualify", "sweep phase"))
      for signum in (signal.SIGINT, signal.SIGKILL)],
    ("full disk mid-sweep, then --resume", full_disk),
    ("trial killed from outside, resumed", killed_trial_runs_again),
    *[(f"two writers of one {command} profile", two_writers(command))
      for command in ("probe", "sweep", "tune", "serve", "qualify")],
    ("hand-edited profile", hand_edited_profile),
]


def bad_inputs() -> tuple[int, int, list[str]]:
    """Every catalogued bad command line in a fresh interpreter: (handled, tried, what went wrong). Handled
    means exit 2, one line on stderr naming the problem, no traceback, no file written."""
    handled, wrong, cases = 0, [], catalogue()
    with tempfile.TemporaryDirectory(prefix="mbtune-bad-input-") as folder:
        inputs = Path(folder)
        make_files(inputs)
        before = sorted(p.name for p in inputs.iterdir())
        for args, expect in cases:
            with tempfile.TemporaryDirectory(prefix="mbtune-scratch-") as scratch:
                env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
                env.pop("MBTUNE_DEBUG", None)
                result = subprocess.run([sys.executable, "-m", "mbtune", *(a.replace("{dir}", folder) for a in args)],
                                        cwd=scratch, env=env, capture_output=True, text=True, timeout=120)
                lines = [line for line in result.stderr.splitlines() if line.strip()]
                problems = [p for p, bad in (
                    (f"exit {result.returncode}", result.returncode != 2),
                    (f"{len(lines)} lines on stderr", len(lines) != 1 or "Traceback" in result.stderr),
                    (f"no {expect!r} in the line",
                     bool(lines) and expect.replace("{dir}", folder).lower() not in lines[-1].lower()),
                    ("a file was written", bool(list(Path(scratch).iterdir()))
                     or sorted(p.name for p in inputs.iterdir()) != before)) if bad]
                if problems:
                    wrong.append(f"{' '.join(args)}: {', '.join(problems)}")
                else:
                    handled += 1
    return handled, len(cases), wrong


def inject_once(fault: Callable[[Injection], None]) -> Injection:
    """Run one injection in a fresh scratch folder; an exception in the bench itself is a problem, not a crash."""
    with tempfile.TemporaryDirectory(prefix="mbtune-faults-") as work:
        injection = Injection(Path(work))
        try:
            fault(injection)
        except Exception as exc:  # noqa: BLE001 - report it beside the others
            injection.problems.append(f"the check itself failed: {type(exc).__name__}: {exc}")
        injection.reap()
    return injection


def print_row(name: str, injections: list[Injection], seconds: float) -> None:
    """One table row: injected, survived, rows lost, orphans left, wall seconds."""
    survived = sum(i.survived for i in injections)
    lost = sum(i.lost for i in injections)
    left = sum(len(i.left) for i in injections)
    print(f"{name:<38}{len(injections):>9}{survived:>9}{lost:>11}{left:>9}{seconds:>9.1f}", flush=True)


def main() -> int:
    """Inject every fault --repeats times, print the table and any failures; non-zero if anything went wrong."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="injections of each fault (default 3)")
    parser.add_argument("--skip-inputs", action="store_true", help="skip the bad-input catalogue")
    parser.add_argument("--only", default="", help="inject only the faults whose name holds this text")
    args = parser.parse_args()
    if not args.skip_inputs:
        started = time.monotonic()
        handled, tried, wrong = bad_inputs()
        print(f"bad inputs handled: {handled} of {tried} (exit 2, one line, no traceback, nothing written; "
              f"{time.monotonic() - started:.0f} s)")
        for line in wrong:
            print(f"  NOT HANDLED: {line}")
    print(f"fault survival: each fault injected {args.repeats}x into the real mbtune CLI on CPU; "
          "rows lost and orphans must be 0")
    print(f"{'fault':<38}{'injected':>9}{'survived':>9}{'rows lost':>11}{'orphans':>9}{'wall s':>9}")
    everything, failures, started = [], [], time.monotonic()
    for name, fault in [(n, f) for n, f in FAULTS if args.only in n]:
        fault_started = time.monotonic()
        injections = [inject_once(fault) for _ in range(args.repeats)]
        print_row(name, injections, time.monotonic() - fault_started)
        everything += injections
        failures += [(name, i) for i in injections if not i.survived]
    print_row("total", everything, time.monotonic() - started)
    for name, injection in failures:
        print(f"\nNOT SURVIVED: {name} (rows lost {injection.lost}, orphans {sorted(injection.left)})")
        for problem in injection.problems:
            print(f"  - {problem}")
    return 1 if failures or (not args.skip_inputs and wrong) else 0


if __name__ == "__main__":
    sys.exit(main())
