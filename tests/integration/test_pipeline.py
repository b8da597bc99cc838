"""Real pipelines on CPU/gloo: every schedule reproduces the unpipelined model's loss and gradients, the
timeline covers every action, and a hanging rank dies at the deadline without leaving a process behind."""

from __future__ import annotations

import contextlib
import io
import math
import os
import time

import pytest
import torch
import torch.distributed as dist

from mbtune.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, LOSS
from mbtune.pipeline.launch import HANG_RANK_ENV, run_pipeline_point
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.runner import step_batch
from mbtune.pipeline.theory import (
    SCHEDULE_NAMES,
    check_point,
    schedule_info,
    stage_to_rank,
    stages_per_rank_of,
    theoretical_bubble,
)
from mbtune.pipeline.timeline import PipelineOutcome, StageReport
from mbtune.records import ERROR, OK, TIMEOUT
from mbtune.workloads import load_workload

pytestmark = pytest.mark.integration

MLP = (("layers", 2), ("width", 32))  # 4 blocks: enough for two stages on each of two ranks
TIMEOUT_S = 60.0


def _spec(schedule: str, **overrides: object) -> PipelineSpec:
    settings: dict[str, object] = dict(workload="mlp", workload_options=MLP, schedule=schedule, num_ranks=2,
                                       num_micro_batches=4, micro_batch_size=3, warmup_steps=0, measured_steps=1,
                                       capture_grads=True, threads=1)
    settings.update(overrides)
    return PipelineSpec(**settings)  # type: ignore[arg-type]


def _run(spec: PipelineSpec) -> PipelineOutcome:
    outcome = run_pipeline_point(spec, timeout_s=TIMEOUT_S)
    assert outcome.status == OK, f"{outcome.error}\n{outcome.error_detail}"
    return outcome


def _reference(spec: PipelineSpec) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of the whole model on all of one optimizer step's samples at once."""
    workload = load_workload(spec.workload, spec.workload_options)
    model = workload.build(seed=spec.seed)
    batches = [step_batch(workload, spec.pipeline_batch_size, seed=spec.seed, step_index=0, accum_index=a)
               for a in range(spec.grad_accum_steps)]
    inputs = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    assert inputs.shape[0] == spec.global_batch
    loss = workload.loss(model(inputs), targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _assert_matches_reference(spec: PipelineSpec) -> None:
    outcome = _run(spec)
    ref_loss, ref_grads = _reference(spec)
    grads: dict[str, torch.Tensor] = {}
    for report in outcome.reports:
        assert report.grads is not None
        assert not set(grads) & set(report.grads), "a parameter lives on one rank only"
        grads.update(report.grads)
    assert sorted(grads) == sorted(ref_grads)
    torch.testing.assert_close(torch.tensor(outcome.loss), ref_loss, rtol=1e-5, atol=1e-6)
    for name, expected in ref_grads.items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_pipelined_step_matches_the_unpipelined_model(schedule: str) -> None:
    _assert_matches_reference(_spec(schedule))


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_accumulation_matches_one_batch_k_times_the_size(schedule: str) -> None:
    m = 4 if schedule == "dualpipev" else 2  # dualpipev needs a micro-batch for each of its 4 stages
    _assert_matches_reference(_spec(schedule, num_micro_batches=m, grad_accum_steps=3))


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])  # one full-backward, one split-backward schedule
def test_timed_run_records_every_action_and_a_bubble(schedule: str) -> None:
    spec = _spec(schedule, num_micro_batches=4, grad_accum_steps=2, warmup_steps=1, measured_steps=2,
                 capture_grads=False)
    outcome = _run(spec)
    assert len(outcome.step_times_s) == 2 and all(t > 0 for t in outcome.step_times_s)
    assert outcome.loss is not None and math.isfinite(outcome.loss)
    bubble = outcome.measured_bubble
    assert bubble is not None and 0.0 <= bubble < 1.0
    assert 0.0 <= theoretical_bubble(schedule, num_ranks=2, num_micro_batches=4) < 1.0
    for report in outcome.reports:
        assert report.peak_memory_bytes and report.peak_memory_bytes > 0
        assert len(report.warmup_step_times_s) == 1
        _assert_complete_timeline(spec, report)


