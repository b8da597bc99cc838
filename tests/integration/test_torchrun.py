"""--launcher torchrun: points whose ranks torch.distributed.run's elastic agent starts (c10d rendezvous,
gloo), on one host and across two "nodes" on this machine, with faults."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mbtune.pipeline.launch import run_pipeline_point
from mbtune.pipeline.nodes import Nodes
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.torchrun import close_session, session
from tests.fixtures.processes import orphans
from tests.unit.test_cli import ROOT, mbtune

pytestmark = pytest.mark.integration

SWEEP = ["sweep", "-w", "mlp", "-O", "layers=2", "-O", "width=64", "-d", "cpu", "-p", "2", "--schedules", "gpipe",
         "-m", "2,4", "--accum", "1,2", "--micro-batch-size", "2", "--threads", "1", "--launcher", "torchrun"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def node(args: list[str], rank: int, folder: Path, tag: str) -> subprocess.Popen:
    """One "node": an mbtune process of its own, in a folder of its own."""
    folder.mkdir(exist_ok=True)
    env = {**os.environ, "COLUMNS": "200", "MBTUNE_TEST_TAG": tag, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "mbtune", *args, "--node-rank", str(rank),
                             "--profiles-dir", str(folder / "profiles"), "--format", "json"],
                            cwd=folder, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def two_nodes(tmp_path: Path, args: list[str]) -> tuple[str, subprocess.Popen, subprocess.Popen]:
    """A tag, then node 0 and node 1 of one run of `args` meeting at a free local port."""
    tag, endpoint = uuid.uuid4().hex, f"127.0.0.1:{free_port()}"
    args = [*args, "--nnodes", "2", "--rdzv-endpoint", endpoint]
    follower = node(args, 1, tmp_path / "node1", tag)
    return tag, node(args, 0, tmp_path / "node0", tag), follower


def test_torchrun_ranks_give_the_local_launchers_losses_and_gradients():
    spec = PipelineSpec(workload="mlp", workload_options=(("layers", 2), ("width", 32)), schedule="1f1b",
                        num_ranks=2, num_micro_batches=4, micro_batch_size=2, grad_accum_steps=2,
                        measured_steps=2, capture_grads=True)
    local = run_pipeline_point(spec, timeout_s=120)
    nodes = Nodes()
    try:
        elastic = session(nodes).run_point(spec, timeout_s=120)
    finally:
        close_session(nodes, 0)
    assert local.ok and elastic.ok, (local.error, elastic.error)
    assert [r.rank for r in elastic.reports] == [0, 1] and all(r.node.startswith("node 0") for r in elastic.reports)
    for mine, theirs in zip(local.reports, elastic.reports):
        assert mine.losses == theirs.losses and mine.block_indices == theirs.block_indices
        assert mine.grads is not None and theirs.grads is not None and mine.grads.keys() == theirs.grads.keys()
        for name, grad in mine.grads.items():
            torch.testing.assert_close(theirs.grads[name], grad, rtol=0, atol=0)


def test_a_sweep_through_torchrun_has_the_local_sweeps_rows():
    from mbtune.sweeping.config import SweepConfig
    from mbtune.sweeping.run import sweep_workload

    config = SweepConfig(workload="mlp", workload_options=(("layers", 2), ("width", 32)), device="cpu", num_ranks=2,
                         schedules=("gpipe", "1f1b"), micro_batches=(2,), grad_accum_steps=(1, 2), micro_batch_size=(2,),
                         measured_steps=1, threads=1)
    local, elastic = sweep_workload(config), sweep_workload(replace(config, launcher="torchrun"))
    assert [r.point for r in elastic.results] == [r.point for r in local.results]
    assert [r.status for r in elastic.results] == ["ok"] * 4 and [r.loss for r in elastic.results] == [
        r.loss for r in local.results]
    assert all(r.ran_as.endswith(", torchrun") for r in elastic.results)


@pytest.mark.slow
def test_a_rank_killed_like_the_oom_killer_is_named_as_killed(tmp_path):
    spec = PipelineSpec(workload="tests.fixtures.workloads:killed_once",
                        workload_options=(("marker", str(tmp_path / "killed")),), num_ranks=2, num_micro_batches=2,
                        micro_batch_size=4, measured_steps=1)
    nodes = Nodes()
    try:
        killed = session(nodes).run_point(spec, timeout_s=60)
        again = session(nodes).run_point(spec, timeout_s=60)  # the marker is there: it runs
    finally:
        close_session(nodes, 0)
    assert killed.status == "killed" and killed.failed_rank == 1 and "SIGKILL" in killed.error, killed.error
    assert again.ok, again.error


@pytest.mark.slow
def test_a_hung_rank_ends_the_point_at_its_deadline(monkeypatch):
    from mbtune.pipeline.launch import HANG_RANK_ENV

    monkeypatch.setenv(HANG_RANK_ENV, "1")
    spec = PipelineSpec(workload="mlp", workload_options=(("layers", 2), ("width", 16)), num_ranks=2,
                        num_micro_batches=2, measured_steps=1)
    nodes = Nodes()
    started = time.monotonic()
    try:
        outcome = session(nodes).run_point(spec, timeout_s=4)
    finally:
        close_session(nodes, 0)
    assert outcome.status == "timeout" and "still running after 4 s" in outcome.error, outcome.error
    assert time.monotonic() - started < 30


@pytest.mark.slow
def test_two_nodes_run_every_point_and_only_node_0_writes(tmp_path):
    # 2 stages, one rank per node; then 2 stages x 2 replicas, two ranks per node.
    tag, leader, follower = two_nodes(tmp_path, [*SWEEP, "--steps", "1", "--accum", "1", "--data-parallel", "1,2"])
    out, err = leader.communicate(timeout=300)
    follower_out, follower_err = follower.communicate(timeout=60)
    assert leader.returncode == 0 and follower.returncode == 0, err + follower_err
    report = json.loads(out)
    assert [r["status"] for r in report["results"]] == ["ok"] * 4
    assert all("torchrun on 2 node(s)" in r["ran_as"] for r in report["results"])
    assert sorted(r["point"]["data_parallel_size"] for r in report["results"]) == [1, 1, 2, 2]
    # Each pipeline rank of one stage-per-node point on its own node, named in the record.
    alone = [r for r in report["results"] if r["point"]["data_parallel_size"] == 1]
    assert all({n.split(" (")[0] for n in r["rank_nodes"]} == {"node 0", "node 1"} for r in alone)
    [profile] = (tmp_path / "node0" / "profiles").glob("cpu-*/mlp.json")
    assert len(json.loads(profile.read_text())["sweep"]["results"]) == 4
    planned = mbtune("plan", str(profile), "--stages", "4", "--ranks-per-node", "2", "--format", "json")
    assert planned.returncode == 0, planned.stderr
    assert any("hand-overs between nodes cost" in w and "measured across nodes" in w
               for w in json.loads(planned.stdout)["warnings"])
    assert follower_out == "" and sorted(p.name for p in (tmp_path / "node1").iterdir()) == []
    assert "node 0 ended the run (exit code 0)" in follower_err
    assert orphans(tag) == set()


@pytest.mark.slow
def test_a_node_killed_mid_sweep_fails_its_point_and_the_sweep_goes_on(tmp_path):
    tag, leader, follower = two_nodes(tmp_path, [*SWEEP, "-O", "width=256", "--steps", "400", "--point-timeout", "60"])
    seen = ""
    while "point 2:" not in seen:
        line = follower.stderr.readline()
        assert line, f"node 1 ended early: {seen}"
        seen += line
    time.sleep(1.0)  # inside the second point's steps
    follower.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    out, err = leader.communicate(timeout=120)
    follower.wait(timeout=30)
    assert time.monotonic() - killed < 60 + 15  # the point deadline plus a little, never a hang
    statuses = [r["status"] for r in json.loads(out)["results"]]
    assert statuses[0] == "ok" and statuses[1:] == ["error"] * 3, err
    assert leader.returncode == 0  # one point ran: a verdict, not "could not run"
    errors = [r["error"] for r in json.loads(out)["results"][2:]]
    assert all("node 1 stopped answering" in e for e in errors), errors
    assert orphans(tag) == set()


@pytest.mark.slow
def test_a_node_that_never_joins_fails_every_point_at_the_join_timeout(tmp_path):
    tag, endpoint = uuid.uuid4().hex, f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    leader = node([*SWEEP, "--steps", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint, "--join-timeout", "4"], 0,
                  tmp_path / "node0", tag)
    out, err = leader.communicate(timeout=120)
    assert leader.returncode == 3, err  # nothing ran
    results = json.loads(out)["results"] if out.strip() else []
    assert results and all("node 1 never joined within 4 s" in r["error"] for r in results), (out, err)
    assert time.monotonic() - started < 60
    assert orphans(tag) == set()


@pytest.mark.slow
def test_ctrl_c_on_node_0_stops_every_node_with_what_finished_saved(tmp_path):
    tag, leader, follower = two_nodes(tmp_path, [*SWEEP, "-O", "width=256", "--steps", "200"])
    seen = ""
    while "trial 1:" not in seen:  # the first point finished, the second runs
        line = leader.stderr.readline()
        assert line, f"node 0 ended early: {seen}"
        seen += line
    leader.send_signal(signal.SIGINT)
    out, err = leader.communicate(timeout=60)
    follower_err = follower.communicate(timeout=60)[1]
    assert leader.returncode == 130 and follower.returncode == 130, err + follower_err
    [profile] = (tmp_path / "node0" / "profiles").glob("cpu-*/mlp.json")
    saved = json.loads(profile.read_text())["sweep"]
    assert saved["interrupted"] is True and [r["status"] for r in saved["results"]][:1] == ["ok"]
    assert "node 0 ended the run (exit code 130)" in follower_err
    assert orphans(tag) == set()
