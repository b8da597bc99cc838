"""Start one process per rank for one pipelined point, collect their reports, and enforce a deadline.

No torch import here: the parent can plan and launch without it. Rank processes come from a forkserver
that has torch and the runner preloaded (a clean parent: no device touched, no threads started), so a rank
starts in a fraction of a second instead of importing torch afresh. Ranks stay in the caller's process
group, so whoever kills the caller's group kills them too; each also dies with its parent (Linux
PR_SET_PDEATHSIG) so nothing outlives a killed launcher.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_module
import signal
import tempfile
import time
import traceback
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from typing import Any

from mbtune.pipeline.spec import PipelineSpec
from mbtune.pipeline.timeline import PipelineOutcome, StageReport
from mbtune.records import ERROR, KILLED, OK, OOM, TIMEOUT

# Test-only: the rank named here sleeps before its first step, so tests can watch the deadline kill it.
HANG_RANK_ENV = "MBTUNE_PIPELINE_TEST_HANG_RANK"
START_METHODS = ("forkserver", "spawn")
_POLL_S = 0.2
_EXIT_WAIT_S = 10.0  # how long finished ranks get to exit on their own after reporting
_SETTLE_S = 2.0  # after a first failure, how long the other ranks get to report theirs
_FAILURE_PRIORITY = {KILLED: 0, OOM: 1, ERROR: 2}

Message = tuple[str, int, Any, str]  # (status, rank, pickled report or one-line error, traceback)


def run_pipeline_point(
    spec: PipelineSpec, *, timeout_s: float = 300.0, start_method: str = "forkserver", grace_s: float = 3.0
) -> PipelineOutcome:
    """Run one point on `spec.num_ranks` fresh processes and return every rank's report, or why not.

    Status: ok, oom (a rank ran out of memory), error (a rank raised), killed (a rank died by SIGKILL without
    a word, e.g. the kernel's OOM killer), timeout (the deadline passed). When several ranks fail, the root
    cause is named (killed, then oom, then the first error), not the peers' "connection closed". Whatever
    happens, every rank is gone on return: SIGTERM, then SIGKILL after `grace_s`. The deadline starts once
    every rank process exists.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    context = _context(start_method)
    hang_rank = _hang_rank_from_env()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mbtune-pp-") as tmp:
        messages = context.Queue()
        procs = [
            context.Process(target=_rank_main, name=f"mbtune-pp-rank{rank}", daemon=True,
                            args=(spec, rank, os.path.join(tmp, "store"), messages, hang_rank))
            for rank in range(spec.num_ranks)
        ]
        outcome = PipelineOutcome(status=ERROR, error="the launcher failed before collecting results")
        try:
            for proc in procs:
                proc.start()  # the first start may wait for the forkserver to import torch: not the point's time
            outcome = _collect(procs, messages, deadline=time.monotonic() + timeout_s, timeout_s=timeout_s)
        finally:
            _stop(procs, wait_s=_EXIT_WAIT_S if outcome.ok else 0.0, grace_s=grace_s)
            messages.close()
            messages.cancel_join_thread()
    return PipelineOutcome(
        status=outcome.status, reports=outcome.reports, error=outcome.error, error_detail=outcome.error_detail,
        wall_s=time.monotonic() - started, exit_codes=tuple(proc.exitcode for proc in procs),
        pids=tuple(proc.pid for proc in procs if proc.pid is not None),
    )


def _context(start_method: str) -> Any:
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
    if start_method == "forkserver":
        from mbtune.worker import process_context

        return process_context()  # the one torch-preloaded forkserver trials use too
    return multiprocessing.get_context(start_method)


def _hang_rank_from_env() -> int | None:
    value = os.environ.get(HANG_RANK_ENV, "").strip()
    return int(value) if value else None


def _collect(procs: Sequence[BaseProcess], messages: Any, *, deadline: float, timeout_s: float) -> PipelineOutcome:
    reports: dict[int, StageReport] = {}
    while len(reports) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(procs))) - set(reports))
            return PipelineOutcome(status=TIMEOUT, error=f"rank(s) {missing} still running after {timeout_s:g} s")
        message = _next_message(procs, messages, set(reports), wait_s=min(remaining, _POLL_S))
        if message is None:
            continue
        if message[0] != OK:
            return _root_cause(procs, messages, set(reports), message)
        reports[message[1]] = pickle.loads(message[2])
    return PipelineOutcome(status=OK, reports=tuple(reports[r] for r in range(len(procs))))


