"""The planning entry points over saved profiles: block facts on the meta device, plans with the ceiling
checked, and the errors a user can cause."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch import nn

from mbtune.errors import ConfigError, ProfileError
from mbtune.pipeline.point import SweepPoint
from mbtune.planning.api import (
    block_facts,
    calibrate_profile,
    memory_limit,
    plan_from_profile,
    recommended_timeline,
    validate_profile,
)
from mbtune.planning.config import PlanConfig
from mbtune.records import DeviceInfo
from mbtune.saving.profiles import Metadata, Profile
from mbtune.sweeping.records import SweepReport
from mbtune.workloads import Workload
from mbtune.workloads.mlp import mlp
from tests.unit.test_plan_calibrate import TRUTH, measured
from tests.unit.test_records import sample_probe

OPTIONS = {"layers": 2, "width": 8, "classes": 4}
METADATA = Metadata(mbtune_version="test", torch_version="", python_version="", host="", platform="",
                    command_line="", created_at="")


def test_block_facts_of_the_mlp() -> None:
    facts = block_facts("mlp", OPTIONS)
    assert facts.num_blocks == 4 and facts.weight_source == "flops"
    # Linear(8, 8); LayerNorm(8) + Linear(8, 16) + Linear(16, 8), twice; Linear(8, 4).
    assert facts.parameters == (72, 296, 296, 36)
    assert facts.weights == (2 * 64, 2 * (128 + 128), 2 * (128 + 128), 2 * 32)  # forward FLOPs per sample
    assert facts.output_bytes_per_sample == (32, 32, 32, 16)  # fp32 widths 8, 8, 8 and 4 classes
    assert all(saved > 0 for saved in facts.saved_bytes_per_sample[1:3])  # norm, up, gelu kept for backward


def no_meta() -> Workload:
    """A workload whose blocks cannot run on the meta device (they read a real tensor's values)."""
    class Item(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return self.linear(x) * float(x.sum().item() > 0)

    base = mlp(layers=1, width=8)
    return Workload(name="no-meta", blocks=[Item, Item], make_batch=base.make_batch, loss=base.loss)


def test_blocks_the_meta_device_cannot_run_fall_back_to_parameters() -> None:
    facts = block_facts("tests.unit.test_plan_api:no_meta")
    assert facts.weight_source == "parameters" and facts.parameters == (72, 72)
    assert facts.saved_bytes_per_sample == ()


def profile(with_probe: bool = True) -> Profile:
    facts = block_facts("mlp", OPTIONS)
    model = replace(TRUTH, facts=facts, blocks=(TRUTH.blocks[0],) * facts.num_blocks)
    points = [SweepPoint(schedule=s, num_ranks=2, num_micro_batches=m, grad_accum_steps=1, micro_batch_size=4)
              for s in ("gpipe", "1f1b") for m in (2, 4)]
    results = tuple(measured(p, model) for p in points)
    sweep = SweepReport(workload="mlp", workload_options=OPTIONS, device=DeviceInfo(backend="cpu", name="Test CPU"),
                        objective="throughput", results=results, ranking=(0, 1, 2, 3),
                        ceiling_peak_memory_bytes=int(TRUTH.base_bytes * 1.1) if with_probe else None, ceiling=40)
    return Profile(schema_version=1, metadata=METADATA, sweep=sweep)


def test_plan_from_a_profile_checks_memory_against_the_ceiling() -> None:
    report = plan_from_profile(profile(), PlanConfig(num_ranks=2, micro_batches=(4, 8, 64), schedules=("gpipe", "1f1b")))
    assert report.memory_limit_bytes == pytest.approx(TRUTH.base_bytes * 1.1)
    assert "probed ceiling" in report.memory_limit_source
    assert report.validation is not None and report.validation.median_step_error == pytest.approx(0.0, abs=1e-9)
    assert report.best is not None and report.best.fits
    assert {p.point.micro_batch_size for p in report.predictions} == {4}  # the measured size by default
    assert report.device is not None and report.device.name == "Test CPU"
    unlimited = plan_from_profile(profile(with_probe=False), PlanConfig(num_ranks=2, micro_batches=(4,),
                                                                        schedules=("gpipe",), validation_method=None))
    assert unlimited.memory_limit_bytes is None and unlimited.validation is None
    assert unlimited.predictions[0].fits is None


def test_more_stages_than_blocks_plans_a_deeper_model_and_says_so() -> None:
    report = plan_from_profile(profile(), PlanConfig(num_ranks=4, micro_batches=(4,),
                                                     schedules=("gpipe", "interleaved-1f1b"), validation_method=None))
    assert report.num_blocks == 4  # the mlp's own: enough for gpipe's 4 stages
    depths = {p.point.schedule: p.num_blocks for p in report.predictions}
    assert depths == {"gpipe": 4, "interleaved-1f1b": 8} and not report.skipped  # 4 ranks x 2 stages each
    assert any("has 4 blocks, too few" in w and "interleaved-1f1b as 8 blocks" in w and "--blocks" in w
               for w in report.warnings)
    chosen = plan_from_profile(profile(), PlanConfig(num_ranks=4, micro_batches=(4,), schedules=("interleaved-1f1b",),
                                                     num_blocks=4, validation_method=None))
    assert not chosen.predictions and "--blocks" in chosen.skipped[0].reason


def test_a_prediction_does_not_depend_on_the_other_schedules_listed() -> None:
    def gpipe(schedules: tuple[str, ...]) -> list:
        report = plan_from_profile(profile(), PlanConfig(num_ranks=8, micro_batches=(16,), schedules=schedules,
                                                         validation_method=None))
        return [p for p in report.predictions if p.point.schedule == "gpipe"]

    alone = gpipe(("gpipe",))
    assert alone == gpipe(("gpipe", "interleaved-1f1b", "zbv")) and alone[0].num_blocks == 8


def test_scatter_none_plans_and_validates_with_average_costs() -> None:
    report = plan_from_profile(profile(), PlanConfig(num_ranks=2, micro_batches=(4,), schedules=("gpipe",),
                                                     scatter="none"))
    assert report.scatter == "none" and not report.model.spread.known
    assert report.validation is not None and report.validation.scatter == "none"
    assert plan_from_profile(profile(), PlanConfig(num_ranks=2, micro_batches=(4,), schedules=("gpipe",),
                                                   validation_method=None)).scatter == "measured"


def test_an_unresolved_probe_memory_model_leaves_out_per_sample_memory() -> None:
    resolved = profile()
    unresolved_probe = replace(sample_probe(), memory_model=replace(sample_probe().memory_model, resolved=False))
    unresolved = replace(resolved, probe=unresolved_probe)
    grid = PlanConfig(num_ranks=2, micro_batches=(4,), schedules=("gpipe",), validation_method=None)
    counted, left_out = plan_from_profile(resolved, grid), plan_from_profile(unresolved, grid)
    assert counted.per_sample_memory and not any("per-sample memory" in w for w in counted.warnings)
    assert not left_out.per_sample_memory
    assert [w for w in left_out.warnings if w.startswith("no per-sample memory")] == [
        ("no per-sample memory (the probe's memory model is not resolved): memory per rank is the measured base "
         "plus parameter state, in-flight activations not counted")]
    assert left_out.model.facts.saved_bytes_per_sample == ()
    # The base takes in what the activations were at the measured points, so it is larger.
    assert left_out.model.base_bytes > counted.model.base_bytes
    [prediction] = left_out.predictions
    assert prediction.stage_memory_bytes == pytest.approx(
        [16.0 * sum(left_out.model.facts.parameters[b] for b in blocks) for blocks in ((0, 1), (2, 3))])
    assert prediction.memory_bytes == pytest.approx([left_out.model.base_bytes + s for s in prediction.stage_memory_bytes])


def test_model_and_validation_of_a_profile() -> None:
    assert calibrate_profile(profile()).num_points == 4
    assert validate_profile(profile(), method="in-sample").method == "in-sample"


def test_memory_limit_falls_back_to_the_probe() -> None:
    probe = sample_probe()
    assert memory_limit(Profile(schema_version=1, metadata=METADATA, probe=probe)) == (
        float(2**30), "the probe's memory budget")
    at_ceiling = replace(probe, trials=(replace(probe.trials[0], batch_size=4),))
    assert memory_limit(Profile(schema_version=1, metadata=METADATA, probe=at_ceiling)) == (
        10.0, "peak at the probed ceiling (batch 4)")
    assert memory_limit(Profile(schema_version=1, metadata=METADATA)) == (None, "")


def test_the_keyword_call_builds_a_config_and_keeps_the_recommended_timeline() -> None:
    by_keywords = plan_from_profile(profile(), stages=2, micro_batches=(4,), schedules="gpipe",
                                    validation="none")
    config = PlanConfig(num_ranks=2, micro_batches=(4,), schedules=("gpipe",), validation_method=None)
    plain, kept = plan_from_profile(profile(), config), plan_from_profile(profile(), replace(config, keep_timeline=True))
    assert not plain.recommended_timeline and kept.recommended_timeline == by_keywords.recommended_timeline
    assert replace(kept, recommended_timeline=()) == plain  # keeping the timeline changes nothing else
    stages = {a.stage for a in kept.recommended_timeline}
    assert stages == {0, 1} and recommended_timeline(kept).timeline == kept.recommended_timeline
    assert recommended_timeline(plain).timeline == kept.recommended_timeline  # simulated again: the same
    assert kept.best is not None and kept.best.seed is not None  # the profile's timelines scatter
    # The timeline is the draw the prediction is the median of.
    assert max(a.end_s for a in kept.recommended_timeline) == pytest.approx(kept.best.pipeline_s)
    with pytest.raises(ConfigError, match="stages=0 is out of range") as info:
        plan_from_profile(profile(), stages=0)
    assert info.value.field == "num_ranks"
    with pytest.raises(TypeError, match="not both"):
        plan_from_profile(profile(), config, stages=2)


def test_a_profile_without_a_timed_sweep_cannot_be_planned_from() -> None:
    with pytest.raises(ProfileError, match="no sweep with measured timelines") as info:
        plan_from_profile(Profile(schema_version=1, metadata=METADATA, probe=sample_probe()),
                          PlanConfig(num_ranks=2, micro_batches=(4,), schedules=("gpipe",)))
    assert "Run mbtune sweep" in info.value.one_line()


@pytest.mark.parametrize(("schedule", "ranks"), [("gpipe", 2), ("interleaved-1f1b", 2), ("zbv", 2), ("1f1b", 3)])
def test_the_planner_splits_stages_exactly_as_the_runner(schedule, ranks):
    from mbtune.pipeline.point import SweepPoint
    from mbtune.pipeline.point_spec import PipelineSpec
    from mbtune.pipeline.runner import stage_blocks
    from mbtune.planning.memory import point_split
    from mbtune.workloads import load_workload

    spec = PipelineSpec(workload="gpt", schedule=schedule, num_ranks=ranks, num_micro_batches=6)
    point = SweepPoint(schedule=schedule, num_ranks=ranks, num_micro_batches=6, grad_accum_steps=1,
                       micro_batch_size=1, stages_per_rank=spec.stages_per_rank)
    facts = block_facts("gpt")
    assert facts.split_weights[0] == 0  # the embedding lookup carries no weight
    assert point_split(point, facts) == stage_blocks(spec, load_workload("gpt"))


def test_the_plan_counts_the_optimizer_state_of_the_optimizer_the_sweep_trained_with() -> None:
    from mbtune.planning.memory import STATE_BYTES_PER_PARAMETER

    grid = PlanConfig(num_ranks=2, micro_batches=(4,), schedules=("gpipe",), validation_method=None)
    base = profile()
    assert base.sweep is not None and base.sweep.optimizer == "adamw"
    for optimizer in ("adamw", "sgd"):
        report = plan_from_profile(replace(base, sweep=replace(base.sweep, optimizer=optimizer)), grid)
        assert report.model.state_bytes_per_parameter == STATE_BYTES_PER_PARAMETER[optimizer]


def test_another_device_scales_compute_by_peak_flops_and_says_it_is_an_estimate() -> None:
    on_a100 = profile()
    assert on_a100.sweep is not None
    on_a100 = replace(on_a100, sweep=replace(on_a100.sweep, device=DeviceInfo(backend="cuda", name="NVIDIA A100-SXM4-80GB")))
    config = PlanConfig(num_ranks=2, micro_batches=(4,), schedules=("gpipe",), validation_method=None, scatter="none")
    here = plan_from_profile(on_a100, config).predictions[0]
    there = plan_from_profile(on_a100, replace(config, target_device="H200"))
    moved = there.predictions[0]
    assert there.estimated_for == "H200" and any("estimate for H200" in w for w in there.warnings)
    factor = 19.5e12 / 67e12  # fp32 dense peaks: A100 against H200
    assert moved.update_s == pytest.approx(here.update_s * factor)
    assert moved.memory_bytes == here.memory_bytes  # memory never needs the device
    # Compute shrinks by the factor; hand-overs and gaps do not, so the step shrinks by less.
    assert here.step_time_s * factor < moved.step_time_s < here.step_time_s
    with pytest.raises(ConfigError, match="no known fp32 peak") as info:
        plan_from_profile(profile(), replace(config, target_device="H200"))  # profiled on a CPU
    assert info.value.field == "target_device"
    with pytest.raises(ConfigError, match="no fp32 peak FLOP/s is known for 'TPU v9'"):
        plan_from_profile(on_a100, replace(config, target_device="TPU v9"))
