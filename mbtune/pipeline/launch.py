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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess
from typing import Any

from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.timeline import PipelineOutcome, StageReport
from mbtune.records import ERROR, HARNESS_FAULT, KILLED, NONFINITE, OK, OOM, TIMEOUT, WORKLOAD_FAULT
from mbtune.worker import (
    MAIN_GUARD_EXIT_CODE,
    MAIN_GUARD_MESSAGE,
    capture_stderr,
    exit_if_bootstrapping,
    failure_tail,
    forward_stderr,
    read_child_stderr,
    tail_lines,
)

# Test-only: the rank named here sleeps before its first step, so tests can watch the deadline kill it.
HANG_RANK_ENV = "MBTUNE_PIPELINE_TEST_HANG_RANK"
START_METHODS = ("forkserver", "spawn")
_POLL_S = 0.2
EXIT_WAIT_S = 10.0  # how long finished ranks get to exit on their own after reporting
_SETTLE_S = 2.0  # after a first failure, how long the other ranks get to report theirs
# A peer of a failing rank fails too ("connection closed"): the most telling failure is named.
_FAILURE_PRIORITY = {KILLED: 0, OOM: 1, NONFINITE: 2, ERROR: 3}
PLACED = "placed"  # a rank's first message: the global block indices it holds

# (status, rank, pickled report | one-line error | block indices, traceback). Messages the launcher makes
# up for a rank that died without a word carry a fifth item: whose fault (records.ERROR_KINDS).
Message = tuple[Any, ...]


@dataclass
class Ranks:
    """The launcher's view of one point's ranks: how many, whether each got as far as its own code, how
    each exited (None while it runs, or where it cannot be known yet), and the blocks each said it holds.
    This host's processes here; under torchrun, ranks on every node, as the shared store tells
    (pipeline/torchrun.py)."""

    count: int
    began: Callable[[int], bool]
    exitcode: Callable[[int], int | None]
    placed: dict[int, tuple[int, ...]] = field(default_factory=dict)


def local_ranks(procs: Sequence[BaseProcess], tmp: str) -> Ranks:
    # A rank made its stderr file first thing: the file says it began.
    return Ranks(count=len(procs), began=lambda rank: os.path.exists(stderr_file(tmp, rank)),
                 exitcode=lambda rank: procs[rank].exitcode)


