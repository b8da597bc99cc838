"""`mbtune confirm`: the user's own training command, run in fresh processes under exactly the cap a probe
trial runs under, to show that a batch size holds outside mbtune.

Every Python process the command starts loads probing/cap/sitecustomize.py first (its folder goes first on
the command's PYTHONPATH): on the CPU it counts that process's live tensor bytes as a trial does and raises
torch.OutOfMemoryError past the budget; on CUDA it sets the per-process memory fraction a trial sets. Each
process writes what it held when it ends; a run fits when its command exits 0 and no process went past the
budget, ran out of memory when one did, and crashed when the command failed otherwise.

With a duration, each run goes that long and is then asked to stop (each process writes its report and ends
with exit code 0): it fits when nothing went past the budget, as does a run that ended by itself sooner. Each
process's memory watch (probing/memory_watch.py) samples its memory over time and notes its evaluation passes
and checkpoints; the run's high-water mark over time, and its rises above the mark after its first steps, are
read from them (probing/high_water.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mbtune.errors import ConfigError
from mbtune.probing.high_water import HighWater, high_water
from mbtune.recordio import Record

FITS, OUT_OF_MEMORY, CRASHED = "fits", "out of memory", "crashed"
CAP_FOLDER = Path(__file__).with_name("cap")
COUNTER_FILE = Path(__file__).parent.parent / "device" / "tensor_bytes.py"
WATCH_FILE = Path(__file__).with_name("memory_watch.py")
TAIL_LINES = 12
DEFAULT_RUNS, DEFAULT_TIMEOUT_S = 3, 3600.0
# The high-water mark after this many optimizer steps is a run's baseline: what a probe trial (its default
# --steps) holds; a rise above it is what a trial does not see.
SETTLED_STEPS = 2


@dataclass(frozen=True, kw_only=True)
class ConfirmRun(Record):
    """One run of the command under the cap."""

    outcome: str  # fits | out of memory | crashed
    exit_code: int | None
    peak_bytes: int | None  # the most any of its processes held (None: none reported)
    processes: int  # Python processes that imported torch and reported
    wall_s: float
    cause: str = ""  # why it did not fit: the budget's message, or the command's last error line
    output_tail: str = ""  # the last lines the command wrote, where it did not fit
    stopped: bool = False  # it ran for the whole duration and was then asked to stop
    high_water: HighWater | None = None  # its memory over time (None: no process reported one)


@dataclass(frozen=True, kw_only=True)
class ConfirmResult(Record):
    command: tuple[str, ...]
    device: str
    memory_budget_bytes: int
    runs: tuple[ConfirmRun, ...]
    duration_s: float | None = None  # each run went this long, then was asked to stop

    @property
    def exit_code(self) -> int:
        """0 when every run fit, 1 when one ran out of memory, 3 when one crashed otherwise."""
        outcomes = {run.outcome for run in self.runs}
        return 1 if OUT_OF_MEMORY in outcomes else 3 if CRASHED in outcomes else 0


@dataclass(frozen=True, kw_only=True)
class ConfirmConfig:
    """Settings of `mbtune confirm`: the user's command and the cap its runs are held to."""

    command: tuple[str, ...]
    memory_budget_bytes: int
    runs: int | None = None  # None: DEFAULT_RUNS, or 1 with a duration
    device: str = "auto"
    # A run that takes longer is stopped (and counts as crashed). None: DEFAULT_TIMEOUT_S, or no cap beyond the
    # duration where there is one.
    timeout_s: float | None = None
    duration_s: float | None = None  # each run goes this long, then is asked to stop (None: until it ends)

    def __post_init__(self) -> None:
        from mbtune.settings import MAX_BUDGET_BYTES, MAX_COUNT, as_tuple, check_at_most, check_timeout
        from mbtune.units import parse_device
        from mbtune.validation import check_types, require

        if isinstance(self.command, list):
            object.__setattr__(self, "command", tuple(self.command))
        as_tuple(self, "command")
        check_types(self)
        if not self.command:
            raise ConfigError("no command to confirm", hint="Put it after --: mbtune confirm --memory-budget 8GiB -- "
                              "python train.py --batch-size 64")
        require(self.memory_budget_bytes > 0, "memory_budget_bytes", self.memory_budget_bytes, "a size above zero")
        check_at_most(self, MAX_BUDGET_BYTES, "memory_budget_bytes")
        require(self.runs is None or 1 <= self.runs <= MAX_COUNT, "runs", self.runs, f"an integer from 1 to {MAX_COUNT}")
        if self.timeout_s is not None:
            check_timeout(self.timeout_s, "timeout_s")
        if self.duration_s is not None:
            check_timeout(self.duration_s, "duration_s")
            require(self.timeout_s is None or self.timeout_s > self.duration_s, "timeout_s", self.timeout_s,
                    f"longer than the duration ({self.duration_s:g} s), or not given")
        object.__setattr__(self, "device", parse_device(self.device))

    @property
    def num_runs(self) -> int:
        return self.runs if self.runs is not None else 1 if self.duration_s is not None else DEFAULT_RUNS

    @property
    def run_timeout_s(self) -> float:
        """How long a run may take: the timeout, else an hour, or the duration and the time to stop."""
        if self.timeout_s is not None:
            return self.timeout_s
        return DEFAULT_TIMEOUT_S if self.duration_s is None else self.duration_s + 2 * STOP_GRACE_S


