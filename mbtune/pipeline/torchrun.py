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
import os
import pickle
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from mbtune.errors import ConfigError, HarnessError
from mbtune.pipeline.agent import POLL_S, STOP_GRACE_S, StoreQueue, first_line, open_store, start_agent, stop_agent
from mbtune.pipeline.launch import Ranks, collect, failure_detail, hang_rank_from_env
from mbtune.pipeline.nodes import Nodes, parse_endpoint
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.timeline import PipelineOutcome
from mbtune.records import ERROR, HARNESS_FAULT, TIMEOUT
from mbtune.worker import forward_stderr, read_child_stderr

_HEARTBEAT_S = 1.0
_GONE_S = 10.0  # a node whose heartbeat has not moved for this long is gone
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


class _Abort(Exception):
    """A point cannot finish: a node is gone, or an agent could not start its ranks."""

    def __init__(self, status: str, why: str) -> None:
        super().__init__(why)
        self.status = status


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
            self.store = open_store(self.host, port, serve=nodes.leads, timeout_s=nodes.join_timeout_s)
        except (RuntimeError, OSError) as exc:
            where = f"{self.host}:{port}"
            if nodes.leads:
                raise HarnessError(f"node 0 cannot serve the rendezvous store at {where}: {first_line(exc)}",
                                   hint="Choose a free port on node 0 with --rdzv-endpoint HOST:PORT.") from exc
            raise HarnessError(f"node {nodes.node_rank} cannot reach node 0 at {where} within "
                               f"{nodes.join_timeout_s:g} s: {first_line(exc)}",
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
            store = open_store(self.host, self.port, serve=False, timeout_s=self.nodes.join_timeout_s)
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
    def run_point(self, spec: PipelineSpec, *, timeout_s: float, grace_s: float = STOP_GRACE_S) -> PipelineOutcome:
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
            agent = start_agent(spec, self.nodes, self.endpoint, run_id, key, tmp, hang_rank_from_env())
            outcome = PipelineOutcome(status=ERROR, error="the launcher failed before collecting results")
            try:
                outcome = self._collect(spec, agent, key, timeout_s)
            finally:
                self.store.set(f"{key}/stop", "1")
                stop_agent(agent, wait_s=5.0 if outcome.ok else 0.0, grace_s=grace_s)
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
                time.sleep(POLL_S)
            # A failing rank's peers are stopped by their agent, which then says how its lost ranks exited:
            # the root cause waits for that word.
            return collect(ranks, messages, deadline=time.monotonic() + timeout_s, timeout_s=timeout_s,
                           settle_s=STOP_GRACE_S + 1.0)
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
                raise HarnessError(f"lost node 0 (its store at {self.endpoint}): {first_line(exc)}",
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
                agent = start_agent(spec, self.nodes, self.endpoint, run_id, key, tmp, hang_rank_from_env())
                deadline = time.monotonic() + self.nodes.join_timeout_s + timeout_s + _GONE_S
                try:
                    while agent.exitcode is None and time.monotonic() < deadline:
                        if self.store.check([f"{key}/stop"]):
                            break
                        time.sleep(0.1)
                except (RuntimeError, OSError):
                    pass  # node 0 is gone: the next _wait_for says so
                finally:
                    stop_agent(agent, wait_s=5.0, grace_s=STOP_GRACE_S)
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


def lead_or_follow(nodes: Nodes, argv: list[str], say: Callable[[str], None]) -> int | None:
    """Open this node's session: node 0 opens the shared store now (the other nodes can join while it
    probes) and leads (None); any other node follows node 0's points until node 0 says the run is over, and
    gets node 0's exit code. `argv`: the command every node must run alike."""
    opened = session(nodes, command_fingerprint(argv))
    if nodes.leads:
        return None
    say(f"node {nodes.node_rank} of {nodes.nnodes}: following node 0 at {opened.endpoint}")
    code = opened.follow(say=lambda line: say(f"node {nodes.node_rank}: {line}"))
    say(f"node {nodes.node_rank}: node 0 ended the run (exit code {code})")
    return code
