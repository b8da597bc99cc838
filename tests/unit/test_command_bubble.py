"""The bubble of the user's own pipelined command: what the cap timed in each process (schedule steps and
their actions, by optimizer step) read as mbtune's ranks report, and summarised by the same rule."""

from __future__ import annotations

import pytest

from mbtune.pipeline.timeline import bubble_from_reports
from mbtune.sweeping.command import stage_reports


def _process(rank: int, stages: list[int], steps: list[list], step_times: list[float], peak: int = 100) -> dict:
    return {"pid": 1000 + rank, "rank": rank, "started": float(rank), "peak_bytes": peak, "step_times_s": step_times,
            "pipeline": {"schedule": "ScheduleGPipe", "stages": stages, "num_stages": 2, "micro_batches": 2,
                         "steps": steps}}


def _two_ranks(warmup_offset: float = 100.0) -> list[dict]:
    """Two ranks, GPipe over 2 micro-batches, each action 1 s: a warm-up optimizer step (0) and one measured
    (1), whose schedule step spans 6 s on each rank (4 s busy): bubble 1 - 8 / (2 x 6) = 1/3."""
    def step(index: int, t0: float, actions: list[tuple]) -> list:
        return [index, t0, t0 + 6.0, [[s, k, m, t0 + a, t0 + b] for s, k, m, a, b in actions]]

    rank0 = [(0, "forward", 0, 0, 1), (0, "forward", 1, 1, 2), (0, "backward", 0, 4, 5), (0, "backward", 1, 5, 6)]
    rank1 = [(1, "forward", 0, 1, 2), (1, "forward", 1, 2, 3), (1, "backward", 0, 3, 4), (1, "backward", 1, 4, 5)]
    return [_process(0, [0], [step(0, 0.0, rank0), step(1, warmup_offset, rank0)], [7.0, 6.5], peak=300),
            _process(1, [1], [step(0, 0.0, rank1), step(1, warmup_offset, rank1)], [7.0, 6.5], peak=200)]


def test_each_process_is_the_rank_of_its_stages_and_the_warm_up_is_left_out() -> None:
    reports = stage_reports(_two_ranks(), warmup=1, step_times_s=(6.5,), device="cpu")
    assert [(r.rank, r.stage_indices, r.num_ranks, r.peak_memory_bytes) for r in reports] == [
        (0, (0,), 2, 300), (1, (1,), 2, 200)]
    for r in reports:
        assert r.pipeline_times_s == (6.0,) and r.step_times_s == (6.5,)
        assert len(r.actions) == 4 and {a.step for a in r.actions} == {0}
        assert min(a.start_s for a in r.actions) >= 0.0  # from the schedule step's start, not the process's clock
    assert bubble_from_reports(reports) == pytest.approx(1 / 3)


def test_accumulation_steps_are_the_schedule_steps_of_one_optimizer_step() -> None:
    processes = _two_ranks()
    for process in processes:  # a second schedule step in the measured optimizer step, 10 s after the first
        first = process["pipeline"]["steps"][1]
        later = [first[0], first[1] + 10.0, first[2] + 10.0, [[s, k, m, a + 10.0, b + 10.0] for s, k, m, a, b in first[3]]]
        process["pipeline"]["steps"].append(later)
    reports = stage_reports(processes, warmup=1, step_times_s=(16.5,), device="cpu")
    for r in reports:
        assert r.pipeline_times_s == (16.0,)  # the first schedule step's start to the last one's end
        assert sorted({a.accum for a in r.actions}) == [0, 1] and len(r.actions) == 8
    assert bubble_from_reports(reports) == pytest.approx(1 - 16 / 32)


def test_a_second_process_with_the_same_stages_is_a_replica() -> None:
    processes = _two_ranks() + [dict(p, rank=p["rank"] + 2, pid=p["pid"] + 2) for p in _two_ranks()]
    reports = stage_reports(processes, warmup=1, step_times_s=(6.5,), device="cpu")
    assert sorted((r.rank, r.replica) for r in reports) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_no_schedule_or_nothing_past_the_warm_up_is_no_report() -> None:
    plain = [{"pid": 1, "rank": None, "peak_bytes": 5, "step_times_s": [1.0, 1.0]}]
    assert stage_reports(plain, warmup=1, step_times_s=(1.0,), device="cpu") == ()
    assert stage_reports(_two_ranks(), warmup=2, step_times_s=(6.5,), device="cpu") == ()


def test_the_commands_gpus_are_those_its_processes_name_or_nvml_saw_them_on() -> None:
    """On CUDA a command's processes pick their own GPUs: NVML samples every one, and the point keeps those its
    processes allocated on (the cap names them), else those NVML saw its pids compute on."""
    import time

    from mbtune.device.nvml import NvmlSampler
    from mbtune.sweeping.command import command_nvml, measured_window
    from tests.unit.test_nvml import FakeNvml

    started = time.time()
    with NvmlSampler(interval_s=0.01, nvml=FakeNvml(processes={0: [111], 1: [222]})) as sampler:
        time.sleep(0.1)
    ends = [started + 0.02, started + 0.04, started + 0.09]
    named = [{"pid": 999, "device_uuids": ["GPU-1"], "step_ends_unix_s": ends}]
    assert measured_window(named, warmup=1) == (ends[0], ends[-1])
    summary = command_nvml(sampler, named, warmup=1)
    assert summary.available and [g.uuid for g in summary.gpus] == ["GPU-1"]
    assert summary.gpus[0].num_samples >= 1 and summary.gpus[0].kernel_active_pct_median == 50

    by_pid = [{"pid": 111, "step_ends_unix_s": ends}]  # it named none: the GPU its pid computed on
    assert [g.uuid for g in command_nvml(sampler, by_pid, warmup=1).gpus] == ["GPU-0"]

    nowhere = command_nvml(sampler, [{"pid": 333}], warmup=1)
    assert not nowhere.available and "none of the command's processes" in nowhere.reason
