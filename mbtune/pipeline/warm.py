"""Rank processes kept between points: one set per placement, its process group made once.

A fresh set of processes per repeat pays, every time, a fork, the process group (on a GPU a CUDA context and
an NCCL communicator: seconds), and the allocator's first growth. `WarmRanks` starts a point's ranks from the
same torch-preloaded forkserver as pipeline/launch.py, joins them into their group once, and then hands them
point after point: each point loads the workload and builds its stages afresh, with the memory count (CPU)
or the allocator's peak statistics (CUDA, its cache emptied first) started from nothing. On the CPU a point
the set has counted once runs uncounted after that (the count's per-operator cost would slow its warm-up;
the same program counts the same bytes): its peak is None there, and the point's is its counted repeat's.
It also runs primed (pipeline/schedules.py prime_schedule): torch's first-step setup done before the steps in
place of the warm-up step, which in a process that ran the point before adds nothing else (its first step
measures as the following ones). On CUDA every repeat keeps its warm-up step: the cache emptied for the
peak's sake is refilled by it. A set is started afresh where the placement differs (processes, device,
threads, pinning), and after any failure: a rank that ran out of memory, raised, died or ran past the
deadline takes its whole set down with it, since a process that caught an out-of-memory measures garbage
afterwards.

No torch import here, as in pipeline/launch.py.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from typing import Any

from mbtune.pipeline.launch import (
    EXIT_WAIT_S,
    collect,
    failure_detail,
    freeze_imports,
    hang_rank_from_env,
    local_ranks,
    rank_message,
    start_context,
    stderr_file,
    stop_processes,
)
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.timeline import PipelineOutcome
from mbtune.records import ERROR, OK
from mbtune.worker import capture_stderr, exit_if_bootstrapping, forward_stderr


@dataclass(frozen=True)
class Placement:
    """What a set of rank processes is fixed to once started: points that agree on it share the set."""

    world_size: int
    device: str
    threads: int | None
    pin_cpus: bool
    pg_timeout_s: float

    @classmethod
    def of(cls, spec: PipelineSpec) -> Placement:
        return cls(world_size=spec.world_size, device=spec.device, threads=spec.threads, pin_cpus=spec.pin_cpus,
                   pg_timeout_s=spec.pg_timeout_s)


class WarmRanks:
    """Rank processes kept between points; `run` is run_pipeline_point's equivalent, `close` ends them.

    `starts` counts the sets started (one per placement, plus one after each failure)."""

    def __init__(self, *, start_method: str = "forkserver", grace_s: float = 3.0) -> None:
        self.start_method, self.grace_s = start_method, grace_s
        self.placement: Placement | None = None
        self.procs: list[BaseProcess] = []
        self.inboxes: list[Any] = []
        self.messages: Any = None
        self.tmp: tempfile.TemporaryDirectory[str] | None = None
        self.read_to: list[int] = []
        self.counted: set[PipelineSpec] = set()  # the points this set counted the memory of (CPU)
        self.starts = 0

    def __enter__(self) -> WarmRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, spec: PipelineSpec, *, timeout_s: float = 300.0) -> PipelineOutcome:
        """Run one point on this placement's kept processes (started first where there are none, or where
        they belong to another placement) and return every process's report, or why not, as
        pipeline/launch.py's run_pipeline_point does. On failure the processes are gone on return."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        exit_if_bootstrapping()
        started = time.monotonic()
        if self.procs and (self.placement != Placement.of(spec) or any(p.exitcode is not None for p in self.procs)):
            self.close(wait_s=0.0)  # another placement, or a rank that died between points
        fresh = not self.procs
        if fresh:
            self._start(spec)
        # On the CPU, a point this set counted before runs uncounted (the count slows the step it watches, and
        # the same program counts the same bytes): its peak is the counted repeat's. It runs primed too: these
        # processes ran it before, so torch's first-step setup done ahead is all a warm-up step would add.
        point = replace(spec, warmup_steps=0, measured_steps=1, count_memory=True, primed=False)
        if spec.device == "cpu" and point in self.counted:
            spec = replace(spec, count_memory=False, primed=True)
        assert self.tmp is not None
        tmp = self.tmp.name
        ranks = local_ranks(self.procs, tmp)
        hang_rank = hang_rank_from_env()
        outcome = PipelineOutcome(status=ERROR, error="the launcher failed before collecting results")
        try:
            for inbox in self.inboxes:
                inbox.put((spec, hang_rank))
            outcome = collect(ranks, self.messages, deadline=time.monotonic() + timeout_s, timeout_s=timeout_s)
        finally:
            pids = tuple(proc.pid for proc in self.procs if proc.pid is not None)
            if not outcome.ok:  # its peers wait in collectives: stopped at once, what they wrote read after
                stop_processes(self.procs, wait_s=0.0, grace_s=self.grace_s)
            elif spec.count_memory:
                self.counted.add(point)
            codes = tuple(proc.exitcode for proc in self.procs)
            stderr = self._new_stderr()
            if not outcome.ok:
                self.close(wait_s=0.0)
        for text in stderr:
            forward_stderr(text)
        return replace(outcome, wall_s=time.monotonic() - started, exit_codes=codes, pids=pids,
                       error_detail=failure_detail(outcome, stderr), fresh_processes=fresh)

    def _start(self, spec: PipelineSpec) -> None:
        context = start_context(self.start_method)
        self.tmp = tempfile.TemporaryDirectory(prefix="mbtune-warm-")
        self.placement = Placement.of(spec)
        self.messages = context.Queue()
        self.inboxes = [context.Queue() for _ in range(spec.world_size)]
        store = os.path.join(self.tmp.name, "store")
        self.procs = [context.Process(target=_warm_rank_main, name=f"mbtune-warm-rank{rank}", daemon=True,
                                      args=(rank, store, self.inboxes[rank], self.messages,
                                            stderr_file(self.tmp.name, rank)))
                      for rank in range(spec.world_size)]
        self.read_to = [0] * spec.world_size
        self.counted = set()
        for proc in self.procs:
            proc.start()
        self.starts += 1

    def _new_stderr(self) -> list[str]:
        """What each rank wrote to stderr since the last point."""
        texts = []
        for rank in range(len(self.procs)):
            assert self.tmp is not None
            try:
                with open(stderr_file(self.tmp.name, rank), "rb") as file:
                    file.seek(self.read_to[rank])
                    data = file.read()
            except FileNotFoundError:
                data = b""
            self.read_to[rank] += len(data)
            texts.append(data.decode("utf-8", errors="replace"))
        return texts

    def close(self, wait_s: float = EXIT_WAIT_S) -> None:
        """End the kept processes (asked, given `wait_s` to end, then SIGTERM, then SIGKILL) and forget their
        placement."""
        if self.procs:
            for inbox, proc in zip(self.inboxes, self.procs):
                if proc.exitcode is None:
                    inbox.put(None)
            stop_processes(self.procs, wait_s=wait_s, grace_s=self.grace_s)
            for queue in (*self.inboxes, self.messages):
                queue.close()
                queue.cancel_join_thread()
        if self.tmp is not None:
            self.tmp.cleanup()
        self.procs, self.inboxes, self.messages, self.tmp, self.placement = [], [], None, None, None


def _warm_rank_main(rank: int, store_path: str, inbox: Any, messages: Any, stderr_path: str) -> None:
    """A kept rank: join the group with the first point, then run point after point until told to stop
    (None) or until a point fails here (its set is then started afresh)."""
    from mbtune.pipeline.rank_group import join_group, leave_group
    from mbtune.pipeline.runner import run_joined
    from mbtune.worker import die_with_parent

    capture_stderr(stderr_path)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides what happens to ranks
    die_with_parent()
    freeze_imports()  # each point's own collection skips what the forkserver imported
    joined = None

    def run(spec: PipelineSpec, *, rank: int, store_path: str | None, hang_rank: int | None, on_placed: Any) -> Any:
        nonlocal joined
        if joined is None:
            joined = join_group(spec, rank=rank, store_path=store_path)
        return run_joined(spec, joined, hang_rank=hang_rank, on_placed=on_placed)

    while (item := inbox.get()) is not None:
        spec, hang_rank = item
        message = rank_message(spec, rank, store_path, messages.put, hang_rank, run=run)
        messages.put(message)
        if message[0] != OK:
            break
    else:
        if joined is not None:
            leave_group()
    messages.close()
    messages.join_thread()