def _root_cause(procs: Sequence[BaseProcess], messages: Any, done: set[int], first: Message) -> PipelineOutcome:
    """When one rank fails its peers fail too ("connection closed by peer"), sometimes first. Give every rank
    a moment to report or die, then name the most telling failure: killed, then OOM, then the first error."""
    failures = [first]
    settle_end = time.monotonic() + _SETTLE_S
    while time.monotonic() < settle_end and len(done) + len(failures) < len(procs):
        accounted = done | {f[1] for f in failures}
        message = _next_message(procs, messages, accounted, wait_s=_POLL_S)
        if message is not None and message[0] != OK:
            failures.append(message)
    status, rank, text, detail = min(failures, key=lambda f: _FAILURE_PRIORITY.get(f[0], len(_FAILURE_PRIORITY)))
    return PipelineOutcome(status=status, error=f"rank {rank}: {text}", error_detail=detail)


def _next_message(procs: Sequence[BaseProcess], messages: Any, accounted: set[int], *, wait_s: float) -> Message | None:
    """The next message, else one standing for a rank that exited without reporting, else None."""
    try:
        return messages.get(timeout=wait_s)
    except queue_module.Empty:
        pass
    dead = [(rank, proc.exitcode) for rank, proc in enumerate(procs)
            if rank not in accounted and proc.exitcode is not None]
    if not dead:
        return None
    try:
        return messages.get(timeout=1.0)  # it may have reported just before exiting
    except queue_module.Empty:
        pass
    rank, code = dead[0]
    if code == -signal.SIGKILL:
        return (KILLED, rank, "killed by SIGKILL (the kernel's OOM killer, or someone else)", "")
    return (ERROR, rank, f"exited with code {code} without a report", "")


def _stop(procs: Sequence[BaseProcess], *, wait_s: float, grace_s: float) -> None:
    """Let ranks exit by themselves for wait_s, then SIGTERM, then SIGKILL; reap them all."""
    started = [proc for proc in procs if proc.pid is not None]
    _join_all(started, wait_s)
    for proc in started:
        if proc.is_alive():
            proc.terminate()
    _join_all(started, grace_s)
    for proc in started:
        if proc.is_alive():
            proc.kill()
    _join_all(started, None)


def _join_all(procs: Sequence[BaseProcess], within_s: float | None) -> None:
    end = None if within_s is None else time.monotonic() + within_s
    for proc in procs:
        proc.join(None if end is None else max(0.0, end - time.monotonic()))


def _rank_main(spec: PipelineSpec, rank: int, store_path: str, messages: Any, hang_rank: int | None) -> None:
    """Entry point of a rank process: run, then send (status, rank, payload, traceback) and flush."""
    from mbtune.worker import die_with_parent

    # Ctrl-C reaches the whole terminal process group; the launcher decides what happens to ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    try:
        from mbtune.pipeline.runner import run_rank

        report = run_rank(spec, rank=rank, store_path=store_path, hang_rank=hang_rank)
        # Pickled here with plain pickle: tensors then travel by value, not as shared memory that would
        # need this process alive when the parent unpickles.
        message = (OK, rank, pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL), "")
    except BaseException as exc:  # every failure becomes a message; the parent decides what it means
        status = OOM if _is_oom(exc) else ERROR
        message = (status, rank, _one_line(exc), traceback.format_exc())
    messages.put(message)
    messages.close()
    messages.join_thread()


def _one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, plus the cause's, since torch wraps stage failures."""
    parts = []
    for item in (exc, exc.__cause__):
        if item is not None:
            lines = [line.strip() for line in str(item).splitlines() if line.strip()]
            parts.append(f"{type(item).__name__}: {lines[0] if lines else ''}".rstrip(": "))
    return " (caused by ".join(parts)[:500] + (")" if len(parts) > 1 else "")


def _is_oom(exc: BaseException) -> bool:
    from mbtune.device import classify_error

    return classify_error(exc) == OOM
