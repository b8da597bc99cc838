"""Run work in a fresh process under a deadline; nothing leaks into the next trial.

Trial processes are forked from a forkserver that has imported torch (and mbtune.probing.trial) but touched no
device and started no threads, so each trial starts clean in milliseconds instead of paying a fresh
interpreter's torch import. Each trial process leads its own process group, which is killed whole when
the deadline passes or the parent is interrupted.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mbtune.quiet import quiet_library_logs
from mbtune.records import ERROR, ERROR_TAIL_LINES, HARNESS_FAULT, KILLED, OK, TIMEOUT, WORKLOAD_FAULT

# torch._dynamo is what an optimizer's first construction imports (about 2 s); paying it once here
# keeps it out of every trial. None of these start threads or touch a device.
_PRELOAD = ["torch", "torch._dynamo", "mbtune.probing.trial", "mbtune.pipeline.runner", "mbtune.workloads.gpt",
            "mbtune.workloads.mlp"]
_context: multiprocessing.context.ForkServerContext | None = None
_GRACE_S = 3.0
_PR_SET_PDEATHSIG = 1
# A worker process that is still importing the main script (multiprocessing re-imports it in every child)
# and reaches mbtune from there exits with this code: the script calls mbtune outside a main guard.
MAIN_GUARD_EXIT_CODE = 86
MAIN_GUARD_MESSAGE = ('the main script calls mbtune outside a main guard: put the code that calls mbtune under '
                      '`if __name__ == "__main__":`; the worker processes re-import the main script')
# What multiprocessing says when a child starts a process while it is still importing the main script.
_BOOTSTRAP_SIGN = "before the current process has finished its bootstrapping phase"


@dataclass(frozen=True, kw_only=True)
class ChildResult:
    """What came back from a child: its value, or why there is none."""

    status: str  # ok | error | timeout | killed
    value: Any = None
    error: str = ""
    exitcode: int | None = None
    wall_s: float = 0.0
    error_kind: str = ""  # workload | harness when status is not ok (see records.ERROR_KINDS)
    error_tail: str = ""  # the last lines of the target's traceback and of the child's stderr
    stderr_tail: str = ""  # the last lines the child wrote to stderr, whatever the status

    @property
    def cause(self) -> str:
        """Why there is no value, in one line: the error's last line, or the status."""
        return (self.error.strip() or self.status).splitlines()[-1]


def process_context() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context of the process-wide forkserver, with torch preloaded."""
    global _context
    if _context is None:
        _forget_a_main_without_a_file()
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _context = ctx
    return _context


def _forget_a_main_without_a_file() -> None:
    """A script read from standard input (`python - <<EOF`) has `__file__` "<stdin>", a file that does not
    exist: multiprocessing would have every child run it as the main script, and each would fail before
    reaching mbtune. The children need nothing of such a script (their targets live in mbtune), so they are
    told of no main file, as for an interactive session or a notebook."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or getattr(main, "__spec__", None) is not None:
        return
    if not os.path.isfile(path):
        del main.__file__


