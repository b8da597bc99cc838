"""Rank processes kept between points on CUDA (pipeline/warm.py): the same process (its CUDA context and
NCCL group made once) runs the next point, the allocator's peak statistics reset and its cache emptied
between points, so a kept point's peak is what a fresh process measures (marked gpu; skipped without CUDA)."""

from __future__ import annotations

import pytest

from mbtune.pipeline.launch import run_pipeline_point
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.warm import WarmRanks

pytestmark = pytest.mark.gpu

GPT = (("layers", 4), ("d_model", 256), ("heads", 4), ("seq_len", 256), ("vocab", 4096))
PEAK_NOISE = 0.05  # a CUDA allocator's peak moves a few percent with what it cached before


def _spec(**change) -> PipelineSpec:
    return PipelineSpec(**{"workload": "gpt", "workload_options": GPT, "schedule": "1f1b", "num_ranks": 1,
                           "num_micro_batches": 4, "micro_batch_size": 4, "warmup_steps": 1, "measured_steps": 3,
                           "device": "cuda", "precision": "bf16", **change})


def test_kept_cuda_ranks_run_the_next_point_with_their_peak_measured_afresh():
    with WarmRanks() as ranks:
        large = ranks.run(_spec(micro_batch_size=16), timeout_s=300)
        small = ranks.run(_spec(), timeout_s=300)
        again = ranks.run(_spec(), timeout_s=300)
        assert large.ok and small.ok and again.ok, (large.error, small.error, again.error)
        assert large.pids == small.pids == again.pids and ranks.starts == 1 and not small.fresh_processes
    fresh = run_pipeline_point(_spec(), timeout_s=300)
    assert fresh.ok, fresh.error
    [peak_fresh], [peak_small], [peak_again], [peak_large] = (o.peak_memory_bytes for o in (fresh, small, again, large))
    # Reset between points: the smaller point's peak is its own, not the larger one's before it.
    assert peak_small < peak_large
    assert abs(peak_small - peak_fresh) <= PEAK_NOISE * peak_fresh
    assert abs(peak_again - peak_fresh) <= PEAK_NOISE * peak_fresh
