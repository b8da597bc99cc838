"""Points whose ranks torch.distributed.run's elastic agent starts, on one host or across nodes.

The same mbtune command runs on every node (`--launcher torchrun --nnodes N --node-rank K --rdzv-endpoint
HOST:PORT`). Node 0 leads: it plans the grid and runs the sweep as on one host, and it hosts a TCPStore at
the rendezvous endpoint through which the nodes agree on everything else:

- `mbtune/ctl/config`: node 0's command; a node whose command differs refuses to follow it.
- `mbtune/ctl/<k>`: what to run next, the k-th point (its own rendezvous id, its PipelineSpec, its
  deadline), or the end of the run with node 0's exit code. Nodes other than 0 plan nothing: they run what
  they are told, write nothing, and exit with node 0's verdict.
- `mbtune/alive/<node>`: a counter each node bumps every second; a node whose counter stalls is gone.
- `<point>/...`: per point, each rank's messages (the blocks it holds, then its report or how it failed,
  as pipeline/launch.py's ranks send them), that it began and on which node, and how killed ranks exited.
  Node 0 reads every rank's from here, so it names the root cause of a failure on any node.

Per point every node starts one elastic agent (torch.distributed.launcher.api.elastic_launch, c10d
rendezvous at the endpoint, no restarts) in a fresh child process, which starts that node's ranks: a
fresh set of processes per point, as with the local launcher, so one point's OOM cannot poison the next.
The agent's workers are forked from that child, which a torch-preloaded forkserver made, so they start
without importing torch again. LOCAL_RANK names each rank's GPU. Node 0 ends the point (every report in,
a root cause, the deadline, a node gone) and tells the others to stop theirs.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import queue as queue_module
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

from mbtune.errors import ConfigError, HarnessError
from mbtune.pipeline.launch import Message, Ranks, collect, failure_detail, hang_rank_from_env, rank_message
from mbtune.pipeline.nodes import Nodes, parse_endpoint
from mbtune.pipeline.spec import PipelineSpec
from mbtune.pipeline.timeline import PipelineOutcome
from mbtune.records import ERROR, HARNESS_FAULT, TIMEOUT
from mbtune.worker import capture_stderr, die_with_parent, forward_stderr, read_child_stderr

_HEARTBEAT_S = 1.0
_GONE_S = 10.0  # a node whose heartbeat has not moved for this long is gone
_POLL_S = 0.05
_STOP_GRACE_S = 3.0
_BYE_WAIT_S = 10.0  # how long node 0 keeps the store up for the other nodes to read the end








# Where node 0 puts its results: not part of what the nodes must agree on (the others write nothing).
_OUTPUT_OPTIONS = ("--node-rank", "--profiles-dir", "--format", "-f", "--output", "-o", "--plot", "--trace")
_OUTPUT_FLAGS = ("--save", "--no-save", "--resume", "--no-resume")


def command_fingerprint(argv: Sequence[str]) -> str:
    """The command line without its node rank and node 0's output options: the same on every node of one
    run."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _OUTPUT_OPTIONS:
            skip = True
        elif arg not in _OUTPUT_FLAGS and not arg.startswith(tuple(f"{o}=" for o in _OUTPUT_OPTIONS)):
            kept.append(arg)
    return " ".join(kept)


