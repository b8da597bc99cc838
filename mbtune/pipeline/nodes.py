"""Where a sweep's ranks run (pure facts, no launch code): the launchers and the nodes of a multi-node run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mbtune.errors import ConfigError

LAUNCHERS = ("local", "torchrun")


DEFAULT_PORT = 29500  # torchrun's


DEFAULT_JOIN_TIMEOUT_S = 60.0


# The variables schedulers set, in the order they are read: torchrun's and Kubeflow PyTorchJob's (PET_*),
# then Slurm's.
_NNODES_ENV = ("PET_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")


_NODE_RANK_ENV = ("PET_NODE_RANK", "GROUP_RANK", "SLURM_NODEID")


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """Where a run's ranks come from: this host alone, or `nnodes` hosts meeting at `endpoint`."""

    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None  # HOST:PORT of node 0's store; one host without one: a free local port
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes {self.nnodes} is not a node count", hint="Use an integer >= 1.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is not one of the {self.nnodes} node(s)",
                              hint=f"Number the nodes 0 to {self.nnodes - 1}; node 0 leads.")
        if self.nnodes > 1 and not self.endpoint:
            raise ConfigError(f"{self.nnodes} nodes need a meeting point",
                              hint="Pass --rdzv-endpoint HOST:PORT (node 0's address), the same on every node, "
                                   "or run under a scheduler that sets MASTER_ADDR and MASTER_PORT.")
        if self.endpoint:
            parse_endpoint(self.endpoint)
        if not self.join_timeout_s > 0:
            raise ConfigError(f"join timeout {self.join_timeout_s!r} is not a positive number of seconds",
                              hint="Use a number of seconds > 0.")

    @property
    def leads(self) -> bool:
        return self.node_rank == 0


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (or HOST, on torchrun's port 29500) as a host and a port."""
    host, sep, port_text = endpoint.strip().rpartition(":")
    if not sep:
        host, port_text = endpoint.strip(), str(DEFAULT_PORT)
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT",
                          hint="Give node 0's address and a free port, e.g. --rdzv-endpoint node0:29500.")
    return host, int(port_text)


def nodes_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """nnodes, node_rank and endpoint as a scheduler set them (only those it did): torchrun's and
    Kubeflow PyTorchJob's PET_NNODES, PET_NODE_RANK, PET_RDZV_ENDPOINT, PET_MASTER_ADDR and
    PET_MASTER_PORT; MASTER_ADDR and MASTER_PORT; Slurm's SLURM_JOB_NUM_NODES and SLURM_NODEID. Flags given
    on the command line win over these."""
    env = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for key, names in (("nnodes", _NNODES_ENV), ("node_rank", _NODE_RANK_ENV)):
        name = next((n for n in names if env.get(n, "").strip()), None)
        if name is not None:
            value = env[name].strip()
            if not value.isdigit():
                raise ConfigError(f"{name}={value!r} is not a whole number",
                                  hint=f"Fix the scheduler's {name}, or pass --{key.replace('_', '-')}.")
            found[key] = int(value)
    if env.get("PET_RDZV_ENDPOINT", "").strip():
        found["endpoint"] = env["PET_RDZV_ENDPOINT"].strip()
    for prefix in ("PET_", ""):
        if "endpoint" not in found and env.get(f"{prefix}MASTER_ADDR", "").strip():
            port = env.get(f"{prefix}MASTER_PORT", "").strip() or DEFAULT_PORT
            found["endpoint"] = f"{env[f'{prefix}MASTER_ADDR'].strip()}:{port}"
    return found


def launch_nodes(launcher: str, *, nnodes: int | None = None, node_rank: int | None = None,
                 endpoint: str | None = None, join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
                 environ: Mapping[str, str] | None = None) -> Nodes:
    """The nodes a run's ranks come from, as --launcher and the node settings give them: under torchrun the
    scheduler's environment (Slurm, torchrun, Kubeflow PyTorchJob) fills what was not given; mbtune's own
    launcher reaches this host alone."""
    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}",
                          hint="Use --launcher local (one host) or --launcher torchrun.")
    if launcher == "local":
        given = [flag for flag, value in (("--nnodes", nnodes), ("--node-rank", node_rank),
                                          ("--rdzv-endpoint", endpoint)) if value is not None]
        if given and not (nnodes in (None, 1) and node_rank in (None, 0) and endpoint is None):
            raise ConfigError(f"{' and '.join(given)} need --launcher torchrun",
                              hint="Add --launcher torchrun: mbtune's own launcher reaches one host only.")
        return Nodes(join_timeout_s=join_timeout_s)
    env = nodes_from_env(environ)
    return Nodes(nnodes=nnodes if nnodes is not None else env.get("nnodes", 1),
                 node_rank=node_rank if node_rank is not None else env.get("node_rank", 0),
                 endpoint=endpoint if endpoint is not None else env.get("endpoint"), join_timeout_s=join_timeout_s)
