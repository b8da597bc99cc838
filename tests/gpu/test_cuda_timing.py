"""CUDA-event timing of a real one-rank pipeline, and a CUDA sweep point's NVML and load figures (marked gpu;
skipped with a reason where no CUDA device is visible)."""

from __future__ import annotations

import pytest

from mbtune.pipeline.launch import run_pipeline_point
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.records import OK
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.run import sweep_workload

pytestmark = pytest.mark.gpu

GPT = (("layers", 4), ("d_model", 256), ("heads", 4), ("seq_len", 256), ("vocab", 4096))
EVENT_RESOLUTION_S = 1e-5  # CUDA events resolve about half a microsecond; perf_counter far better


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])  # one stage per rank; two stages on the one rank
def test_event_timed_actions_do_not_overlap_and_stay_inside_their_step(schedule: str) -> None:
    spec = PipelineSpec(workload="gpt", workload_options=GPT, schedule=schedule, num_ranks=1, num_micro_batches=4,
                        micro_batch_size=4, grad_accum_steps=2, warmup_steps=1, measured_steps=3, device="cuda",
                        precision="bf16")
    outcome = run_pipeline_point(spec, timeout_s=300)
    assert outcome.status == OK, f"{outcome.error}\n{outcome.error_detail}"
    [report] = outcome.reports
    assert len(report.cuda_step_times_s) == len(report.step_times_s) == spec.measured_steps
    for cuda_s, wall_s in zip(report.cuda_step_times_s, report.step_times_s):
        assert 0 < cuda_s <= wall_s + EVENT_RESOLUTION_S
    assert report.device_uuid and report.device_uuid.startswith(("GPU-", "MIG-"))
    assert report.cpu_time_s and report.cpu_time_s > 0
    start_unix_s, end_unix_s = report.measured_window_unix_s
    assert end_unix_s - start_unix_s >= sum(report.step_times_s) - 0.01
    per_pipeline_step = 2 * spec.num_micro_batches * spec.stages_per_rank + spec.num_micro_batches  # fwd, bwd, loss
    if schedule == "zbv":
        per_pipeline_step += spec.num_micro_batches * spec.stages_per_rank  # backward split into input and weight
    assert len(report.actions) == per_pipeline_step * spec.grad_accum_steps * spec.measured_steps
    for step in range(spec.measured_steps):
        actions = sorted((a for a in report.actions if a.step == step), key=lambda a: a.start_s)
        for action in actions:
            assert -EVENT_RESOLUTION_S <= action.start_s <= action.end_s
            assert action.end_s <= report.pipeline_times_s[step] + EVENT_RESOLUTION_S
        for before, after in zip(actions, actions[1:]):
            assert after.start_s >= before.end_s - EVENT_RESOLUTION_S, (before, after)


def test_cuda_sweep_point_reports_event_step_times_nvml_of_its_gpu_and_load() -> None:
    config = SweepConfig(workload="gpt", workload_options=GPT, device="cuda", num_ranks=1, schedules=("gpipe",),
                         micro_batches=(4,), grad_accum_steps=(1,), micro_batch_size=8, measured_steps=10,
                         precision="bf16")
    report = sweep_workload(config)
    [result] = report.results
    assert result.ok, result.error
    assert len(result.cuda_step_times_s) == len(result.step_times_s) == 10
    assert all(c <= w + EVENT_RESOLUTION_S for c, w in zip(result.cuda_step_times_s, result.step_times_s))
    assert result.load is not None and result.load.num_cpus >= 1
    if result.nvml.available:
        [gpu] = result.nvml.gpus  # only the point's one GPU, however many the machine has
        assert gpu.uuid == report.device.uuid