def run_pipeline_point(
    spec: PipelineSpec, *, timeout_s: float = 300.0, start_method: str = "forkserver", grace_s: float = 3.0
) -> PipelineOutcome:
    """Run one point on `spec.world_size` fresh processes (pipeline ranks x data-parallel replicas) and
    return every process's report, or why not.

    Status: ok, oom (a rank ran out of memory), nonfinite (the loss was NaN or infinite), error (a rank
    raised), killed (a rank died by SIGKILL without a word, e.g. the kernel's OOM killer), timeout (the
    deadline passed). When several ranks fail, the root cause is named (killed, then oom, then nonfinite,
    then the first error), not the peers' "connection closed", with the blocks it holds and the last lines
    of its traceback and stderr. What the ranks write to stderr is passed on to this process's stderr.
    Whatever happens, every rank is gone on return: SIGTERM, then SIGKILL after `grace_s`. The deadline
    starts once every rank process exists.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    exit_if_bootstrapping()
    context = start_context(start_method)
    hang_rank = hang_rank_from_env()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mbtune-pp-") as tmp:
        messages = context.Queue()
        procs = [
            context.Process(target=_rank_main, name=f"mbtune-pp-rank{rank}", daemon=True,
                            args=(spec, rank, os.path.join(tmp, "store"), messages, hang_rank,
                                  stderr_file(tmp, rank)))
            for rank in range(spec.world_size)
        ]
        ranks = local_ranks(procs, tmp)
        outcome = PipelineOutcome(status=ERROR, error="the launcher failed before collecting results")
        try:
            for proc in procs:
                proc.start()  # the first start may wait for the forkserver to import torch: not the point's time
            outcome = collect(ranks, messages, deadline=time.monotonic() + timeout_s, timeout_s=timeout_s)
        finally:
            stop_processes(procs, wait_s=EXIT_WAIT_S if outcome.ok else 0.0, grace_s=grace_s)
            messages.close()
            messages.cancel_join_thread()
        stderr = [read_child_stderr(stderr_file(tmp, rank))[1] for rank in range(len(procs))]
    for text in stderr:
        forward_stderr(text)
    return replace(outcome, wall_s=time.monotonic() - started, exit_codes=tuple(proc.exitcode for proc in procs),
                   pids=tuple(proc.pid for proc in procs if proc.pid is not None),
                   error_detail=failure_detail(outcome, stderr))


def stderr_file(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"rank{rank}.stderr")


def failure_detail(outcome: PipelineOutcome, stderr: Sequence[str]) -> str:
    """The failing rank's traceback tail and stderr tail; on a timeout, every rank's stderr tail."""
    if outcome.ok:
        return ""
    if outcome.failed_rank is not None:
        return failure_tail(outcome.error_detail, stderr[outcome.failed_rank])
    tails = [f"rank {rank} " + failure_tail("", text) for rank, text in enumerate(stderr) if text.strip()]
    return "\n".join([failure_tail(outcome.error_detail), *tails]).strip()


def start_context(start_method: str) -> Any:
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
    if start_method == "forkserver":
        from mbtune.worker import process_context

        return process_context()  # the one torch-preloaded forkserver trials use too
    return multiprocessing.get_context(start_method)


def hang_rank_from_env() -> int | None:
    value = os.environ.get(HANG_RANK_ENV, "").strip()
    return int(value) if value else None


def collect(ranks: Ranks, messages: Any, *, deadline: float, timeout_s: float,
            settle_s: float = _SETTLE_S) -> PipelineOutcome:
    """Every rank's report from `messages` (a queue: get(timeout=) raising queue.Empty), or the root
    cause of the first failure (after `settle_s` for the others to report theirs), or a timeout at the
    deadline."""
    reports: dict[int, StageReport] = {}
    while len(reports) < ranks.count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return _timed_out(ranks, sorted(set(range(ranks.count)) - set(reports)), timeout_s)
        message = _next_message(ranks, messages, set(reports), wait_s=min(remaining, _POLL_S))
        if message is None:
            continue
        if message[0] != OK:
            return _root_cause(ranks, messages, set(reports), message, settle_s)
        reports[message[1]] = pickle.loads(message[2])
    return PipelineOutcome(status=OK, reports=tuple(reports[r] for r in range(ranks.count)))


def _timed_out(ranks: Ranks, missing: list[int], timeout_s: float) -> PipelineOutcome:
    """The deadline passed. Peers of a hung rank wait in collectives, so the culprit is named only when it
    is the one rank left; ranks that never got to their own code make it the harness's fault."""
    not_started = [rank for rank in missing if not ranks.began(rank)]
    why = f" ({not_started} never started)" if not_started else ""
    failed = missing[0] if len(missing) == 1 else None
    return PipelineOutcome(status=TIMEOUT, error=f"rank(s) {missing} still running after {timeout_s:g} s{why}",
                           failed_rank=failed, failed_blocks=ranks.placed.get(failed, ()) if failed is not None else (),
                           error_kind=HARNESS_FAULT if not_started else WORKLOAD_FAULT)


def _root_cause(ranks: Ranks, messages: Any, done: set[int], first: Message, settle_s: float) -> PipelineOutcome:
    """When one rank fails its peers fail too ("connection closed by peer"), sometimes first. Give every rank
    a moment to report or die, then name the most telling failure: killed, then OOM, then a non-finite
    loss, then the first error."""
    failures = [first]
    settle_end = time.monotonic() + settle_s
    while time.monotonic() < settle_end and len(done) + len(failures) < ranks.count:
        accounted = done | {f[1] for f in failures}
        message = _next_message(ranks, messages, accounted, wait_s=_POLL_S)
        if message is not None and message[0] != OK:
            failures.append(message)
    # A rank that never started says nothing of the workload, and is why its peers failed.
    harness = [f for f in failures if len(f) > 4 and f[4] == HARNESS_FAULT]
    status, rank, text, detail, *kind = harness[0] if harness else min(
        failures, key=lambda f: _FAILURE_PRIORITY.get(f[0], len(_FAILURE_PRIORITY)))
    blocks = ranks.placed.get(rank, ())
    where = f"rank {rank} (blocks {block_ranges(blocks)})" if blocks else f"rank {rank}"
    return PipelineOutcome(status=status, error=f"{where}: {text}", error_detail=detail, failed_rank=rank,
                           failed_blocks=blocks, error_kind=kind[0] if kind else WORKLOAD_FAULT)


