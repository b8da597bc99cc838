"""PlanConfig: every bad setting is a ConfigError naming its field, grids too large to simulate in seconds are
refused with how to shrink them, and a valid config still plans."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest

from mbtune.errors import ConfigError
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.theory import SCHEDULE_NAMES, stages_per_rank_of
from mbtune.planning.api import plan_from_profile
from mbtune.planning.calibrate import point_orders
from mbtune.planning.config import (
    MAX_COUNT,
    MAX_HELD_BYTES,
    MAX_MODEL_STAGES,
    MAX_SIMULATED_ACTIONS,
    PlanConfig,
)
from mbtune.planning.planner import point_actions, spread_samples
from tests.unit.test_plan_api import profile

NAN, INF = float("nan"), float("inf")

BAD = [
    # types: int is not bool nor float, floats are finite, lists hold the right items
    ("num_ranks", True), ("num_ranks", 2.0), ("num_ranks", "8"), ("num_ranks", None),
    ("micro_batches", 8), ("micro_batches", "8,16"), ("micro_batches", (4, 2.5)), ("micro_batches", (True,)),
    ("schedules", "gpipe"), ("schedules", ("gpipe", 1)), ("data_parallel_size", 1.5), ("micro_batch_size", True),
    ("global_batch", 64.0), ("grad_accum_steps", False), ("num_blocks", 8.0), ("stages_per_rank", 2.0),
    ("link_bandwidth_bytes_per_s", NAN), ("link_bandwidth_bytes_per_s", INF), ("link_latency_s", INF),
    ("link_latency_s", "5us"), ("validation_method", True), ("scatter", None), ("keep_timeline", 1),
    # ranges, enums, repeats
    ("num_ranks", 0), ("num_ranks", -3), ("micro_batches", ()), ("micro_batches", (4, 0)), ("micro_batches", (-1,)),
    ("micro_batches", (4, 8, 4)), ("schedules", ()), ("schedules", ("gpipe", "pipedream")),
    ("schedules", ("gpipe", "1f1b", "gpipe")), ("data_parallel_size", 0), ("data_parallel_size", MAX_COUNT + 1),
    ("micro_batch_size", 0), ("global_batch", 0), ("global_batch", 2**40), ("grad_accum_steps", 0),
    ("num_blocks", 2), ("num_blocks", 1025), ("stages_per_rank", 0), ("stages_per_rank", 1),
    ("link_bandwidth_bytes_per_s", 0.0), ("link_bandwidth_bytes_per_s", -1e9), ("link_latency_s", -1e-6),
    ("validation_method", "maybe"), ("scatter", "sometimes"),
    # bounds: more than the simulation answers in seconds
    ("num_ranks", 100_000), ("num_ranks", MAX_MODEL_STAGES + 1), ("micro_batches", (8, 10_000_000)),
    ("grad_accum_steps", 10**8), ("stages_per_rank", 10**6),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_a_bad_setting_is_a_config_error_naming_its_field(field, value) -> None:
    with pytest.raises(ConfigError) as info:
        PlanConfig(**{field: value})
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")
    assert len(info.value.one_line()) <= 200


def test_both_micro_batch_size_and_global_batch_are_refused() -> None:
    with pytest.raises(ConfigError, match="micro_batch_size and global_batch both given") as info:
        PlanConfig(micro_batch_size=4, global_batch=64)
    assert info.value.field == "micro_batch_size"


def test_a_huge_value_is_shortened_in_the_message() -> None:
    with pytest.raises(ConfigError) as info:
        PlanConfig(micro_batches=tuple(range(100_000)))  # starts with 0
    assert len(str(info.value)) < 200 and "..." in str(info.value)


@pytest.mark.parametrize(("schedules", "stages", "expected"), [
    (("interleaved-1f1b",), 600, "at most 512 with interleaved-1f1b at 2 stages per rank"),
    (("zbv",), 513, "at most 512 with zbv"),
    (("gpipe", "looped-bfs"), 300, "at most 256 with looped-bfs at 4 stages per rank"),
])
def test_stages_in_all_are_bounded(schedules, stages, expected) -> None:
    virtual = 4 if "looped-bfs" in schedules else 2
    with pytest.raises(ConfigError, match=expected) as info:
        PlanConfig(num_ranks=stages, micro_batches=(stages,), schedules=schedules, stages_per_rank=virtual)
    assert info.value.field == "num_ranks"


def test_a_grid_too_large_to_simulate_is_refused_with_how_to_shrink_it() -> None:
    counts = tuple(range(32, 32 * 81, 32))  # 80 micro-batch counts, 32 to 2560
    grid = {"num_ranks": 32, "micro_batches": counts, "schedules": ("gpipe", "1f1b", "zero-bubble")}
    with pytest.raises(ConfigError, match=r"the grid needs ~275M simulated actions \(limit 100M; zero-bubble p=32 "
                                          r"m=1952 alone 1.87M\)") as info:
        PlanConfig(**grid)
    assert "fewer stages, micro-batches, accumulation steps or schedules" in info.value.one_line()
    # Average costs simulate each point once, so the same grid fits.
    assert PlanConfig(**grid, scatter="none").work().simulated_actions == (2 + 2 + 3 * 2) * 32 * sum(counts)


def test_a_grid_whose_simulation_would_not_fit_in_memory_is_refused() -> None:
    grid = {"num_ranks": 512, "micro_batches": (4096,), "schedules": ("zero-bubble",)}
    with pytest.raises(ConfigError, match=r"the grid would hold ~11.7 GB of simulation state \(limit 6 GB\)"):
        PlanConfig(**grid)
    assert PlanConfig(num_ranks=512, micro_batches=(1024,), schedules=("zero-bubble",)).work().memory_bytes < MAX_HELD_BYTES


def test_the_work_counts_what_the_planner_simulates() -> None:
    # The design's example: 64 ranks, 256 micro-batches, the default schedules (v=2, zero-bubble splits backward).
    work = PlanConfig(num_ranks=64, micro_batches=(256,)).work()
    gpipe, looped, split = 2 * 64 * 256, 2 * 128 * 256, 3 * 128 * 256
    assert [spread_samples(a) for a in (gpipe, looped, split)] == [15, 15, 15]
    assert work.simulated_actions == 15 * (2 * gpipe + looped + split) <= MAX_SIMULATED_ACTIONS
    assert work.held_actions == 2 * gpipe + looped + split
    assert work.memory_bytes == 150 * work.held_actions + 300 * split + 160 * 15 * split
    assert replace(PlanConfig(num_ranks=64, micro_batches=(256,)), keep_timeline=True).work() == work
    # Points that cannot run are not simulated: 1f1b needs as many micro-batches as ranks.
    assert PlanConfig(num_ranks=512, micro_batches=(8,), schedules=("1f1b",)).work().simulated_actions == 0


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize("virtual", [2, 3])
def test_point_actions_are_the_actions_of_the_schedule_orders(schedule, virtual) -> None:
    point = SweepPoint(schedule=schedule, num_ranks=4, num_micro_batches=8, grad_accum_steps=2, micro_batch_size=1,
                       stages_per_rank=stages_per_rank_of(schedule, virtual))
    ordered = 2 * sum(len(order) for order in point_orders(point))
    if schedule == "dualpipev":  # it splits some backwards, not all: the count bounds it from above
        assert 2 * 2 * 4 * 2 * 8 < ordered <= point_actions(point)
    else:
        assert point_actions(point) == ordered


def test_a_valid_config_plans() -> None:
    config = PlanConfig(num_ranks=2, micro_batches=[4, 8], schedules=["gpipe", "1f1b"], validation_method=None,
                        link_latency_s=0, grad_accum_steps=2)
    assert config.micro_batches == (4, 8) and config.schedules == ("gpipe", "1f1b")  # lists become tuples
    assert config.link().latency_s == 0 and config.grid().grad_accum_steps == 2
    report = plan_from_profile(profile(), config)
    assert len(report.predictions) == 4 and report.best is not None
    assert {p.point.global_batch for p in report.predictions} == {4 * 4 * 2, 8 * 4 * 2}
    with pytest.raises(FrozenInstanceError):
        config.num_ranks = 4  # type: ignore[misc]


@pytest.mark.parametrize("options", [
    ("--validation", "maybe"), ("--accum", "0"), ("--stages-per-rank", "0"), ("--stages", "100000"),
    ("--micro-batches", "10000000"), ("--micro-batches", "8,16,8"), ("--schedules", "gpipe,gpipe"),
    ("--stages", "512", "--micro-batches", "4096", "--schedules", "zero-bubble"),
    ("--gpus", "8"), ("--gpus", "0", "--global-batch", "64"), ("--gpus", "64", "--global-batch", "3"),
    ("--gpus", "8", "--global-batch", "64", "--device-memory", "0"),
])
def test_the_cli_refuses_a_bad_plan_in_one_line_before_simulating(options, tmp_path) -> None:
    from mbtune.saving.profiles import write_profile
    from tests.unit.test_cli import mbtune_here

    write_profile(tmp_path / "mlp.json", profile())
    result = mbtune_here("plan", str(tmp_path / "mlp.json"), *options)
    assert result.returncode == 2 and "Traceback" not in result.stderr and not result.stdout
    assert len(result.stderr.strip().splitlines()) == 1
