"""Rank processes kept between points (pipeline/warm.py): the same processes run the next point of the same
placement, its peak memory what fresh processes count; another placement, or any failure, starts a new set
and leaves no process of the old one."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from mbtune.pipeline.launch import HANG_RANK_ENV, run_pipeline_point
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.theory import SCHEDULE_NAMES
from mbtune.pipeline.warm import WarmRanks


def _spec(**change) -> PipelineSpec:
    settings = {"workload": "mlp", "workload_options": (("width", 64), ("layers", 4)), "schedule": "gpipe",
                "num_ranks": 2, "num_micro_batches": 2, "micro_batch_size": 4, "warmup_steps": 1,
                "measured_steps": 2, "threads": 1, **change}
    return PipelineSpec(**settings)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_points_of_one_placement_run_on_the_same_processes_and_count_what_fresh_ones_count():
    with WarmRanks() as ranks:
        first = ranks.run(_spec(), timeout_s=120)
        again = ranks.run(_spec(schedule="1f1b"), timeout_s=120)
        same = ranks.run(_spec(), timeout_s=120)
        assert first.ok and again.ok and same.ok, (first.error, again.error, same.error)
        assert first.fresh_processes and not again.fresh_processes and not same.fresh_processes
        assert first.pids == again.pids == same.pids and ranks.starts == 1
        pids = first.pids
    fresh = run_pipeline_point(_spec(), timeout_s=120)
    # The count is of the point's own tensors: the same program counts the same bytes, kept or fresh; a point
    # the set counted once runs uncounted after that.
    assert first.peak_memory_bytes == fresh.peak_memory_bytes and None not in first.peak_memory_bytes
    assert None not in again.peak_memory_bytes and same.peak_memory_bytes == (None, None)
    assert not any(_alive(pid) for pid in pids)  # closed: none left


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_a_point_run_again_on_its_processes_is_primed_and_trains_as_a_fresh_one_would(schedule):
    # The second run of a point on the same processes skips its warm-up step (torch's first-step setup done
    # before the steps instead), and that setup changes nothing the steps compute: its losses are, bit for bit,
    # those of fresh processes run without a warm-up step.
    spec = _spec(schedule=schedule, num_micro_batches=4, workload_options=(("width", 32), ("layers", 8)))
    with WarmRanks() as ranks:
        first = ranks.run(spec, timeout_s=120)
        primed = ranks.run(spec, timeout_s=120)
    fresh = run_pipeline_point(replace(spec, warmup_steps=0), timeout_s=120)
    assert first.ok and primed.ok and fresh.ok, (first.error, primed.error, fresh.error)
    assert [len(r.warmup_step_times_s) for r in first.reports] == [1, 1]
    assert [len(r.warmup_step_times_s) for r in primed.reports] == [0, 0]
    assert [len(r.step_times_s) for r in primed.reports] == [2, 2]
    losses = [r.losses for r in primed.reports if r.losses]
    assert losses and losses == [r.losses for r in fresh.reports if r.losses]


def test_another_placement_starts_a_new_set_and_ends_the_old():
    with WarmRanks() as ranks:
        two = ranks.run(_spec(), timeout_s=120)
        one = ranks.run(_spec(num_ranks=1), timeout_s=120)
        assert two.ok and one.ok and ranks.starts == 2 and one.fresh_processes
        assert not any(_alive(pid) for pid in two.pids)


def test_after_a_failure_the_next_point_starts_afresh(monkeypatch):
    with WarmRanks() as ranks:
        monkeypatch.setenv(HANG_RANK_ENV, "1")
        hung = ranks.run(_spec(), timeout_s=5)
        assert hung.status == "timeout" and "still running after 5 s" in hung.error
        assert not any(_alive(pid) for pid in hung.pids)
        monkeypatch.delenv(HANG_RANK_ENV)
        after = ranks.run(_spec(), timeout_s=120)
        assert after.ok and after.fresh_processes and ranks.starts == 2
        assert not set(after.pids) & set(hung.pids)


@pytest.mark.parametrize("timeout_s", [0.0, -1.0])
def test_a_deadline_must_be_positive(timeout_s):
    with WarmRanks() as ranks, pytest.raises(ValueError, match="timeout_s must be positive"):
        ranks.run(_spec(), timeout_s=timeout_s)


def test_a_schedule_torch_sets_up_otherwise_is_not_primed():
    # Where torch's schedules lack the setup prime_schedule calls, nothing is done and the caller keeps its
    # warm-up step.
    from types import SimpleNamespace

    from mbtune.pipeline.schedules import prime_schedule

    assert prime_schedule(SimpleNamespace(_stage=None), (), target=None) is False
    called = []
    other = SimpleNamespace(_stage=SimpleNamespace(), _has_backward=True, _n_microbatches=2,
                            _split_inputs=lambda a, k: ([a, a], [k, k]),
                            _initialize_stage=lambda inputs, options, *, mode: called.append(mode))
    assert prime_schedule(other, (), target=None) is False and not called