def block_ranges(blocks: Sequence[int]) -> str:
    """Block indices as runs: (0, 1, 2, 6, 7) -> "0-2, 6-7"."""
    runs: list[list[int]] = []
    for block in blocks:
        if runs and block == runs[-1][-1] + 1:
            runs[-1].append(block)
        else:
            runs.append([block])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def _next_message(ranks: Ranks, messages: Any, accounted: set[int], *, wait_s: float) -> Message | None:
    """The next message, else one standing for a rank that exited without reporting, else None. A rank's
    placement is noted on the way and is no message of its own."""
    message = _get(ranks, messages, wait_s)
    if message is not None:
        return message
    dead = [(rank, code) for rank in range(ranks.count)
            if rank not in accounted and (code := ranks.exitcode(rank)) is not None]
    if not dead:
        return None
    message = _get(ranks, messages, 1.0)  # it may have reported just before exiting
    if message is not None:
        return message
    rank, code = dead[0]
    return _died_without_report(ranks, rank, code)


def _get(ranks: Ranks, messages: Any, wait_s: float) -> Message | None:
    end = time.monotonic() + wait_s
    while True:
        try:
            message = messages.get(timeout=max(0.0, end - time.monotonic()))
        except queue_module.Empty:
            return None
        if message[0] != PLACED:
            return message
        ranks.placed[message[1]] = tuple(message[2])


def _died_without_report(ranks: Ranks, rank: int, code: int | None) -> Message:
    """The message standing for a rank that exited without a word: killed, or died before it began (the
    harness's fault), or exited while it ran."""
    began = ranks.began(rank)
    kind = WORKLOAD_FAULT if began else HARNESS_FAULT
    if code == MAIN_GUARD_EXIT_CODE:
        return (ERROR, rank, MAIN_GUARD_MESSAGE, "", HARNESS_FAULT)
    if code == -signal.SIGKILL:
        return (KILLED, rank, "killed by SIGKILL (the kernel's OOM killer, or someone else)", "", kind)
    if not began:
        why = f"exited with code {code} before it began (the worker process failed to start; the workload never ran)"
        return (ERROR, rank, why, "", kind)
    return (ERROR, rank, f"exited with code {code} without a report", "", kind)


def stop_processes(procs: Sequence[BaseProcess], *, wait_s: float, grace_s: float) -> None:
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


def _rank_main(spec: PipelineSpec, rank: int, store_path: str, messages: Any, hang_rank: int | None,
               stderr_path: str) -> None:
    """Entry point of a rank process: run, then send (status, rank, payload, traceback) and flush. The
    first message, once known, is the blocks this rank holds."""
    from mbtune.worker import die_with_parent

    capture_stderr(stderr_path)
    # Ctrl-C reaches the whole terminal process group; the launcher decides what happens to ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    freeze_imports()
    messages.put(rank_message(spec, rank, store_path, messages.put, hang_rank))
    messages.close()
    messages.join_thread()


def freeze_imports() -> None:
    """Keep what the forkserver imported (torch's whole object graph) out of this process's garbage
    collections: a full collection over it takes about 0.1 s, and one that fell inside a timed step would add
    that to it. Fresh and kept ranks (pipeline/warm.py) alike, so both time the same steps."""
    import gc

    gc.freeze()


def rank_message(spec: PipelineSpec, rank: int, store_path: str | None, send: Callable[[Message], None],
                 hang_rank: int | None = None, run: Callable[..., Any] | None = None) -> Message:
    """Run one rank (pipeline/runner.py's run_rank, or `run`, called alike) and return its last message: its
    pickled report, or how it failed. `send` gets the first message, the blocks this rank holds, as soon as
    they are known."""
    from mbtune.errors import NonFiniteLossError

    try:
        from mbtune.pipeline.runner import run_rank

        report = (run or run_rank)(spec, rank=rank, store_path=store_path, hang_rank=hang_rank,
                     on_placed=lambda blocks: send((PLACED, rank, blocks, "")))
        # Pickled here with plain pickle: tensors then travel by value, not as shared memory that would
        # need this process alive when the parent unpickles.
        return (OK, rank, pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL), "")
    except NonFiniteLossError as exc:
        return (NONFINITE, rank, str(exc), _traceback_tail())
    except BaseException as exc:  # every failure becomes a message; the parent decides what it means
        status = OOM if _is_oom(exc) else ERROR
        return (status, rank, _one_line(exc), _traceback_tail())


def _traceback_tail() -> str:
    return tail_lines(traceback.format_exc())


def _one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, plus the cause's, since torch wraps stage failures."""
    parts = []
    for item in (exc, exc.__cause__):
        if item is not None:
            lines = [line.strip() for line in str(item).splitlines() if line.strip()]
            parts.append(f"{type(item).__name__}: {lines[0] if lines else ''}".rstrip(": "))
    return " (caused by ".join(parts) + (")" if len(parts) > 1 else "")


def _is_oom(exc: BaseException) -> bool:
    from mbtune.device import classify_error

    return classify_error(exc) == OOM