def confirm_command(config: ConfirmConfig, on_run: Callable[[int, ConfirmRun], None] | None = None, *,
                    settled_steps: int = SETTLED_STEPS) -> ConfirmResult:
    """Run the command `config.num_runs` times, each in fresh processes under the cap; see the module's text.
    `settled_steps`: the optimizer steps after which a run's high-water mark is its baseline (a probe's steps)."""
    from mbtune.device import resolve_device

    device = resolve_device(config.device)
    command = list(config.command)
    done = []
    for index in range(config.num_runs):
        capped = run_capped(command, config.memory_budget_bytes, "cpu" if device == "cpu" else "cuda",
                            config.run_timeout_s, stop_after_s=config.duration_s)
        run = _classify(capped, settled_steps)
        if run.processes == 0 and run.stopped:
            raise ConfigError(f"{command[0]!r} was stopped after --duration {config.duration_s:g} s, before any Python "
                              "process of it had started torch: nothing was confirmed",
                              hint="Give it time to start and train: --duration 30m")
        if run.processes == 0 and run.outcome == FITS:
            raise ConfigError(f"{command[0]!r} ran, but no Python process of it imported torch: there was nothing "
                              "to hold to the budget", hint="Confirm the command that trains: mbtune confirm "
                              "--memory-budget 8GiB -- python train.py ...")
        done.append(run)
        if on_run is not None:
            on_run(index, run)
    return ConfirmResult(command=tuple(command), device=device, memory_budget_bytes=config.memory_budget_bytes,
                         runs=tuple(done), duration_s=config.duration_s)


