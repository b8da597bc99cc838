"""The files a serving engine takes, for the configuration `mbtune serve` chose: a complete Triton
Inference Server config.pbtxt, and TorchServe's model-config.yaml and config.properties.

Triton (model_config.proto, protobuf text format): the model's name, the PyTorch backend, max_batch_size,
its inputs and outputs (the PyTorch backend's INPUT__n / OUTPUT__n names, data types, dimensions after the
batch's, as one sample through the model showed them) and dynamic_batching (preferred sizes, the queue
delay, and the queue timeout it was measured under as a rejecting queue policy). TorchServe: batchSize and
maxBatchDelay (milliseconds; TorchServe drops keys it does not know without a word, so the spelling is
its own), in model-config.yaml and in config.properties' `models` line.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from mbtune.atomic import write_atomic
from mbtune.errors import ProfileError
from mbtune.serving.records import BatchConfig, ServeReport, TensorSignature

# torch dtype -> Triton data type (model_config.proto's DataType).
TRITON_TYPES = {"bool": "TYPE_BOOL", "uint8": "TYPE_UINT8", "int8": "TYPE_INT8", "int16": "TYPE_INT16",
                "int32": "TYPE_INT32", "int64": "TYPE_INT64", "float16": "TYPE_FP16", "float32": "TYPE_FP32",
                "float64": "TYPE_FP64", "bfloat16": "TYPE_BF16"}
TORCHSERVE_KEYS = ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout")
TRITON_FILE, TORCHSERVE_YAML, TORCHSERVE_PROPERTIES = "config.pbtxt", "model-config.yaml", "config.properties"


def model_name(workload: str) -> str:
    """A name both engines take (letters, digits, '_' and '-'), from the workload's."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", workload).strip("_") or "model"


def triton_config(report: ServeReport, config: BatchConfig, name: str | None = None) -> str:
    """The whole config.pbtxt for `config`."""
    lines = [f'name: "{name or model_name(report.workload)}"', 'backend: "pytorch"',
             f"max_batch_size: {config.max_batch_size}"]
    for kind, tensors in (("input", report.curve.inputs), ("output", report.curve.outputs)):
        if tensors:
            lines.append(f"{kind} [")
            lines.append(",\n".join(_tensor(f"{kind.upper()}__{i}", t) for i, t in enumerate(tensors)))
            lines.append("]")
    lines.append("dynamic_batching {")
    if config.preferred:
        lines.append(f"  preferred_batch_size: [ {', '.join(map(str, config.preferred))} ]")
    lines.append(f"  max_queue_delay_microseconds: {round(config.max_queue_delay_s * 1e6)}")
    if report.queue_timeout_s is not None:
        lines += ["  default_queue_policy {", "    timeout_action: REJECT",
                  f"    default_timeout_microseconds: {round(report.queue_timeout_s * 1e6)}", "  }"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _tensor(name: str, tensor: TensorSignature) -> str:
    dims = ", ".join(map(str, tensor.dims)) if tensor.dims else "1"  # Triton wants one dimension at least
    dtype = TRITON_TYPES.get(tensor.dtype, "TYPE_FP32")
    return f'  {{\n    name: "{name}"\n    data_type: {dtype}\n    dims: [ {dims} ]\n  }}'


def torchserve_settings(config: BatchConfig) -> dict[str, int]:
    """TorchServe's batch settings for the configuration, in its own keys. TorchServe has no preferred
    sizes: it waits up to maxBatchDelay to fill batchSize."""
    return {"batchSize": config.max_batch_size, "maxBatchDelay": math.ceil(config.max_queue_delay_s * 1e3)}


def torchserve_model_config(config: BatchConfig) -> str:
    """model-config.yaml (packed into the .mar with torch-model-archiver --config-file)."""
    settings = {"minWorkers": 1, "maxWorkers": 1, **torchserve_settings(config), "responseTimeout": 120}
    return "".join(f"{key}: {value}\n" for key, value in settings.items())


def torchserve_properties(config: BatchConfig, name: str) -> str:
    """config.properties lines that load the model with these batch settings."""
    settings = {"defaultVersion": True, "marName": f"{name}.mar", "minWorkers": 1, "maxWorkers": 1,
                **torchserve_settings(config), "responseTimeout": 120}
    return (f"load_models={name}.mar\n"
            f"models={json.dumps({name: {'1.0': settings}}, separators=(',', ':'))}\n")


def write_serving_files(report: ServeReport, directory: Path) -> dict[str, Path]:
    """The winner's files under `directory`: triton/<name>/config.pbtxt (a Triton model repository's
    layout) and torchserve/model-config.yaml and config.properties. Empty when nothing met the budget."""
    winner = report.winner
    if winner is None:
        return {}
    name = model_name(report.workload)
    files = {"triton": directory / "triton" / name / TRITON_FILE,
             "torchserve model-config": directory / "torchserve" / TORCHSERVE_YAML,
             "torchserve config.properties": directory / "torchserve" / TORCHSERVE_PROPERTIES}
    texts = {"triton": triton_config(report, winner.config, name),
             "torchserve model-config": torchserve_model_config(winner.config),
             "torchserve config.properties": torchserve_properties(winner.config, name)}
    try:
        for key, path in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, texts[key])
    except OSError as exc:
        raise ProfileError(f"cannot write the serving files under {directory}: {exc.strerror or exc}",
                           hint="Choose a writable folder for --export.") from exc
    return files
