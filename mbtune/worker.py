"""Run work in a fresh process under a deadline; nothing leaks into the next trial.

Trial processes are forked from a forkserver that has imported torch (and mbtune.trial) but touched no
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
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mbtune.config import TrialConfig
from mbtune.records import ERROR, KILLED, OK, TIMEOUT, TrialOutcome

# torch._dynamo is what an optimizer's first construction imports (about 2 s); paying it once here
# keeps it out of every trial. None of these start threads or touch a device.
_PRELOAD = ["torch", "torch._dynamo", "mbtune.trial", "mbtune.pipeline.runner", "mbtune.workloads.gpt",
            "mbtune.workloads.mlp"]
_context: multiprocessing.context.BaseContext | None = None
_GRACE_S = 3.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, kw_only=True)
class ChildResult:
    """What came back from a child: its value, or why there is none."""

    status: str  # ok | error | timeout | killed
    value: Any = None
    error: str = ""
    exitcode: int | None = None
    wall_s: float = 0.0


def process_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context of the process-wide forkserver, with torch preloaded."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _context = ctx
    return _context


def _child_main(conn: multiprocessing.connection.Connection, target: Callable[..., Any], args: tuple) -> None:
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


def run_isolated(target: Callable[..., Any], *args: Any, timeout_s: float) -> ChildResult:
    """Call target(*args) in a fresh process and return its value, or how the process ended."""
    ctx = process_context()
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child_main, args=(sender, target, args), daemon=False)
    started = time.perf_counter()
    process.start()
    sender.close()
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
    wall_s = time.perf_counter() - started
    if status == OK:
        return ChildResult(status=OK, value=value, exitcode=process.exitcode, wall_s=wall_s)
    if status == ERROR:
        return ChildResult(status=ERROR, error=value, exitcode=process.exitcode, wall_s=wall_s)
    if status == TIMEOUT:
        return ChildResult(status=TIMEOUT, error=f"no result within the {timeout_s:g} s deadline; killed",
                           exitcode=process.exitcode, wall_s=wall_s)
    return _died(process.exitcode, wall_s)


def _died(exitcode: int | None, wall_s: float) -> ChildResult:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = " (as the kernel's OOM killer does)" if exitcode == -signal.SIGKILL else ""
        return ChildResult(status=KILLED, error=f"trial process was killed by {name}{why}",
                           exitcode=exitcode, wall_s=wall_s)
    return ChildResult(status=ERROR, error=f"trial process exited with code {exitcode} and no result",
                       exitcode=exitcode, wall_s=wall_s)


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


def run_trial(config: TrialConfig, *, timeout_s: float) -> TrialOutcome:
    """One isolated training trial; always returns a TrialOutcome, whatever happens."""
    from mbtune.trial import run_training_trial

    result = run_isolated(run_training_trial, config, timeout_s=timeout_s)
    if result.status == OK:
        return result.value
    return TrialOutcome(status=result.status, batch_size=config.batch_size, wall_s=result.wall_s,
                        error=result.error)