def _assert_complete_timeline(spec: PipelineSpec, report: StageReport) -> None:
    """Exactly one forward and one backward (or backward-input + backward-weight) per stage, micro-batch,
    pipeline step and measured step, plus the loss on the last stage, all inside their step."""
    kinds: dict[tuple[int, int, int, int], list[str]] = {}
    for action in report.actions:
        assert 0.0 <= action.start_s <= action.end_s <= report.pipeline_times_s[action.step]
        kinds.setdefault((action.step, action.accum, action.stage, action.microbatch), []).append(action.kind)
    backward = [BACKWARD_INPUT, BACKWARD_WEIGHT] if schedule_info(spec.schedule).splits_backward else [BACKWARD]
    for step in range(spec.measured_steps):
        for accum in range(spec.grad_accum_steps):
            for stage in report.stage_indices:
                loss = [LOSS] if stage == spec.num_model_stages - 1 else []
                for microbatch in range(spec.num_micro_batches):
                    found = sorted(kinds.pop((step, accum, stage, microbatch)))
                    assert found == sorted([FORWARD, *backward, *loss])
    assert not kinds, f"unexpected actions: {kinds}"


@pytest.mark.slow
def test_hanging_rank_is_killed_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HANG_RANK_ENV, "1")
    started = time.monotonic()
    outcome = run_pipeline_point(_spec("1f1b", capture_grads=False), timeout_s=3.0, grace_s=1.0)
    elapsed = time.monotonic() - started
    assert outcome.status == TIMEOUT, outcome.error
    assert "still running after 3 s" in outcome.error
    # The rank would sleep an hour; far below that (and below the 60 s process-group timeout) proves the
    # deadline ended it. The slack covers a forkserver start-up on a loaded machine.
    assert elapsed < 55.0
    _assert_all_gone(outcome)


def test_failing_rank_reports_its_error_and_leaves_nothing() -> None:
    outcome = run_pipeline_point(_spec("gpipe", workload_options=(("no_such_option", 1),)), timeout_s=TIMEOUT_S)
    assert outcome.status == ERROR
    assert "WorkloadError: workload 'mlp' has no option no_such_option" in outcome.error
    assert "Traceback" in outcome.error_detail
    _assert_all_gone(outcome)


def _assert_all_gone(outcome: PipelineOutcome) -> None:
    assert len(outcome.pids) == 2 and all(code is not None for code in outcome.exit_codes)
    for pid in outcome.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert not os.path.exists(f"/proc/{pid}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a visible CUDA device")
def test_one_rank_on_cuda_matches_the_reference() -> None:
    # One GPU holds both stages of a one-rank zbv: the CUDA path (nccl, synchronize, CUDA peaks) without
    # needing two GPUs.
    spec = _spec("zbv", num_ranks=1, device="cuda")
    outcome = _run(spec)
    assert outcome.reports[0].memory_source == "cuda_max_allocated"
    grads = outcome.reports[0].grads or {}
    ref_loss, ref_grads = _reference(spec)
    torch.testing.assert_close(torch.tensor(outcome.loss), ref_loss, rtol=1e-4, atol=1e-5)
    for name, expected in ref_grads.items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-3, atol=1e-5)


# --- the pure rules agree with torch ----------------------------------------------------------------------------

def test_stage_layout_matches_torch() -> None:
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for ranks in range(1, 5):
        for per_rank in (1, 2, 3):
            expected = generate_stage_to_rank_mapping(ranks, ranks * per_rank, style="loop")
            assert stage_to_rank("looped-bfs", ranks, ranks * per_rank) == tuple(expected.values())
        expected = generate_stage_to_rank_mapping(ranks, 2 * ranks, style="v")
        assert stage_to_rank("zbv", ranks, 2 * ranks) == tuple(expected.values())


