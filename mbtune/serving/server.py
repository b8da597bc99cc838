"""Real load on a real server: a server process holds the model behind a dynamic batcher (batcher.py's
rules: one queue, requests served in order), and a load-generator process drives it over a pipe, with
Poisson arrivals at a rate (open loop) or a fixed number of requests in flight (closed loop), recording
every request's end-to-end latency.

Both processes come from the trial forkserver (worker.run_beside) and read the same monotonic clock, so
the server's stamps (arrived, batch began, batch ended) and the generator's (when the request was due,
when its answer came back) compare directly. Latency runs from when a request was due, not when it was
sent, so a generator that falls behind does not hide the wait (no coordinated omission).

Messages: generator -> server ("req", id) and ("end",); server -> generator ("ready", facts),
("done", [(id, arrived, began, ended), ...]) per batch and ("rejected", [id, ...]) for requests that
waited past the queue timeout.
"""

from __future__ import annotations

import math
import multiprocessing.connection
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mbtune.records import OK
from mbtune.serving import traffic as gen
from mbtune.serving.batcher import expired, next_batch
from mbtune.serving.records import BatchConfig, ConfigRun, LoadResult
from mbtune.serving.requests import Requests, finite, p99_half, summary, window

if TYPE_CHECKING:
    from mbtune.serving.infer import ModelSpec

Connection = multiprocessing.connection.Connection
POOL_SIZE = 256  # distinct request samples the server holds (requests cycle through them)
READ_LAG_S = 0.005  # a window is read this long after it ends, so answers stamped within it have been stored


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """The model a server process holds and the batcher it runs."""

    model: ModelSpec
    rules: BatchConfig
    queue_timeout_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class LoadPlan:
    """What the load generator runs against one server, in order."""

    rules: BatchConfig
    loads: tuple[tuple[str, float], ...]  # (poisson, rate per s) | (closed, concurrency)
    budget_s: float
    window_s: float = 1.0
    min_window_requests: int = 100  # an open-loop window lasts long enough to expect this many arrivals
    max_windows: int = 16
    min_requests: int = 0  # an open-loop load runs past max_windows, and does not stop, until it has this many
    stable_windows: int = gen.STABLE_WINDOWS
    stability: float = gen.STABILITY
    p99_target: float = gen.P99_TARGET  # past stability, windows until the p99's 95% interval is this narrow
    queue_timeout_s: float | None = None
    seed: int = 0
    stop_after_failure: bool = True  # poisson rates ascend: after the first over the budget, stop
    ready_timeout_s: float = 120.0
    cores: tuple[int, ...] = ()  # the load generator runs on these cores alone (): not pinned

    def window_of(self, kind: str, amount: float) -> float:
        """A window's length for one load: open loop, long enough to expect min_window_requests arrivals."""
        return max(self.window_s, self.min_window_requests / amount) if kind == gen.POISSON else self.window_s

    def requests_of(self, kind: str) -> int:
        """Requests one load measures before its p99 may count as known: min_requests open loop, none closed
        (a closed loop's windows count no arrivals: its pace is its own)."""
        return self.min_requests if kind == gen.POISSON else 0

    def windows_of(self, kind: str, amount: float) -> int:
        """The windows one load runs at most: max_windows, and as many as requests_of need."""
        needed = self.requests_of(kind)
        return max(self.max_windows, math.ceil(needed / (amount * self.window_of(kind, amount)))) if needed \
            else self.max_windows