def cap_environment(memory_budget_bytes: int, device: str, report_dir: str) -> dict[str, str]:
    """The environment that puts every Python process of a command under the cap (see the module's text)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(CAP_FOLDER), *filter(None, [env.get("PYTHONPATH")])])
    env.update(MBTUNE_CAP_BUDGET=str(memory_budget_bytes), MBTUNE_CAP_DEVICE=device, MBTUNE_CAP_REPORT=report_dir,
               MBTUNE_CAP_COUNTER=str(COUNTER_FILE), MBTUNE_CAP_WATCH=str(WATCH_FILE))
    return env


@dataclass(frozen=True)
class Capped:
    """One run of a command under the cap: how it ended and what each of its processes reported."""

    exit_code: int | None  # None: stopped at its timeout
    reported: list[dict]
    output: str
    wall_s: float
    timeout_s: float
    # With a step line (run_capped's `steps_from`): when each line that matched was printed, from the start.
    printed_steps_s: tuple[float, ...] = ()
    started: float = 0.0  # when it was started (time.time())
    stopped: bool = False  # it ran for its duration (run_capped's `stop_after_s`) and was then asked to stop

    @property
    def peak_bytes(self) -> int | None:
        """The most any of its processes held (None: none reported)."""
        peaks = [r["peak_bytes"] for r in self.reported if r.get("peak_bytes") is not None]
        return max(peaks) if peaks else None

    @property
    def out_of_memory(self) -> str:
        """Why a process went past the budget (the budget's message, or the OOM it raised); "" where none did,
        whether or not the script caught the error."""
        over = next((r["over_budget"] for r in self.reported if r.get("over_budget")), "")
        raised = next((r["exception"] for r in self.reported if "OutOfMemoryError" in r.get("exception", "")), "")
        return over or raised

    @property
    def lines(self) -> list[str]:
        """What the command wrote, its blank lines left out."""
        return [line for line in self.output.splitlines() if line.strip()]

    @property
    def tail(self) -> str:
        return "\n".join(self.lines[-TAIL_LINES:])

    @property
    def last_line(self) -> str:
        return self.lines[-1].strip() if self.lines else "no output"


STOP_GRACE_S = 5.0  # asked to stop, a process has this long to write its report before it is killed


def run_capped(command: list[str], memory_budget_bytes: int, device: str, timeout_s: float,
               env: dict[str, str] | None = None, steps_from: tuple[re.Pattern[str], int] | None = None,
               stop_after_s: float | None = None) -> Capped:
    """Run the command once in fresh processes under the cap; `env`: more of the cap's settings
    (MBTUNE_CAP_STEPS). `steps_from`: a line the command prints once a step and how many such lines a run
    is: each is timed as it is printed, and after the last the processes are asked to report and end.
    `stop_after_s`: after that long the processes are asked to report and end (exit code 0; `stopped`).
    At its timeout the processes are asked to report (what they held, the steps they made) and the whole
    process group is stopped."""
    with tempfile.TemporaryDirectory(prefix="mbtune-confirm-") as reports:
        stop = Path(reports) / "stop"
        settings = {**cap_environment(memory_budget_bytes, device, reports), **(env or {})}
        if steps_from is not None:
            settings["PYTHONUNBUFFERED"] = "1"  # each step's line as it is printed, not when a buffer fills
        started, started_at = time.perf_counter(), time.time()
        try:
            process = subprocess.Popen(command, env=settings, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, errors="replace", start_new_session=True)
        except OSError as exc:
            raise ConfigError(f"could not start {command[0]!r}: {exc.strerror or exc}",
                              hint="Give the command as you would run it, after --.") from exc
        lines: list[str] = []
        printed: list[float] = []

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line)
                if steps_from is not None and steps_from[0].search(line):
                    printed.append(time.perf_counter() - started)
                    if len(printed) == steps_from[1]:
                        stop.touch()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        code: int | None
        stopped = False
        try:
            code, stopped = _wait(process, stop, timeout_s, stop_after_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # what the command left running (a worker, a loader)
        reader.join(timeout=STOP_GRACE_S)
        wall_s = time.perf_counter() - started
        reported = [json.loads(p.read_text()) for p in Path(reports).glob("*.json")]
    return Capped(code, reported, "".join(lines), wall_s, timeout_s, tuple(printed), started_at, stopped)


def _wait(process: subprocess.Popen, stop: Path, timeout_s: float, stop_after_s: float | None) -> tuple[int | None, bool]:
    """The command's exit code (None: stopped at its timeout), and whether it was asked to stop at its
    duration. Asked to stop, its processes have STOP_GRACE_S to report and end."""
    if stop_after_s is not None and stop_after_s < timeout_s:
        try:
            return process.wait(timeout=stop_after_s), False
        except subprocess.TimeoutExpired:
            stop.touch()
            try:
                return process.wait(timeout=STOP_GRACE_S), True
            except subprocess.TimeoutExpired:
                return None, True  # what did not end is killed with the process group
    try:
        return process.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        stop.touch()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_GRACE_S)
        return None, False


def _classify(capped: Capped, settled_steps: int = SETTLED_STEPS) -> ConfirmRun:
    code = capped.exit_code
    memory = high_water(capped.reported, capped.started, settled_steps)

    def run(outcome: str, cause: str = "", output_tail: str = "") -> ConfirmRun:
        return ConfirmRun(outcome=outcome, exit_code=code, peak_bytes=capped.peak_bytes,
                          processes=len(capped.reported), wall_s=capped.wall_s, cause=cause, output_tail=output_tail,
                          stopped=capped.stopped, high_water=memory)

    if capped.out_of_memory:
        return run(OUT_OF_MEMORY, capped.out_of_memory, capped.tail)
    if code == 0 or (code is None and capped.stopped):  # asked to stop at its duration: what lingered was killed
        return run(FITS)
    if code is None:
        cause = f"still running after {capped.timeout_s:g} s (--timeout): stopped"
    elif code < 0:
        cause = f"killed by signal {-code} ({signal.Signals(-code).name})" if -code in signal.valid_signals() else f"killed ({code})"
    else:
        cause = f"exit code {code}: {capped.last_line}"
    return run(CRASHED, cause, capped.tail)
