from __future__ import annotations

import pytest

from mbtune.errors import ConfigError
from mbtune.probing.config import ProbeConfig, TrialConfig
from mbtune.units import parse_bytes, parse_device, parse_options


@pytest.mark.parametrize(("text", "expected"), [
    ("3GiB", 3 * 2**30), ("512MiB", 512 * 2**20), ("1.5G", 1_500_000_000), ("2048", 2048), ("3 gib", 3 * 2**30),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "3XB", "-1GiB", "0"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ConfigError):
        parse_bytes(text)


@pytest.mark.parametrize(("text", "expected"), [("auto", "auto"), ("CPU", "cpu"), ("cuda", "cuda:0"), ("cuda:3", "cuda:3")])
def test_parse_device(text, expected):
    assert parse_device(text) == expected


@pytest.mark.parametrize("text", ["gpu", "cuda:x", "cpu:1", "cuda:-1", "tpu:0"])
def test_parse_device_rejects(text):
    with pytest.raises(ConfigError, match="not recognised"):
        parse_device(text)


def test_parse_options_types():
    assert parse_options(["layers=4", "ratio=0.5", "name=x"]) == (("layers", 4), ("name", "x"), ("ratio", 0.5))
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_options(["layers"])


@pytest.mark.parametrize(("field", "value", "message"), [
    ("margin", 0.6, "margin=0.6 is out of range"), ("margin", -0.1, "margin"), ("granularity", 0, "granularity"),
    ("max_batch", 0, "max_batch"), ("confirm", 0, "confirm"), ("steps", 1, "steps"), ("precision", "fp8", "precision"),
    ("optimizer", "lion", "optimizer"), ("memory_budget_bytes", 0, "memory_budget"), ("threads", 0, "threads"),
])
def test_probe_config_names_field_value_and_range(field, value, message):
    with pytest.raises(ConfigError, match=message):
        ProbeConfig(**{field: value})


def test_margin_outside_usual_policy_warns_but_runs():
    assert ProbeConfig(margin=0.3).warnings() == ("margin 30% is outside the usual 10%-20% policy",)
    assert ProbeConfig(margin=0.15).warnings() == ()


def test_fp16_needs_cuda():
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        TrialConfig(workload="mlp", precision="fp16", device="cpu")
    assert TrialConfig(workload="mlp", precision="fp16", device="cuda:0").precision == "fp16"


def test_configs_are_frozen():
    config = ProbeConfig()
    with pytest.raises(AttributeError):
        config.margin = 0.2  # type: ignore[misc]


def test_nodes_come_from_the_flags_or_the_schedulers_environment():
    from mbtune.pipeline.nodes import nodes_from_env, parse_endpoint
    from mbtune.pipeline.torchrun import command_fingerprint

    assert parse_endpoint("node0:29400") == ("node0", 29400) and parse_endpoint("node0") == ("node0", 29500)
    assert parse_endpoint("[::1]:7") == ("::1", 7)
    slurm = {"SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "6000"}
    assert nodes_from_env(slurm) == {"nnodes": 4, "node_rank": 2, "endpoint": "n1:6000"}
    kubeflow = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_RDZV_ENDPOINT": "job-master-0:23456",
                "MASTER_ADDR": "ignored"}
    assert nodes_from_env(kubeflow) == {"nnodes": 2, "node_rank": 1, "endpoint": "job-master-0:23456"}
    assert nodes_from_env({"MASTER_ADDR": "n1"}) == {"endpoint": "n1:29500"} and nodes_from_env({}) == {}
    assert nodes_from_env({"PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "23456", "MASTER_ADDR": "x"}) == {
        "endpoint": "m:23456"}
    with pytest.raises(ConfigError, match="SLURM_NODEID='x' is not a whole number"):
        nodes_from_env({"SLURM_NODEID": "x"})
    # Node 0's outputs and the node rank are not what the nodes must agree on; the grid is.
    one = ["sweep", "-w", "gpt", "--node-rank", "0", "--profiles-dir", "/a", "-f", "json", "--no-save"]
    other = ["sweep", "-w", "gpt", "--node-rank=1", "--profiles-dir=/b"]
    assert command_fingerprint(one) == command_fingerprint(other) == "sweep -w gpt"
    assert command_fingerprint([*one, "-m", "2"]) != command_fingerprint(other)
