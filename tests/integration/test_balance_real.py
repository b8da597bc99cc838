"""The timing pass for balancing stages, run for real in a fresh process on the CPU."""

from __future__ import annotations

import statistics

import pytest

from mbtune.errors import TrialFailedError
from mbtune.pipeline.balance import measure_block_times
from mbtune.pipeline.split import split_blocks

pytestmark = pytest.mark.integration

SLOW = "tests.fixtures.workloads:slow_block"


def _stage_of(split: tuple[tuple[int, ...], ...], block: int) -> tuple[int, ...]:
    return next(blocks for blocks in split if block in blocks)


def test_the_block_that_does_forty_times_the_work_is_timed_heaviest_and_gets_a_smaller_stage():
    times = measure_block_times(SLOW, (("slow", 2), ("work", 40)), micro_batch_size=8, threads=1,
                                timeout_s=60.0)
    assert len(times) == 6 and all(t > 0 for t in times)
    others = [t for i, t in enumerate(times) if i != 2]
    # 40x the arithmetic and 40x the kernel launches: a factor 3 over the others' median holds under any noise.
    assert times[2] > 3 * statistics.median(others), times
    by_time, equal = split_blocks(6, 3, times), split_blocks(6, 3, [1.0] * 6)
    assert len(_stage_of(by_time, 2)) < len(_stage_of(equal, 2)), (times, by_time)


@pytest.mark.parametrize("name, says", [("broken", "ValueError: shape mismatch in user block"),
                                        ("import_fails", "needs a package that is not installed")])
def test_a_failing_workload_ends_the_timing_pass_with_one_line(name, says):
    with pytest.raises(TrialFailedError) as caught:
        measure_block_times(f"tests.fixtures.workloads:{name}", (), micro_batch_size=2, timeout_s=60.0)
    message = str(caught.value)
    assert message.startswith("the timing pass for balancing stages ended as error: ") and says in message
    assert "\n" not in message and caught.value.detail
    assert "\n" not in caught.value.one_line()


def test_a_sweep_balanced_by_time_moves_blocks_off_the_slow_stage_and_shows_the_imbalance():
    from mbtune.sweeping.config import SweepConfig
    from mbtune.sweeping.run import sweep_workload

    def run(balance: str):
        config = SweepConfig(workload=SLOW, device="cpu", num_ranks=3, schedules=("1f1b",), micro_batches=(3,),
                             grad_accum_steps=(1,), micro_batch_size=8, measured_steps=1, balance=balance)
        report = sweep_workload(config)
        [result] = report.results
        assert result.ok, result.error
        return report, result

    by_params, plain = run("params")
    by_time, timed = run("time")
    assert by_params.balance.by == "parameters" and not by_params.balance.block_times_s
    assert by_time.balance.by == "time" and len(by_time.balance.block_times_s) == 6
    assert by_time.balance.micro_batch_size == 8
    # Equal parameters: two blocks a stage. By time: the split of the times the timing pass measured (which
    # block they make heaviest is measured noise on a busy machine; the first test shows the slow one is).
    assert plain.stage_blocks == ((0, 1), (2, 3), (4, 5))
    assert timed.stage_blocks == split_blocks(6, 3, by_time.balance.block_times_s)
    for result in (plain, timed):
        assert result.stage_imbalance is not None and result.stage_imbalance >= 1.0
