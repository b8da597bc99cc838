"""A data-parallel point's reports: one pipeline is read for the bubble and the timeline, every replica
for memory, step time, loss and the all-reduce."""

from __future__ import annotations

import pytest

from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.timeline import ActionRecord, PipelineOutcome, StageReport
from mbtune.sweeping.measured import step_timeline


def _report(rank: int, replica: int, *, peak: int, loss: float | None, allreduce: tuple[float, float]) -> StageReport:
    actions = (ActionRecord(step=0, accum=0, stage=rank, kind="forward", microbatch=0, start_s=0.1 * rank,
                            end_s=0.1 * rank + 0.05),)
    return StageReport(rank=rank, num_ranks=2, replica=replica, device="cpu", stage_indices=(rank,),
                       block_indices=((rank,),), num_parameters=10, step_times_s=(1.0 + replica,),
                       pipeline_times_s=(0.5,), actions=actions, losses=(loss,) if loss is not None else (),
                       peak_memory_bytes=peak, allreduce_spans_s=(allreduce,))


def _outcome() -> PipelineOutcome:
    reports = (_report(0, 0, peak=100, loss=None, allreduce=(0.5, 0.6)),
               _report(1, 0, peak=300, loss=0.25, allreduce=(0.5, 0.8)),
               _report(0, 1, peak=150, loss=None, allreduce=(0.5, 0.7)),
               _report(1, 1, peak=200, loss=0.5, allreduce=(0.5, 0.55)))
    return PipelineOutcome(status="ok", reports=reports)


def test_replicas_are_merged_per_pipeline_rank():
    outcome = _outcome()
    assert [(r.rank, r.replica) for r in outcome.pipeline_reports] == [(0, 0), (1, 0)]
    assert outcome.peak_memory_bytes == (150, 300)  # per pipeline rank, the highest replica
    assert outcome.loss == pytest.approx(0.75)  # each replica's loss is already over the replicas
    assert outcome.allreduce_times_s == pytest.approx((0.3,))  # the slowest rank's
    assert outcome.step_times_s == (2.0,)


def test_the_timeline_shows_each_ranks_all_reduce_after_its_pipeline():
    timeline = step_timeline(_outcome().pipeline_reports, 0)
    reduces = [a for a in timeline if a.kind == "allreduce"]
    assert [(a.rank, a.stage, a.start_s, a.end_s) for a in reduces] == [(0, 0, 0.5, 0.6), (1, 1, 0.5, 0.8)]


def test_a_spec_places_each_process_and_counts_the_world():
    spec = PipelineSpec(workload="mlp", num_ranks=2, data_parallel_size=3, num_micro_batches=2, micro_batch_size=4,
                        grad_accum_steps=2)
    assert spec.world_size == 6 and [spec.place(r) for r in range(6)] == [(0, 0), (1, 0), (0, 1), (1, 1),
                                                                           (0, 2), (1, 2)]
    assert spec.replicas_batch_size == 24 and spec.global_batch == 48
