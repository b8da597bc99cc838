"""`mbtune sweep -- COMMAND` of a pipelined script on CUDA: the command's processes pick their own GPU (LOCAL_RANK),
the cap times its schedule's actions with CUDA events, and NVML samples the GPU its processes allocated on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCRIPT = str(Path(__file__).parents[1] / "fixtures" / "train_scripts" / "pipe_mlp.py")


def test_a_pipelined_commands_point_on_cuda_has_its_bubble_and_its_gpus_nvml(capsys) -> None:
    from mbtune.cli import main
    from mbtune.device.cuda import device_uuid

    with pytest.raises(SystemExit) as ended:
        main(["-q", "sweep", "-d", "cuda", "--stages", "1", "--schedules", "gpipe", "--micro-batches", "4", "--accum",
              "1", "--micro-batch-size", "64", "--repeats", "1", "--steps", "5", "--no-save", "-f", "json", "--",
              sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", SCRIPT, "--micro-batch-size",
              "{micro_batch_size}", "--micro-batches", "{micro_batches}", "--schedule", "{schedule}", "--width",
              "1024", "--device", "cuda"])
    assert ended.value.code == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["status"] == "ok", row["error"]
    assert row["bubble_measured"] is not None and 0.0 <= row["bubble_measured"] <= 1.0
    assert all(a["end_s"] >= a["start_s"] >= 0.0 for a in row["timeline"])  # event times, from the step's origin
    assert row["peak_memory_bytes"][0] and row["peak_memory_bytes"][0] > 0
    nvml = row["nvml"]
    assert nvml["available"], nvml["reason"]
    assert [g["uuid"] for g in nvml["gpus"]] == [device_uuid(0)]
    assert nvml["gpus"][0]["num_samples"] >= 1 and nvml["gpus"][0]["memory_used_bytes_max"] > 0
