"""The files serve writes for serving engines (serving/export.py): Triton's whole config.pbtxt, parsed as
Triton parses it where tritonclient is installed, and TorchServe's files in the keys TorchServe reads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mbtune.serving.export import TORCHSERVE_KEYS, model_name, triton_config, write_serving_files
from mbtune.serving.records import BatchConfig, ServiceCurve, TensorSignature
from tests.unit.test_serve_records import WINNER, report

CURVE = ServiceCurve(times=report().curve.times, threads=1,
                     inputs=(TensorSignature(dtype="int64", dims=(64,)),),
                     outputs=(TensorSignature(dtype="float32", dims=(64, 128)),))


def served():
    return replace(report(), workload="examples.nanogpt:workload", curve=CURVE, queue_timeout_s=0.5)


def test_the_triton_file_is_a_whole_model_configuration():
    text = triton_config(served(), WINNER)
    assert text == (
        'name: "examples_nanogpt_workload"\nbackend: "pytorch"\nmax_batch_size: 32\n'
        'input [\n  {\n    name: "INPUT__0"\n    data_type: TYPE_INT64\n    dims: [ 64 ]\n  }\n]\n'
        'output [\n  {\n    name: "OUTPUT__0"\n    data_type: TYPE_FP32\n    dims: [ 64, 128 ]\n  }\n]\n'
        "dynamic_batching {\n  preferred_batch_size: [ 8, 16 ]\n  max_queue_delay_microseconds: 2500\n"
        "  default_queue_policy {\n    timeout_action: REJECT\n    default_timeout_microseconds: 500000\n  }\n}\n")
    assert "preferred" not in triton_config(served(), BatchConfig(max_batch_size=4))


def test_tritons_own_model_config_reads_the_file():
    model_config = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    text_format = pytest.importorskip("google.protobuf.text_format")
    parsed = text_format.Parse(triton_config(served(), WINNER), model_config.ModelConfig())
    assert parsed.name == "examples_nanogpt_workload" and parsed.backend == "pytorch"
    assert parsed.max_batch_size == 32 and list(parsed.input[0].dims) == [64]
    assert parsed.input[0].data_type == model_config.TYPE_INT64 and list(parsed.output[0].dims) == [64, 128]
    assert list(parsed.dynamic_batching.preferred_batch_size) == [8, 16]
    assert parsed.dynamic_batching.max_queue_delay_microseconds == 2500
    policy = parsed.dynamic_batching.default_queue_policy
    assert policy.default_timeout_microseconds == 500000 and policy.timeout_action == policy.REJECT


def test_the_files_land_where_each_engine_looks_with_torchserves_keys(tmp_path):
    files = write_serving_files(served(), tmp_path)
    name = model_name(served().workload)
    assert files["triton"] == tmp_path / "triton" / name / "config.pbtxt"
    assert files["triton"].read_text() == triton_config(served(), served().winner.config, name)
    yaml_keys = dict(line.split(": ") for line in files["torchserve model-config"].read_text().splitlines())
    assert set(yaml_keys) <= set(TORCHSERVE_KEYS) and yaml_keys["batchSize"] == "32"
    assert yaml_keys["maxBatchDelay"] == "3"
    properties = dict(line.split("=", 1) for line in files["torchserve config.properties"].read_text().splitlines())
    assert properties["load_models"] == f"{name}.mar"
    settings = json.loads(properties["models"])[name]["1.0"]
    assert {k for k in settings if k not in ("defaultVersion", "marName")} <= set(TORCHSERVE_KEYS)
    assert settings["batchSize"] == 32 and settings["maxBatchDelay"] == 3
    assert write_serving_files(replace(served(), answers=(), best=None), tmp_path / "none") == {}