def _child_main(conn: multiprocessing.connection.Connection, target: Callable[..., Any], args: tuple,
                stderr_path: str) -> None:
    capture_stderr(stderr_path)
    os.setpgid(0, 0)
    die_with_parent(group=True)
    try:
        payload: tuple[str, Any] = (OK, target(*args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as data
        payload = (ERROR, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip())
    conn.send(payload)
    conn.close()


def die_with_parent(*, group: bool = False) -> None:
    """Make this child die with the mbtune process that started it, so killing mbtune -9 leaves nothing
    running. Children of a forkserver hold the server alive, so the kernel's parent-death signal alone
    would never fire: a watcher thread waits on multiprocessing's sentinel for the requesting process."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the watcher below still works
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.killpg(0, signal.SIGKILL) if group else os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="mbtune-die-with-parent", daemon=True).start()


def run_isolated(target: Callable[..., Any], *args: Any, timeout_s: float,
                 started: Callable[[], Any] | None = None) -> ChildResult:
    """Call target(*args) in a fresh process and return its value, or how the process ended and whose
    fault that was. What the child writes to stderr is kept (its tail) and passed on to this stderr."""
    exit_if_bootstrapping()
    with tempfile.TemporaryDirectory(prefix="mbtune-trial-") as tmp:
        stderr_path = os.path.join(tmp, "stderr")
        status, value, exitcode, wall_s = _run_child(target, args, stderr_path, timeout_s, started)
        began, stderr = read_child_stderr(stderr_path)
    return _child_result(status, value, exitcode, wall_s, began, stderr, timeout_s)


def run_beside(background: Callable[..., Any], background_args: tuple, target: Callable[..., Any], *args: Any,
               timeout_s: float, grace_s: float = 10.0,
               handed_over: tuple[multiprocessing.connection.Connection, ...] = (),
               target_handed_over: tuple[multiprocessing.connection.Connection, ...] = ()) -> tuple[ChildResult, ChildResult]:
    """Start background(*background_args) in a fresh process, then call target(*args) in another, as
    run_isolated does; once target has returned, give the background process `grace_s` to return too (the
    target tells it to, e.g. over a pipe passed to both), then kill it. (target's result, background's).

    `handed_over`: this process's copies of pipe ends that the background process now holds alone; they
    are closed once it has started, so the target sees the pipe close if the background process dies.
    `target_handed_over`: the same for the target's, so the background process sees the target die."""
    exit_if_bootstrapping()
    with tempfile.TemporaryDirectory(prefix="mbtune-beside-") as tmp:
        stderr_path = os.path.join(tmp, "stderr")
        ctx = process_context()
        receiver, sender = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_child_main, args=(sender, background, background_args, stderr_path),
                              daemon=False)
        started = time.perf_counter()
        process.start()
        sender.close()
        _close_all(handed_over)
        try:
            front = run_isolated(target, *args, timeout_s=timeout_s,
                                 started=lambda: _close_all(target_handed_over))
            status: str | None = TIMEOUT
            value: Any = None
            if receiver.poll(grace_s):
                try:
                    status, value = receiver.recv()
                except EOFError:
                    status = None
            process.join(_GRACE_S if status != TIMEOUT else 0)
        finally:
            _kill_group(process)
            receiver.close()
        began, stderr = read_child_stderr(stderr_path)
    back = _child_result(status, value, process.exitcode, time.perf_counter() - started, began, stderr, grace_s)
    return front, back


def _close_all(connections: tuple[multiprocessing.connection.Connection, ...]) -> None:
    for connection in connections:
        connection.close()


def _child_result(status: str | None, value: Any, exitcode: int | None, wall_s: float, began: bool, stderr: str,
                  timeout_s: float) -> ChildResult:
    forward_stderr(stderr)
    stderr_tail = tail_lines(stderr)
    if status == OK:
        return ChildResult(status=OK, value=value, exitcode=exitcode, wall_s=wall_s, stderr_tail=stderr_tail)
    if status == ERROR:
        return ChildResult(status=ERROR, error=value, exitcode=exitcode, wall_s=wall_s, error_kind=WORKLOAD_FAULT,
                           error_tail=failure_tail(value, stderr), stderr_tail=stderr_tail)
    if status == TIMEOUT:
        why = "" if began else " (the trial never began: the worker process was still starting)"
        return ChildResult(status=TIMEOUT, error=f"no result within the {timeout_s:g} s deadline; killed{why}",
                           exitcode=exitcode, wall_s=wall_s, error_kind=WORKLOAD_FAULT if began else HARNESS_FAULT,
                           error_tail=failure_tail("", stderr), stderr_tail=stderr_tail)
    return _died(exitcode, wall_s, began=began, stderr=stderr)


def _run_child(target: Callable[..., Any], args: tuple, stderr_path: str, timeout_s: float,
               started: Callable[[], Any] | None = None) -> tuple[str | None, Any, int | None, float]:
    """(status or None when the child died without a word, its payload, exit code, wall seconds)."""
    ctx = process_context()
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child_main, args=(sender, target, args, stderr_path), daemon=False)
    began_at = time.perf_counter()
    process.start()
    sender.close()
    if started is not None:
        started()
    try:
        if receiver.poll(timeout_s):
            try:
                status, value = receiver.recv()
            except EOFError:  # the child died without a word: killed (OOM killer) or crashed
                status, value = None, None
        else:
            status, value = TIMEOUT, None
        process.join(_GRACE_S if status != TIMEOUT else 0)
    finally:
        _kill_group(process)
        receiver.close()
    return status, value, process.exitcode, time.perf_counter() - began_at


