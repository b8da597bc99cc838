from __future__ import annotations

import json

from mbtune.probing.records import MemoryModel, ProbeResult, TrialOutcome
from mbtune.records import DeviceInfo
from mbtune.saving.profiles import SCHEMA_VERSION, Metadata, Profile


def sample_probe() -> ProbeResult:
    device = DeviceInfo(backend="cpu", name="Test CPU", total_memory_bytes=2**34, torch_version="2.13.0", num_cpus=2)
    trials = (
        TrialOutcome(status="ok", batch_size=1, step_times_s=(0.2, 0.1, 0.3), peak_memory_bytes=10, budget_used_bytes=5, device=device),
        TrialOutcome(status="oom", batch_size=8, error="DefaultCPUAllocator: can't allocate memory"),
    )
    return ProbeResult(
        workload="mlp", workload_options={"layers": 2}, device=device, trials=trials, ceiling=4, first_failing=5,
        margin=0.15, granularity=1, safe_batch=3, safe_batch_verified=True, memory_budget_bytes=2**30,
        memory_model=MemoryModel(fixed_bytes=1.0, per_sample_bytes=2.0, fit_error_pct=0.5, num_points=3),
        warnings=("w",),
    )


def test_probe_result_round_trips_through_json():
    probe = sample_probe()
    assert ProbeResult.from_dict(json.loads(json.dumps(probe.to_dict()))) == probe


def test_profile_round_trips_with_schema_version():
    meta = Metadata(mbtune_version="0.1.0", torch_version="2.13.0", python_version="3.11", host="h", platform="p",
                    command_line="mbtune probe", created_at="now", allocator_settings={"MALLOC_ARENA_MAX": "2"})
    profile = Profile(schema_version=SCHEMA_VERSION, metadata=meta, probe=sample_probe())
    data = json.loads(json.dumps(profile.to_dict()))
    assert data["schema_version"] == SCHEMA_VERSION
    assert Profile.from_dict(data) == profile


def test_outcome_derived_figures():
    trial = sample_probe().trials[0]
    assert trial.step_time_s == 0.2  # median of the steps after the first
    assert trial.samples_per_s == 5.0
    assert sample_probe().trials[1].samples_per_s is None


def test_records_have_a_short_repr_and_a_frame():
    from dataclasses import replace

    probe = sample_probe()
    many = replace(probe, trials=tuple(TrialOutcome(status="ok", batch_size=b, step_times_s=(0.1, 0.1),
                                                    error="x" * 1000) for b in range(1, 200)))
    text = repr(many)
    assert "trials=<199 items>" in text and len(text) < 600 and "xxxx" not in text
    frame = many.to_frame()
    assert list(frame["batch_size"]) == list(range(1, 200)) and "status" in frame.columns
    one = Profile(schema_version=SCHEMA_VERSION, probe=probe, metadata=Metadata(
        mbtune_version="0", torch_version="2", python_version="3", host="h", platform="p", command_line="x",
        created_at="now"))
    assert "probe=ProbeResult(...)" in repr(one) and len(one.to_frame()) == 1


def test_a_sweep_takes_its_plain_bounds_from_the_plain_search_and_its_recompute_bound_from_the_other():
    from dataclasses import replace

    from mbtune.probing.records import RecomputeCeiling
    from mbtune.sweeping.limits import sweep_limits

    full = RecomputeCeiling(recompute="full", ceiling=9, first_failing=10, safe_batch=7, safe_batch_verified=True,
                            trials=4, peak_memory_bytes=99)
    probe = replace(sample_probe(), recompute_ceilings=(full,))
    assert sweep_limits(probe) == {"safe_batch": 3, "ceiling": 4, "ceiling_peak_memory_bytes": None,
                                   "recompute_safe_batch": 7}
    only_full = replace(sample_probe(), recompute="full")  # probed with recompute alone
    assert sweep_limits(only_full) == {"safe_batch": None, "ceiling": None, "ceiling_peak_memory_bytes": None,
                                       "recompute_safe_batch": 3}