def test_check_point_agrees_with_torch_schedules() -> None:
    """For every layout mbtune allows, check_point accepts exactly the points torch builds and whose schedule
    torch's own simulator runs to completion (a fake process group: no processes, no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    disagreements, verdicts = [], set()
    for ranks in range(1, 5):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
        try:
            for schedule in SCHEDULE_NAMES:
                for per_rank in {stages_per_rank_of(schedule), stages_per_rank_of(schedule, 3)}:
                    for microbatches in range(1, 11):
                        ours = check_point(schedule, ranks * per_rank, ranks, microbatches) is None
                        theirs = _torch_accepts(schedule, ranks, per_rank, microbatches)
                        verdicts.add(theirs)
                        if ours != theirs:
                            disagreements.append((schedule, ranks, per_rank, microbatches, ours, theirs))
        finally:
            dist.destroy_process_group()
    assert not disagreements
    assert verdicts == {True, False}


def _torch_accepts(schedule: str, ranks: int, per_rank: int, microbatches: int) -> bool:
    from torch.distributed.pipelining import schedules as torch_schedules

    from mbtune.pipeline.schedules import build_schedule, build_stage

    num_model_stages = ranks * per_rank
    owners = stage_to_rank(schedule, ranks, num_model_stages)
    mine = [s for s in range(num_model_stages) if owners[s] == 0]
    try:
        stages = [build_stage(torch.nn.Linear(2, 2), stage_index=s, num_model_stages=num_model_stages,
                              device=torch.device("cpu"))
                  for s in mine]
        built = build_schedule(schedule, stages, num_micro_batches=microbatches, loss_fn=lambda out, _: out.sum())
    except ValueError:
        return False
    order = getattr(built, "pipeline_order_with_comms", None)
    if order is None:
        return True  # gpipe and 1f1b are hand-written loops; their constructors check everything
    def flat(actions):  # dualpipev overlaps a forward with a backward: one action holding both
        for a in actions:
            yield from flat(a.sub_actions) if getattr(a, "sub_actions", None) else (a,)

    compute_and_comms = {
        rank: [a for a in flat(actions) if a.computation_type in (
            torch_schedules.F, torch_schedules.B, torch_schedules.I, torch_schedules.W, torch_schedules.SEND_F,
            torch_schedules.RECV_F, torch_schedules.SEND_B, torch_schedules.RECV_B)]
        for rank, actions in order.items()
    }
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            torch_schedules._simulate_comms_compute(compute_and_comms, lambda s: built.stage_index_to_group_rank[s],
                                                    num_model_stages)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("schedule", ["gpipe", "zbv"])
def test_bf16_pipelined_step_matches_the_bf16_unpipelined_model(schedule: str) -> None:
    spec = _spec(schedule, precision="bf16")
    outcome = _run(spec)
    workload = load_workload(spec.workload, spec.workload_options)
    model = workload.build(seed=spec.seed)
    inputs, targets = step_batch(workload, spec.pipeline_batch_size, seed=spec.seed, step_index=0, accum_index=0)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = workload.loss(model(inputs), targets)
    loss.backward()
    grads = {name: g for report in outcome.reports for name, g in report.grads.items()}
    assert all(g.dtype == torch.float32 for g in grads.values())  # fp32 master weights and gradients
    assert [r.output_dtype for r in outcome.reports if r.output_dtype] == ["bfloat16"]  # autocast really ran
    assert {r.output_dtype for r in _run(_spec(schedule)).reports} == {"", "float32"}
    # Micro-batching changes bf16 rounding order, so agreement is to bf16 precision, not bit for bit.
    torch.testing.assert_close(torch.tensor(outcome.loss), loss.detach().float(), rtol=2e-2, atol=2e-2)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=5e-2, atol=5e-3, msg=lambda m, name=name: f"{name}: {m}")
