"""One node's side of a torchrun point: torch.distributed.run's elastic agent started in a fresh process,
and the entry each of its ranks runs."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import queue as queue_module
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from mbtune.pipeline.launch import Message, rank_message
from mbtune.pipeline.nodes import Nodes, parse_endpoint
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.worker import capture_stderr, die_with_parent

STOP_GRACE_S = 3.0


# The agent and its ranks (child processes) -------------------------------------------------------------
def start_agent(spec: PipelineSpec, nodes: Nodes, endpoint: str, run_id: str, key: str, tmp: str,
                 hang_rank: int | None) -> Any:
    from mbtune.worker import process_context

    agent = process_context().Process(target=_agent_main, name="mbtune-elastic-agent", daemon=False,
                                      args=(spec, nodes, endpoint, run_id, key, tmp, hang_rank))
    agent.start()
    return agent


def stop_agent(agent: Any, *, wait_s: float, grace_s: float) -> None:
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
    store = open_store(host, port, serve=False, timeout_s=nodes.join_timeout_s)
    config = LaunchConfig(
        min_nodes=nodes.nnodes, max_nodes=nodes.nnodes, nproc_per_node=spec.world_size // nodes.nnodes,
        run_id=run_id, rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={"timeout": max(1, math.ceil(nodes.join_timeout_s)),
                      "join_timeout": max(1, math.ceil(nodes.join_timeout_s)), "is_host": False},
        max_restarts=0, monitor_interval=0.1, start_method="fork",
        local_addr="127.0.0.1" if host in ("127.0.0.1", "localhost") else None,
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "elastic")), shutdown_timeout=int(STOP_GRACE_S),
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
                  f"node {nodes.node_rank}'s elastic agent failed: {type(exc).__name__}: {first_line(exc)}")
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
    store = open_store(host, port, serve=False, timeout_s=timeout_s)
    store.set(f"{key}/began/{rank}", f"node {node_rank} ({socket.gethostname()})")
    messages = StoreQueue(store, key, spec.world_size)
    messages.put(rank_message(spec, rank, None, messages.put, hang_rank))


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


POLL_S = 0.05


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
            time.sleep(POLL_S)


def open_store(host: str, port: int, *, serve: bool, timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=serve, wait_for_workers=False, multi_tenant=serve,
                    timeout=timedelta(seconds=timeout_s))