class StoreQueue:
    """A queue of one point's rank messages in the shared store, per rank in the order sent; `get`
    raises queue.Empty as multiprocessing's does, and calls `watch` while it waits (which may raise)."""

    def __init__(self, store: Any, key: str, count: int, watch: Callable[[], None] | None = None) -> None:
        self.store, self.key, self.count, self.watch = store, key, count, watch
        self.seen = [0] * count
        self.sent: dict[int, int] = {}

    def put(self, message: Message) -> None:
        """The message first, then the count that makes it visible: a reader never waits for a value a
        rank died before writing. (One writer per rank, so the index is its own.)"""
        rank = message[1]
        self.sent[rank] = self.sent.get(rank, 0) + 1
        self.store.set(f"{self.key}/m/{rank}/{self.sent[rank]}", pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        self.store.add(f"{self.key}/n/{rank}", 1)

    def get(self, timeout: float | None = None) -> Message:
        end = time.monotonic() + (timeout or 0.0)
        while True:
            for rank in range(self.count):
                if self.store.add(f"{self.key}/n/{rank}", 0) > self.seen[rank]:
                    self.seen[rank] += 1
                    return pickle.loads(self.store.get(f"{self.key}/m/{rank}/{self.seen[rank]}"))
            if self.watch is not None:
                self.watch()
            if time.monotonic() >= end:
                raise queue_module.Empty
            time.sleep(_POLL_S)


class _Abort(Exception):
    """A point cannot finish: a node is gone, or an agent could not start its ranks."""

    def __init__(self, status: str, why: str) -> None:
        super().__init__(why)
        self.status = status


def _store(host: str, port: int, *, serve: bool, timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=serve, wait_for_workers=False, multi_tenant=serve,
                    timeout=timedelta(seconds=timeout_s))


class Session:
    """This node's side of a torchrun run: the control store (node 0 hosts it), its heartbeat, and the
    points run so far."""

    def __init__(self, nodes: Nodes, command: str) -> None:
        self.nodes = nodes
        if nodes.endpoint:
            self.host, port = parse_endpoint(nodes.endpoint)
        else:
            self.host, port = "127.0.0.1", 0  # one host: any free port
        try:
            self.store = _store(self.host, port, serve=nodes.leads, timeout_s=nodes.join_timeout_s)
        except (RuntimeError, OSError) as exc:
            where = f"{self.host}:{port}"
            if nodes.leads:
                raise HarnessError(f"node 0 cannot serve the rendezvous store at {where}: {_first_line(exc)}",
                                   hint="Choose a free port on node 0 with --rdzv-endpoint HOST:PORT.") from exc
            raise HarnessError(f"node {nodes.node_rank} cannot reach node 0 at {where} within "
                               f"{nodes.join_timeout_s:g} s: {_first_line(exc)}",
                               hint="Start node 0 too, with the same --rdzv-endpoint, and check the address "
                                    "and port are reachable from here.") from exc
        self.port = self.store.port
        self.endpoint = f"{self.host}:{self.port}"
        self.run_base = uuid.uuid4().hex[:12] if nodes.leads else ""
        self.points = 0
        self.heard: dict[int, tuple[int, float]] = {}  # node -> (its heartbeat count, when it last moved)
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="mbtune-heartbeat", daemon=True)
        self._beat.start()
        if nodes.leads:
            self.store.set("mbtune/ctl/config", command)
        else:
            self._check_command(command)

    # Heartbeats ---------------------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        try:
            store = _store(self.host, self.port, serve=False, timeout_s=self.nodes.join_timeout_s)
            while not self._stop.is_set():
                store.add(f"mbtune/alive/{self.nodes.node_rank}", 1)
                self._stop.wait(_HEARTBEAT_S)
        except Exception:  # noqa: BLE001 - the store went with node 0: the main thread will say so
            return

    def gone_nodes(self) -> list[tuple[int, str]]:
        """The other nodes that are not answering, each with why."""
        now, gone = time.monotonic(), []
        for node in range(self.nodes.nnodes):
            if node == self.nodes.node_rank:
                continue
            count = self.store.add(f"mbtune/alive/{node}", 0)
            last = self.heard.get(node)
            if last is None or count != last[0]:
                self.heard[node] = (count, now) if count else (0, last[1] if last else self.started)
            count, moved = self.heard[node]
            if not count and now - moved > self.nodes.join_timeout_s:
                gone.append((node, f"node {node} never joined within {self.nodes.join_timeout_s:g} s"))
            elif count and now - moved > _GONE_S:
                gone.append((node, f"node {node} stopped answering {now - moved:.0f} s ago"))
        return gone

    def wait_for_nodes(self) -> list[tuple[int, str]]:
        """Wait (at most the join timeout) until every node has been heard; the ones that were not."""
        while True:
            missing = [n for n in range(self.nodes.nnodes)
                       if n != self.nodes.node_rank and not self.store.add(f"mbtune/alive/{n}", 0)]
            if not missing:
                return []
            if time.monotonic() - self.started > self.nodes.join_timeout_s:
                return [(n, f"node {n} never joined within {self.nodes.join_timeout_s:g} s") for n in missing]
            time.sleep(0.2)

    # Node 0 --------------------------------------------------------------------------------------------
    def run_point(self, spec: PipelineSpec, *, timeout_s: float, grace_s: float = _STOP_GRACE_S) -> PipelineOutcome:
        """Run one point on every node and return every rank's report, or why not (as run_pipeline_point)."""
        index, started = self.points, time.monotonic()
        self.points += 1
        if spec.world_size % self.nodes.nnodes:  # the grid skips these (grid.plan_grid); a caller may not
            self.store.set(f"mbtune/ctl/{index}", pickle.dumps(("skip",)))
            return PipelineOutcome(status=ERROR, error_kind=HARNESS_FAULT,
                                   error=f"{spec.world_size} process(es) do not split over {self.nodes.nnodes} "
                                         "nodes evenly")
        if self.points == 1 and (missing := self.wait_for_nodes()):
            gone = missing
        else:
            gone = self.gone_nodes()
        if gone:  # the others still step over this index, so every node stays at the same point
            self.store.set(f"mbtune/ctl/{index}", pickle.dumps(("skip",)))
            return PipelineOutcome(status=ERROR, error_kind=HARNESS_FAULT, wall_s=0.0,
                                   error="; ".join(why for _, why in gone) + ": the point did not run")
        run_id = f"mbtune-{self.run_base}-{index}"
        key = f"mbtune/point/{index}"
        self.store.set(f"mbtune/ctl/{index}", pickle.dumps(("run", run_id, spec, timeout_s)))
        with tempfile.TemporaryDirectory(prefix="mbtune-tr-") as tmp:
            agent = _start_agent(spec, self.nodes, self.endpoint, run_id, key, tmp, hang_rank_from_env())
            outcome = PipelineOutcome(status=ERROR, error="the launcher failed before collecting results")
            try:
                outcome = self._collect(spec, agent, key, timeout_s)
            finally:
                self.store.set(f"{key}/stop", "1")
                _stop_agent(agent, wait_s=5.0 if outcome.ok else 0.0, grace_s=grace_s)
            stderr = {int(name[4:-7]): read_child_stderr(os.path.join(tmp, name))[1]
                      for name in os.listdir(tmp) if name.startswith("rank") and name.endswith(".stderr")}
        for text in stderr.values():
            forward_stderr(text)
        nodes = {r: self.store.get(f"{key}/began/{r}").decode() for r in range(spec.world_size)
                 if self.store.check([f"{key}/began/{r}"])}
        reports = tuple(replace(report, node=nodes.get(i, "")) for i, report in enumerate(outcome.reports))
        detail = outcome.error_detail if outcome.failed_rank not in stderr else failure_detail(
            outcome, [stderr.get(r, "") for r in range(spec.world_size)])
        return replace(outcome, reports=reports, wall_s=time.monotonic() - started, error_detail=detail)

    def _collect(self, spec: PipelineSpec, agent: Any, key: str, timeout_s: float) -> PipelineOutcome:
        def began(rank: int) -> bool:
            return bool(self.store.check([f"{key}/began/{rank}"]))

        def exitcode(rank: int) -> int | None:
            name = f"{key}/died/{rank}"
            return int(self.store.get(name)) if self.store.check([name]) else None

        def watch() -> None:
            if gone := self.gone_nodes():
                raise _Abort(ERROR, "; ".join(why for _, why in gone))
            errors = [f"{key}/agent_error/{n}" for n in range(self.nodes.nnodes)]
            for name in errors:
                if self.store.check([name]):
                    raise _Abort(ERROR, self.store.get(name).decode())
            if agent.exitcode is not None and not all(began(r) for r in range(spec.world_size)):
                time.sleep(0.5)  # its last word may be on its way
                for name in errors:
                    if self.store.check([name]):
                        raise _Abort(ERROR, self.store.get(name).decode())
                raise _Abort(ERROR, f"node 0's elastic agent exited with code {agent.exitcode} before every "
                                    "rank began")

        ranks = Ranks(count=spec.world_size, began=began, exitcode=exitcode)
        messages = StoreQueue(self.store, key, spec.world_size, watch)
        join_end = time.monotonic() + self.nodes.join_timeout_s
        try:
            while not all(began(r) for r in range(spec.world_size)):  # the rendezvous, then the ranks' start
                if time.monotonic() > join_end:
                    waiting = [r for r in range(spec.world_size) if not began(r)]
                    return PipelineOutcome(status=TIMEOUT, error_kind=HARNESS_FAULT,
                                           error=f"rank(s) {waiting} did not start within the join timeout "
                                                 f"({self.nodes.join_timeout_s:g} s): the rendezvous did not "
                                                 "complete")
                watch()
                time.sleep(_POLL_S)
            # A failing rank's peers are stopped by their agent, which then says how its lost ranks exited:
            # the root cause waits for that word.
            return collect(ranks, messages, deadline=time.monotonic() + timeout_s, timeout_s=timeout_s,
                           settle_s=_STOP_GRACE_S + 1.0)
        except _Abort as exc:
            return PipelineOutcome(status=exc.status, error=str(exc), error_kind=HARNESS_FAULT)

    def close(self, exit_code: int) -> None:
        """Tell the other nodes the run is over, with this exit code, and wait (a little) until they read it."""
        if self.nodes.leads:
            self.store.set(f"mbtune/ctl/{self.points}", pickle.dumps(("end", exit_code)))
            end = time.monotonic() + _BYE_WAIT_S
            others = [n for n in range(1, self.nodes.nnodes)]
            while others and time.monotonic() < end and not all(n in dict(self.gone_nodes()) for n in others):
                others = [n for n in others if not self.store.check([f"mbtune/bye/{n}"])]
                time.sleep(0.1)
        self._stop.set()
        self._beat.join(timeout=2 * _HEARTBEAT_S)
        del self.store  # node 0: the server goes with it, so its port is free again

    # Other nodes ---------------------------------------------------------------------------------------
    def _check_command(self, command: str) -> None:
        leader = self._wait_for("mbtune/ctl/config").decode()
        if leader != command:
            raise ConfigError(f"node {self.nodes.node_rank}'s command differs from node 0's ({leader!r})",
                              hint="Run the same mbtune command on every node; only --node-rank differs.")

    def _wait_for(self, name: str, *, within_s: float | None = None) -> bytes:
        """The value of `name` once node 0 sets it; HarnessError if node 0 goes (its store with it)."""
        end = None if within_s is None else time.monotonic() + within_s
        while True:
            try:
                if self.store.check([name]):
                    return self.store.get(name)
            except (RuntimeError, OSError) as exc:
                raise HarnessError(f"lost node 0 (its store at {self.endpoint}): {_first_line(exc)}",
                                   hint="Node 0 ended or died: see its output.") from exc
            if end is not None and time.monotonic() > end:
                raise HarnessError(f"node 0 said nothing within {within_s:g} s", hint="See node 0's output.")
            time.sleep(0.1)

    def follow(self, say: Callable[[str], None] = lambda _: None) -> int:
        """Run what node 0 says, point by point, until it says the run is over; its exit code."""
        index = 0
        while True:
            item = pickle.loads(self._wait_for(f"mbtune/ctl/{index}"))
            if item[0] == "skip":  # node 0 did not run this one (a node was gone)
                index += 1
                continue
            if item[0] == "end":
                self.store.set(f"mbtune/bye/{self.nodes.node_rank}", "1")
                self._stop.set()
                return int(item[1])
            _, run_id, spec, timeout_s = item
            key = f"mbtune/point/{index}"
            say(f"point {index + 1}: {spec.world_size // self.nodes.nnodes} rank(s) here of {spec.world_size}")
            with tempfile.TemporaryDirectory(prefix="mbtune-tr-") as tmp:
                agent = _start_agent(spec, self.nodes, self.endpoint, run_id, key, tmp, hang_rank_from_env())
                deadline = time.monotonic() + self.nodes.join_timeout_s + timeout_s + _GONE_S
                try:
                    while agent.exitcode is None and time.monotonic() < deadline:
                        if self.store.check([f"{key}/stop"]):
                            break
                        time.sleep(0.1)
                except (RuntimeError, OSError):
                    pass  # node 0 is gone: the next _wait_for says so
                finally:
                    _stop_agent(agent, wait_s=5.0, grace_s=_STOP_GRACE_S)
            index += 1


