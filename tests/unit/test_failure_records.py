"""Failure causes as pure logic: how child deaths are classified, what records keep, how reports show it."""

from __future__ import annotations

import io
import re
import signal

import pytest
from rich.console import Console

from mbtune.errors import HarnessError, TrialFailedError, WorkloadBrokenError
from mbtune.pipeline.launch import block_ranges
from mbtune.probing.records import TrialOutcome
from mbtune.probing.search import search_ceiling
from mbtune.records import NONFINITE, STATUSES
from mbtune.report.probe import CAUSE_CHARS, cause_line, trials_table
from mbtune.report.profile import error_tails
from mbtune.sweeping.records import PointResult
from mbtune.worker import MAIN_GUARD_EXIT_CODE, _died, failure_tail, tail_lines
from tests.unit.test_records import sample_probe


def _failing(outcome: TrialOutcome, below: int = 1):
    """A fake trial: ok below `below`, then `outcome` at that size and above."""
    def run(size: int) -> TrialOutcome:
        if size < below:
            return TrialOutcome(status="ok", batch_size=size, budget_used_bytes=size)
        return TrialOutcome(**{**outcome.__dict__, "batch_size": size})
    return run


def test_nonfinite_is_a_status_of_its_own():
    assert NONFINITE == "nonfinite" and NONFINITE in STATUSES
    assert STATUSES[:5] == ("ok", "oom", "error", "timeout", "killed")  # appended, nothing moved


def test_a_probe_stops_on_a_nonfinite_loss_with_no_usable_result():
    nan = TrialOutcome(status="nonfinite", batch_size=0, error="the loss is nan at step 2: training diverged",
                       error_kind="workload")
    with pytest.raises(TrialFailedError) as caught:  # after sizes that trained: the run diverged (exit 3)
        search_ceiling(_failing(nan, 4), max_batch=64)
    assert re.fullmatch(r"the trial at batch \d+ stopped: the loss is nan at step 2", caught.value.message)
    with pytest.raises(WorkloadBrokenError) as broken:  # at the first trial: the workload's own loss (exit 2)
        search_ceiling(_failing(nan, 1), max_batch=64)
    assert re.fullmatch(r"the workload's loss is not finite in the first trial \(batch \d+\): the loss is nan at "
                        r"step 2", broken.value.message) and broken.value.exit_code == 2


def test_a_probe_reports_a_harness_failure_as_the_harness_not_the_workload():
    dead = TrialOutcome(status="error", batch_size=0, error="trial process exited with code 1 before the trial began",
                        error_kind="harness")
    with pytest.raises(HarnessError, match="the trial at batch 1 could not start its worker process") as raised:
        search_ceiling(_failing(dead), max_batch=64)
    assert raised.value.exit_code == 3 and "workload" not in str(raised.value)
    assert raised.value.hint == "Trial process exited with code 1 before the trial began"  # never cut
    broken = TrialOutcome(status="error", batch_size=0, error="ValueError: shape", error_kind="workload")
    with pytest.raises(WorkloadBrokenError):
        search_ceiling(_failing(broken), max_batch=64)
    with pytest.raises(TrialFailedError):
        search_ceiling(_failing(broken, below=4), max_batch=64)


def test_a_child_that_died_is_classified_by_how_far_it_got():
    guard = _died(MAIN_GUARD_EXIT_CODE, 1.0, began=False)
    assert guard.error_kind == "harness" and 'if __name__ == "__main__":' in guard.error
    early = _died(1, 1.0, began=False)
    assert early.status == "error" and early.error_kind == "harness" and "before the trial began" in early.error
    late = _died(1, 1.0, began=True, stderr="Fatal Python error: Aborted\n")
    assert late.error_kind == "workload" and "while running the trial" in late.error
    assert late.error_tail == "stderr:\nFatal Python error: Aborted"
    killed = _died(-signal.SIGKILL, 1.0)
    assert killed.status == "killed" and killed.error_kind == "workload"
    bootstrap = _died(1, 1.0, began=True, stderr="RuntimeError: ... before the current process has finished its "
                                                 "bootstrapping phase.")
    assert bootstrap.error_kind == "harness" and "main guard" in bootstrap.error


def test_tails_keep_the_last_lines_and_a_traceback_keeps_its_header():
    text = "\n".join(f"line {i}" for i in range(50))
    assert tail_lines(text).splitlines() == [f"line {i}" for i in range(30, 50)]
    traceback = "Traceback (most recent call last):\n" + text
    kept = tail_lines(traceback).splitlines()
    assert len(kept) == 20 and kept[:2] == ["Traceback (most recent call last):", "  ..."] and kept[-1] == "line 49"
    assert failure_tail("ValueError: x", "") == "ValueError: x"
    assert failure_tail("ValueError: x", "a warning\n") == "ValueError: x\nstderr:\na warning"


def test_block_ranges_name_runs():
    assert block_ranges((2, 3)) == "2-3"
    assert block_ranges((0, 1, 2, 6, 7, 9)) == "0-2, 6-7, 9"
    assert block_ranges(()) == ""


def test_old_records_without_the_cause_fields_still_load():
    point = {"schedule": "gpipe", "num_ranks": 2, "num_micro_batches": 2, "grad_accum_steps": 1, "micro_batch_size": 2}
    result = PointResult.from_dict({"point": point, "status": "error", "error": "rank 1: boom"})
    assert (result.failed_rank, result.failed_blocks, result.error_kind, result.error_tail) == (None, (), "", "")
    trial = TrialOutcome.from_dict({"status": "oom", "batch_size": 8})
    assert (trial.error_kind, trial.error_tail) == ("", "")


def test_cause_line_is_one_short_line():
    assert cause_line("Traceback (most recent call last):\n  File x\nValueError: bad") == "ValueError: bad"
    assert cause_line("rank 1 (blocks 2-3): boom\nmore", "harness") == "harness: rank 1 (blocks 2-3): boom"
    long = cause_line("x" * 500)
    assert len(long) == CAUSE_CHARS and long.endswith("...")
    assert cause_line("") == "no error text"


def test_trials_table_shows_a_cause_only_when_a_trial_failed():
    console = Console(file=io.StringIO(), width=140, color_system=None)
    console.print(trials_table(sample_probe().trials))
    text = console.file.getvalue()
    assert "cause" in text and "DefaultCPUAllocator: can't allocate memory" in text
    console = Console(file=io.StringIO(), width=140, color_system=None)
    console.print(trials_table(sample_probe().trials[:1]))
    assert "cause" not in console.file.getvalue()


def test_error_tails_list_every_failed_trial_with_its_whole_text():
    from mbtune.saving.profiles import SCHEMA_VERSION, Metadata, Profile

    probe = sample_probe()
    failed = TrialOutcome(status="error", batch_size=16, error="ValueError: bad", error_kind="workload",
                          error_tail="Traceback (most recent call last):\n  File x\nValueError: bad")
    probe = type(probe)(**{**probe.__dict__, "trials": probe.trials + (failed,)})
    meta = Metadata(mbtune_version="0", torch_version="0", python_version="3", host="h", platform="p",
                    command_line="c", created_at="now")
    tails = error_tails(Profile(schema_version=SCHEMA_VERSION, metadata=meta, probe=probe))
    headings = [heading for heading, _ in tails]
    assert headings == ["probe trial 2 (batch 8): oom", "probe trial 3 (batch 16): error, workload"]
    assert tails[1][1] == failed.error_tail  # the error line is in the tail already: said once
    assert tails[0][1] == "DefaultCPUAllocator: can't allocate memory"