def serve_requests(conn: Connection, spec: ServerSpec) -> dict[str, float]:
    """The server process: hold the model, batch requests by the rules, answer each batch."""
    from mbtune.serving.config import serve_threads

    pool = max(POOL_SIZE, spec.rules.max_batch_size)
    model = spec.model.served(pool_size=pool)
    threads = serve_threads(spec.model.threads)
    for size in sorted({1, *spec.rules.sizes, spec.rules.max_batch_size}):  # warm: first passes are slow
        for _ in range(2):
            model.run(model.gather(list(range(size))))
    queue: deque[tuple[int, float]] = deque()
    ready = threading.Condition()
    closed = threading.Event()

    def read() -> None:
        try:
            while True:
                message = conn.recv()
                if message[0] != "req":
                    break
                with ready:
                    queue.append((message[1], time.monotonic()))
                    ready.notify()
        except Exception:  # noqa: BLE001 - EOF (the generator has gone) or a bad message: either way, stop
            pass
        finally:
            closed.set()
            with ready:
                ready.notify()

    threading.Thread(target=read, name="mbtune-serve-reader", daemon=True).start()
    conn.send(("ready", {"threads": threads, "cores": _own_cores()}))
    batches = 0
    while True:
        batch, dropped = _next(spec, queue, ready, closed)
        if dropped:  # sent outside the lock: the reader keeps stamping arrivals meanwhile
            conn.send(("rejected", dropped))
        if batch is None:
            break
        if not batch:
            continue
        began = time.monotonic()
        model.run(model.gather([request_id % pool for request_id, _ in batch]))
        ended = time.monotonic()
        conn.send(("done", [(request_id, arrived, began, ended) for request_id, arrived in batch]))
        batches += 1
    return {"batches": batches, "cpu_s": time.process_time()}


def _next(spec: ServerSpec, queue: deque[tuple[int, float]], ready: threading.Condition,
          closed: threading.Event) -> tuple[list[tuple[int, float]] | None, list[int]]:
    """(the next batch the rules send, waiting as they say, or [] when requests expired meanwhile and must
    be rejected first, or None once the generator has gone; the ids of the expired requests)."""
    with ready:
        while True:
            now = time.monotonic()
            dropped = []
            while queue and expired(queue[0][1], now, spec.queue_timeout_s):
                dropped.append(queue.popleft()[0])
            if dropped:
                return [], dropped
            decision = next_batch(spec.rules, len(queue), queue[0][1] if queue else None, now)
            if decision.take:
                return [queue.popleft() for _ in range(decision.take)], []
            if closed.is_set():
                return None, []
            wait = None if decision.wait_until is None else max(0.0, decision.wait_until - now)
            if queue and spec.queue_timeout_s is not None:
                timeout_at = queue[0][1] + spec.queue_timeout_s - now
                wait = timeout_at if wait is None else min(wait, timeout_at)
            ready.wait(timeout=None if wait is None else max(wait, 0.0) + 1e-4)