_sessions: dict[Nodes, Session] = {}


def session(nodes: Nodes, command: str = "") -> Session:
    """This process's session for these nodes, opened on first use."""
    if nodes not in _sessions:
        _sessions[nodes] = Session(nodes, command)
    return _sessions[nodes]


def close_session(nodes: Nodes, exit_code: int) -> None:
    """End this process's session for these nodes, if one is open."""
    opened = _sessions.pop(nodes, None)
    if opened is not None:
        opened.close(exit_code)


def close_sessions(exit_code: int) -> None:
    """End every open session (node 0: the other nodes exit with this code)."""
    while _sessions:
        _, opened = _sessions.popitem()
        with contextlib.suppress(Exception):
            opened.close(exit_code)


# The agent and its ranks (child processes) -------------------------------------------------------------
def _start_agent(spec: PipelineSpec, nodes: Nodes, endpoint: str, run_id: str, key: str, tmp: str,
                 hang_rank: int | None) -> Any:
    from mbtune.worker import process_context

    agent = process_context().Process(target=_agent_main, name="mbtune-elastic-agent", daemon=False,
                                      args=(spec, nodes, endpoint, run_id, key, tmp, hang_rank))
    agent.start()
    return agent


def _stop_agent(agent: Any, *, wait_s: float, grace_s: float) -> None:
    """Let the agent end by itself for wait_s, then SIGTERM (it stops its ranks), then SIGKILL its group."""
    agent.join(wait_s)
    if agent.is_alive():
        agent.terminate()
        agent.join(grace_s)
    if agent.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.kill()
    agent.join()


