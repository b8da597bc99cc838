"""Real trial processes: every ending comes back as a TrialOutcome and nothing is left running."""

from __future__ import annotations

import os
import time

import pytest

from mbtune.probing.config import TrialConfig
from mbtune.probing.trial import run_trial
from mbtune.worker import run_isolated

pytestmark = pytest.mark.integration


def fixture(name: str, **kwargs) -> TrialConfig:
    return TrialConfig(workload=f"tests.fixtures.workloads:{name}", batch_size=2, threads=1, **kwargs)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ok_trial_reports_steps_and_peaks():
    outcome = run_trial(TrialConfig(workload="mlp", batch_size=8, threads=1, steps=3), timeout_s=60)
    assert outcome.status == "ok", outcome.error
    assert len(outcome.step_times_s) == 3 and all(s > 0 for s in outcome.step_times_s)
    assert outcome.peak_memory_bytes > 0 and outcome.budget_used_bytes > 0
    assert outcome.device.backend == "cpu" and outcome.loss is not None


def test_real_cpu_oom_is_classified_by_the_allocator_error():
    outcome = run_trial(TrialConfig(workload="mlp", batch_size=4096, memory_budget_bytes=64 * 2**20, threads=1),
                        timeout_s=60)
    assert outcome.status == "oom"
    assert "can't allocate memory" in outcome.error or "MemoryError" in outcome.error
    # The budget's count raised it, naming what it asked for and what was live: more than the budget together.
    assert outcome.oom_requested_bytes and outcome.oom_need_bytes > 64 * 2**20


def test_out_of_memory_type_is_oom_and_other_errors_are_not():
    assert run_trial(fixture("fake_oom"), timeout_s=60).status == "oom"
    broken = run_trial(fixture("broken"), timeout_s=60)
    assert broken.status == "error" and "shape mismatch in user block" in broken.error


def test_sigkill_is_reported_as_killed():
    outcome = run_trial(fixture("oom_killed"), timeout_s=60)
    assert outcome.status == "killed" and "SIGKILL" in outcome.error


@pytest.mark.slow
def test_hang_is_killed_at_the_deadline_with_its_whole_group():
    started = time.perf_counter()
    outcome = run_trial(fixture("hang"), timeout_s=3)
    assert outcome.status == "timeout"
    assert time.perf_counter() - started < 30


def _spawn_grandchild() -> int:
    import subprocess

    return subprocess.Popen(["sleep", "300"]).pid


def test_no_process_outlives_its_trial():
    result = run_isolated(_spawn_grandchild, timeout_s=30)
    assert result.status == "ok"
    deadline = time.monotonic() + 10
    while alive(result.value) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(result.value)