class _Generator:
    """The load generator's side of the pipe: one reader thread for the whole session."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.requests = Requests()
        self.on_answer: Any = None  # closed loop: called with the time of each answer, to send the next
        self.next_id = 0
        self.failed = threading.Event()
        self.error = ""
        self._send_lock = threading.Lock()

    def start(self, ready_timeout_s: float) -> dict[str, Any]:
        if not self.conn.poll(ready_timeout_s):
            raise TimeoutError(f"the server was not ready within {ready_timeout_s:g} s")
        kind, facts = self.conn.recv()  # EOFError: the server died while starting
        threading.Thread(target=self._read, name="mbtune-load-reader", daemon=True).start()
        return facts

    def send(self, due: float) -> None:
        with self._send_lock:
            request_id = self.next_id
            self.next_id += 1
            with self.requests.lock:
                self.requests.due[request_id] = due
            self.conn.send(("req", request_id))

    def never_sent(self, requests: Requests, due_times: list[float]) -> None:
        """Requests that were due but that a lagging sender never sent: lost, not left out."""
        with self._send_lock, requests.lock:
            for due in due_times:
                requests.due[self.next_id] = due
                self.next_id += 1
            requests.unsent += len(due_times)

    def end(self) -> None:
        with self._send_lock:
            try:
                self.conn.send(("end",))
            except OSError:
                pass

    def _read(self) -> None:
        try:
            while True:
                kind, items = self.conn.recv()
                now = time.monotonic()
                requests = self.requests
                settled = 0
                with requests.lock:
                    # Answers to an earlier load's stragglers (ids never reused) are not this load's.
                    if kind == "done":
                        for request_id, arrived, began, ended in items:
                            if request_id in requests.due:
                                requests.answered[request_id] = (now, arrived, began, ended, len(items))
                                settled += 1
                    else:
                        for request_id in items:
                            if request_id in requests.due:
                                requests.rejected[request_id] = now
                                settled += 1
                    requests.settled.notify_all()
                callback = self.on_answer  # read once: the load may end (and clear it) meanwhile
                if callback is not None:  # closed loop: each request of this load settled makes room for one
                    for _ in range(settled):
                        callback(now)
        except Exception as exc:  # noqa: BLE001 - EOF (the server has gone) or a bad message: stop the loads
            self.error = f"the server stopped answering ({type(exc).__name__}: {exc})" if not isinstance(
                exc, EOFError) else "the server stopped answering (its process ended)"
        finally:
            self.failed.set()
            with self.requests.lock:
                self.requests.settled.notify_all()


def drive_load(conn: Connection, plan: LoadPlan) -> tuple[tuple[LoadResult, ...], float, str,
                                                         tuple[tuple[int, ...], ...]]:
    """The load-generator process: run each load of the plan against the server on `conn`. (The loads'
    results, this process's CPU seconds, why the loads stopped early: "" when they did not, and the cores
    the server and this process ran on.) Poisson rates after the first over the budget are not run;
    closed-loop loads always are."""
    from mbtune.serving.config import pin_process

    pin_process(plan.cores)
    generator = _Generator(conn)
    results: list[LoadResult] = []
    cores: tuple[tuple[int, ...], ...] = ()
    over_budget = False
    try:
        facts = generator.start(plan.ready_timeout_s)
        cores = (tuple(facts.get("cores", ())), _own_cores())
        for index, (kind, amount) in enumerate(plan.loads):
            if kind == gen.POISSON and over_budget:
                continue
            if generator.failed.is_set():
                break
            result = _one_load(generator, plan, kind, amount, seed=plan.seed + index)
            if generator.failed.is_set():  # the server died during the load: its figures are not a measurement
                break
            results.append(result)
            over_budget = over_budget or (plan.stop_after_failure and kind == gen.POISSON
                                          and not result.meets(plan.budget_s))
    except (TimeoutError, EOFError) as exc:
        generator.error = str(exc) or "the server ended before it was ready"
    finally:
        generator.end()
    return tuple(results), time.process_time(), generator.error, cores


def _own_cores() -> tuple[int, ...]:
    """The cores this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()


def _one_load(generator: _Generator, plan: LoadPlan, kind: str, amount: float, *, seed: int) -> LoadResult:
    generator.requests = requests = Requests()
    open_loop = kind == gen.POISSON
    window_s, most, needed = plan.window_of(kind, amount), plan.windows_of(kind, amount), plan.requests_of(kind)
    start = time.monotonic() + 0.05
    stop = threading.Event()
    due_times = gen.poisson_arrivals(amount, window_s * most, seed=seed) if open_loop else []
    sent = [0]
    if open_loop:
        sender = threading.Thread(target=_send_open, args=(generator, start, due_times, stop, sent), daemon=True)
    else:
        def more(now: float) -> None:
            if not stop.is_set():
                generator.send(now)

        generator.on_answer = more
        sender = threading.Thread(target=_send_closed, args=(generator, start, int(amount)), daemon=True)
    windows: list[gen.Window] = []
    overloaded, settled = False, None  # settled: the first of the windows that agreed
    try:
        sender.start()
        while len(windows) < most and not generator.failed.is_set():
            end = start + (len(windows) + 1) * window_s
            time.sleep(max(0.0, end + READ_LAG_S - time.monotonic()))  # answers stamped before `end` are in
            windows.append(window(requests, end - window_s, end, open_loop))
            if settled is None and gen.stable(windows, count=plan.stable_windows, within=plan.stability):
                settled = len(windows) - plan.stable_windows
            if (settled is not None and sum(w.offered for w in windows[settled:]) >= needed
                    and p99_half(requests, start + settled * window_s, end, window_s) <= plan.p99_target):
                break
            if len(windows) >= plan.stable_windows and windows[-1].mean_latency_s > 3 * plan.budget_s:
                overloaded = True  # the backlog has outgrown the budget several times over: no need to watch it
                break
    finally:
        stop.set()
        generator.on_answer = None
    sender.join(timeout=window_s)
    _drain(requests, plan, generator.failed)
    span = (start, start + max(1, len(windows)) * window_s)
    is_stable = not overloaded and settled is not None
    counted = windows[settled:] if is_stable else windows
    span = (span[1] - max(1, len(counted)) * window_s, span[1])
    generator.never_sent(requests, [start + d for d in due_times[sent[0]:] if start + d < span[1]])
    return replace(summary(requests, plan.rules, span, window_s), kind=kind, windows=len(windows), stable=is_stable,
                   rate_per_s=amount if open_loop else None, concurrency=None if open_loop else int(amount),
                   window_spread=finite(gen.spread_of(counted)) if counted else None)