def _agent_main(spec: PipelineSpec, nodes: Nodes, endpoint: str, run_id: str, key: str, tmp: str,
                hang_rank: int | None) -> None:
    """In a fresh child: this node's elastic agent for one point. Its own process group, so that stopping
    it stops its ranks too; how ranks that died without a word exited goes to the store."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    capture_stderr(os.path.join(tmp, "agent.stderr"))
    # LaunchConfig asks torch.cuda.is_available(), which would start CUDA in this process; ranks forked from
    # a process with CUDA started cannot use it. NVML answers the question without starting it.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    host, port = parse_endpoint(endpoint)
    store = _store(host, port, serve=False, timeout_s=nodes.join_timeout_s)
    config = LaunchConfig(
        min_nodes=nodes.nnodes, max_nodes=nodes.nnodes, nproc_per_node=spec.world_size // nodes.nnodes,
        run_id=run_id, rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={"timeout": max(1, math.ceil(nodes.join_timeout_s)),
                      "join_timeout": max(1, math.ceil(nodes.join_timeout_s)), "is_host": False},
        max_restarts=0, monitor_interval=0.1, start_method="fork",
        local_addr="127.0.0.1" if host in ("127.0.0.1", "localhost") else None,
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "elastic")), shutdown_timeout=int(_STOP_GRACE_S),
    )
    try:
        elastic_launch(config, _rank_entry)(spec, endpoint, key, tmp, nodes.node_rank, nodes.join_timeout_s,
                                            hang_rank)
    except ChildFailedError as exc:
        for rank, failure in exc.failures.items():
            store.set(f"{key}/died/{rank}", str(failure.exitcode))
        os._exit(1)
    except BaseException as exc:  # noqa: BLE001 - the rendezvous or the agent failed: say why, once
        store.set(f"{key}/agent_error/{nodes.node_rank}",
                  f"node {nodes.node_rank}'s elastic agent failed: {type(exc).__name__}: {_first_line(exc)}")
        os._exit(1)
    os._exit(0)


def _rank_entry(spec: PipelineSpec, endpoint: str, key: str, tmp: str, node_rank: int, timeout_s: float,
                hang_rank: int | None) -> None:
    """One rank, started by the elastic agent: RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT come from it.
    Its messages go to the store, where node 0 reads them."""
    rank = int(os.environ["RANK"])
    capture_stderr(os.path.join(tmp, f"rank{rank}.stderr"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # the agent's handlers, inherited by fork:
        signal.signal(signum, signal.SIG_DFL)  # a rank its agent stops is stopped, not "an error"
    die_with_parent()
    host, port = parse_endpoint(endpoint)
    store = _store(host, port, serve=False, timeout_s=timeout_s)
    store.set(f"{key}/began/{rank}", f"node {node_rank} ({socket.gethostname()})")
    messages = StoreQueue(store, key, spec.world_size)
    messages.put(rank_message(spec, rank, None, messages.put, hang_rank))


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__