def _died(exitcode: int | None, wall_s: float, *, began: bool = True, stderr: str = "") -> ChildResult:
    """A child that ended without a result: killed by a signal, or exited. One that never began the trial
    (no stderr capture of its own yet) failed in mbtune's process start-up, not in the workload."""
    tail, kind = failure_tail("", stderr), WORKLOAD_FAULT if began else HARNESS_FAULT
    if exitcode == MAIN_GUARD_EXIT_CODE or _BOOTSTRAP_SIGN in stderr:
        return ChildResult(status=ERROR, error=MAIN_GUARD_MESSAGE, exitcode=exitcode, wall_s=wall_s,
                           error_kind=HARNESS_FAULT, error_tail=tail, stderr_tail=tail_lines(stderr))
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = " (as the kernel's OOM killer does)" if exitcode == -signal.SIGKILL else ""
        return ChildResult(status=KILLED, error=f"trial process was killed by {name}{why}", exitcode=exitcode,
                           wall_s=wall_s, error_kind=kind, error_tail=tail, stderr_tail=tail_lines(stderr))
    where = ("while running the trial" if began
             else "before the trial began (the worker process failed to start; the workload never ran)")
    return ChildResult(status=ERROR, error=f"trial process exited with code {exitcode} {where}, with no result",
                       exitcode=exitcode, wall_s=wall_s, error_kind=kind, error_tail=tail,
                       stderr_tail=tail_lines(stderr))


def exit_if_bootstrapping() -> None:
    """In a worker process that is still importing the main script, end it at once with
    MAIN_GUARD_EXIT_CODE: the script called mbtune at import time, outside `if __name__ == "__main__":`,
    and starting a process from here would fail with multiprocessing's bootstrapping RuntimeError (and
    each further child would import the script again)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        os._exit(MAIN_GUARD_EXIT_CODE)


def capture_stderr(path: str) -> None:
    """Send this process's stderr (fd 2, so C++ and CUDA messages too) to a new file at `path`. The file
    existing tells the parent that the child got as far as its own code."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)
    quiet_library_logs()  # the child's stderr carries the user's words and mbtune's, not torch's loggers


def read_child_stderr(path: str) -> tuple[bool, str]:
    """(whether the child began, what it wrote to stderr) from the file capture_stderr made."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return True, file.read()
    except FileNotFoundError:
        return False, ""


def forward_stderr(text: str) -> None:
    """Pass a child's stderr on to this process's, as if the child had written there itself."""
    if text:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()


def tail_lines(text: str, lines: int = ERROR_TAIL_LINES) -> str:
    """The last `lines` lines of a text, trailing blank lines dropped. A traceback cut short keeps its
    first line, so it still reads as one."""
    kept = text.rstrip().splitlines()
    if len(kept) <= lines:
        return "\n".join(kept)
    if kept[0].startswith("Traceback"):
        return "\n".join([kept[0], "  ...", *kept[-(lines - 2):]])
    return "\n".join(kept[-lines:])


def failure_tail(traceback_text: str = "", stderr: str = "") -> str:
    """What a record keeps of a failure: the last lines of its traceback, then of the process's stderr."""
    parts = [tail_lines(traceback_text)]
    if stderr.strip():
        parts.append("stderr:\n" + tail_lines(stderr))
    return "\n".join(part for part in parts if part)


def _kill_group(process: multiprocessing.process.BaseProcess) -> None:
    """SIGTERM then SIGKILL the child's whole process group, then reap the child."""
    pid = process.pid
    if pid is None:
        return
    for sig, wait_s in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, _GRACE_S)):
        if not _group_alive(pid):
            break
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        except PermissionError:  # the child has not made its own group yet
            process.kill() if sig == signal.SIGKILL else process.terminate()
        deadline = time.monotonic() + wait_s
        while _group_alive(pid) and time.monotonic() < deadline:
            process.join(0.05)
    process.join(_GRACE_S)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
