"""Benchmark: what starting a point's ranks through torch.distributed.run costs against mbtune's own launcher.

One small point (mlp, 2 stages, one measured step) run N times by each launcher, alternating, in this
process: the wall time from asking for the point to having every rank's report, less the time the ranks
themselves spent from their first step to their last (the same work under both launchers), is the start-up
and tear-down each launcher adds per point. The local launcher forks ranks from a torch-preloaded
forkserver and meets them in a file store; torchrun starts a fresh elastic agent per point (a child of the
same forkserver), which meets the other nodes' agents in a c10d rendezvous and forks the ranks. The first
point of each is reported apart (the forkserver's own start-up: once per run). Then a two-node sweep on this
machine (two mbtune processes, one rank each) prints its table, as a user would run it.

Run: .venv/bin/python bench/torchrun.py [--repeats 10] [--no-two-nodes]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbtune.pipeline.launch import run_pipeline_point  # noqa: E402
from mbtune.pipeline.nodes import Nodes  # noqa: E402
from mbtune.pipeline.point_spec import PipelineSpec  # noqa: E402
from mbtune.pipeline.torchrun import close_session, session  # noqa: E402

SPEC = PipelineSpec(workload="mlp", workload_options=(("layers", 2), ("width", 64)), schedule="1f1b", num_ranks=2,
                    num_micro_batches=4, micro_batch_size=2, warmup_steps=1, measured_steps=1)


def overhead(outcome, wall_s: float) -> float:
    """Wall time not spent in the ranks' own steps: launch, rendezvous, process-group set-up, tear-down."""
    assert outcome.ok, outcome.error
    steps = max(sum(r.warmup_step_times_s) + sum(r.step_times_s) for r in outcome.reports)
    return wall_s - steps


def start_up(repeats: int) -> None:
    nodes = Nodes()
    runs: dict[str, list[float]] = {"local": [], "torchrun": []}
    first: dict[str, float] = {}
    try:
        for index in range(repeats + 1):
            for name in runs:
                started = time.perf_counter()
                outcome = (run_pipeline_point(SPEC, timeout_s=120) if name == "local"
                           else session(nodes).run_point(SPEC, timeout_s=120))
                cost = overhead(outcome, time.perf_counter() - started)
                if index == 0:
                    first[name] = cost
                else:
                    runs[name].append(cost)
    finally:
        close_session(nodes, 0)
    print(f"per-point start-up and tear-down, {SPEC.world_size} ranks on CPU, {repeats} points each "
          "(median [min-max]; the first point apart)")
    for name, costs in runs.items():
        print(f"  {name:<9} {statistics.median(costs):6.2f} s [{min(costs):.2f}-{max(costs):.2f}]   "
              f"first point {first[name]:.2f} s")
    ratio = [t / lo for t, lo in zip(runs["torchrun"], runs["local"])]
    print(f"  torchrun / local: x{statistics.median(ratio):.2f} [{min(ratio):.2f}-{max(ratio):.2f}] "
          f"(+{statistics.median(runs['torchrun']) - statistics.median(runs['local']):.2f} s per point)")


def two_nodes() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = [sys.executable, "-m", "mbtune", "sweep", "-w", "mlp", "-O", "layers=2", "-O", "width=256", "-d", "cpu",
            "-p", "2", "--schedules", "gpipe,1f1b", "-m", "2,4", "--accum", "1", "--micro-batch-size", "4",
            "--steps", "5", "--threads", "1", "--no-save", "--launcher", "torchrun", "--nnodes", "2",
            "--rdzv-endpoint", f"127.0.0.1:{port}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "150"}
    follower = subprocess.Popen([*args, "--node-rank", "1"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    started = time.perf_counter()
    leader = subprocess.run([*args, "--node-rank", "0"], env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    follower_err = follower.communicate(timeout=60)[1]
    print(f"\ntwo-node sweep on this machine (node 0 exit {leader.returncode}, node 1 exit {follower.returncode}, "
          f"{wall:.0f} s):")
    print(leader.stdout)
    print("node 1 said:\n" + follower_err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-two-nodes", action="store_true")
    args = parser.parse_args()
    start_up(args.repeats)
    if not args.no_two_nodes:
        two_nodes()


if __name__ == "__main__":
    main()