def _send_open(generator: _Generator, start: float, due_times: list[float], stop: threading.Event,
               sent: list[int]) -> None:
    for offset in due_times:
        due = start + offset
        pause = due - time.monotonic()
        if pause > 0 and stop.wait(pause):
            return
        if stop.is_set() or generator.failed.is_set():
            return
        generator.send(due)
        sent[0] += 1


def _send_closed(generator: _Generator, start: float, concurrency: int) -> None:
    time.sleep(max(0.0, start - time.monotonic()))
    for _ in range(concurrency):
        generator.send(time.monotonic())


def _drain(requests: Requests, plan: LoadPlan, failed: threading.Event) -> None:
    """Wait for the requests still in flight: answered, rejected, or given up on (at once if the server
    has gone)."""
    limit = (plan.queue_timeout_s or 10 * plan.budget_s) + 2 * plan.budget_s + 1.0
    deadline = time.monotonic() + limit
    with requests.lock:
        while requests.outstanding > 0 and time.monotonic() < deadline and not failed.is_set():
            requests.settled.wait(timeout=max(0.0, deadline - time.monotonic()))


def run_config(spec: ServerSpec, plan: LoadPlan, *, timeout_s: float) -> ConfigRun:
    """One server process with `spec`'s rules, driven through `plan` by a load-generator process; with how
    busy the machine was with other work meanwhile. A server or generator that failed leaves the loads
    that finished before it and says why."""
    from mbtune.device.machine_load import LoadMeter
    from mbtune.records import ERROR, KILLED
    from mbtune.worker import process_context, run_beside

    server_end, generator_end = process_context().Pipe(duplex=True)
    try:
        with LoadMeter() as meter:
            front, back = run_beside(serve_requests, (server_end, spec), drive_load, generator_end, plan,
                                     timeout_s=timeout_s, handed_over=(server_end,), target_handed_over=(generator_end,))
    finally:
        generator_end.close()
    own_s = (front.value[1] if front.status == OK else None, back.value.get("cpu_s") if back.status == OK else None)
    machine = meter.load(rank_cpu_s=None if None in own_s else sum(own_s))  # type: ignore[arg-type]
    loads, error = (front.value[0], front.value[2]) if front.status == OK else ((), _last_line(front.error))
    if back.status in (ERROR, KILLED):  # the server's own failure says more than the generator's view of it
        error = f"the server {back.status}: {_last_line(back.error)}"
    elif error and front.status != OK:
        error = f"the load generator {front.status}: {error}"
    cores = front.value[3] if front.status == OK else ()
    return ConfigRun(config=spec.rules, loads=loads, error=error, machine=machine, cores=cores)


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no detail"])[-1]
