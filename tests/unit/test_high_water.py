"""A run's memory over time (pure logic): samples merged in pairs keeping their highs, the watch's passes and
steps on a fake clock, the rises of the high-water mark named with when and during what, and their words."""

from __future__ import annotations

import pytest

from mbtune.probing import memory_watch
from mbtune.probing.high_water import (
    CHECKPOINT,
    EVALUATION,
    MAX_KEPT_SAMPLES,
    START_UP,
    TRAINING,
    PassSeen,
    Rise,
    high_water,
    name_rises,
    thin,
)
from mbtune.probing.memory_watch import FIELDS, Watch, halve
from mbtune.report.confirm import fmt_clock, high_water_text, memory_lines, passes_text

MIB = 2**20


def test_halving_keeps_the_later_time_and_every_figures_high_and_an_odd_last_sample():
    samples = [[1.0, 5, 10, 1], [2.0, 7, 12, 2], [3.0, 3, 12, 3], [4.0, 2, 12, 4], [5.0, 9, 20, 5]]
    assert halve(samples) == [[2.0, 7, 12, 2], [4.0, 3, 12, 4], [5.0, 9, 20, 5]]


def test_thinning_fits_any_run_in_the_limit_and_keeps_its_highest_mark():
    rows = [{"t_s": float(i), "live_bytes": i % 7, "peak_bytes": i, "steps": i} for i in range(1000)]
    kept = thin(rows, MAX_KEPT_SAMPLES, list(FIELDS))
    assert MAX_KEPT_SAMPLES // 2 < len(kept) <= MAX_KEPT_SAMPLES
    assert kept[-1]["peak_bytes"] == 999 and max(r["live_bytes"] for r in kept) == 6


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_watch_joins_a_passs_forwards_until_a_step_and_records_the_mark_before_and_after():
    clock, figures = _Clock(), [100, 100]
    watch = Watch(lambda: tuple(figures), FIELDS, clock=clock)
    watch.stepped()
    clock.now = 1.0
    watch.begin(EVALUATION)
    figures[:] = [300, 300]
    clock.now = 1.5
    watch.begin(EVALUATION)  # the same pass: no step came between
    watch.begin(CHECKPOINT)  # ends the evaluation
    clock.now = 2.0
    watch.stepped()
    watch.begin(EVALUATION)  # a step came between: a second pass
    seen = watch.finish()
    assert (seen["num_evaluations"], seen["num_checkpoints"], seen["num_steps"]) == (2, 1, 2)
    first, checkpoint, second = seen["events"]
    assert (first["kind"], first["start_s"], first["end_s"], first["step"]) == (EVALUATION, 1.0, 1.5, 1)
    assert (first["peak_before_bytes"], first["peak_after_bytes"]) == (100, 300)
    assert checkpoint["kind"] == CHECKPOINT and second["step"] == 2
    assert seen["first_steps"] == [[0.0, 100], [2.0, 300]]
    assert watch.finish() is seen


def test_the_watch_keeps_its_samples_bounded_and_remembers_a_peak_the_script_reset():
    clock, figures = _Clock(), [10, 50]
    watch = Watch(lambda: tuple(figures), FIELDS, clock=clock)
    for i in range(memory_watch.MAX_SAMPLES + 1):
        clock.now = float(i)
        figures[1] = 50 if i != 7 else 80
        watch.sample()
    assert len(watch.samples) <= memory_watch.MAX_SAMPLES // 2 + 1 and watch.interval_s == 2 * memory_watch.SAMPLE_S
    assert watch.samples[-1][2] == 80  # the high-water mark is the most seen, though the counter fell back


def _samples(*rows):
    return [{"t_s": t, "live_bytes": peak, "peak_bytes": peak, "steps": steps} for t, peak, steps in rows]


def test_a_flat_mark_names_no_rise_and_a_growth_under_1_percent_is_not_named():
    rows = _samples((10.0, 1000 * MIB, 20), (20.0, 1000 * MIB, 40), (30.0, 1005 * MIB, 60))
    assert name_rises(rows, (), 5.0, 1000 * MIB) == ()


def test_a_pass_that_raised_the_mark_names_the_rise_and_a_later_growth_is_trainings():
    evaluation = PassSeen(kind=EVALUATION, start_s=249.0, end_s=252.0, step=120, peak_before_bytes=1200 * MIB,
                          peak_after_bytes=1500 * MIB)
    flat = PassSeen(kind=CHECKPOINT, start_s=260.0, end_s=261.0, step=121, peak_before_bytes=1500 * MIB,
                    peak_after_bytes=1500 * MIB)
    rows = _samples((100.0, 1200 * MIB, 50), (250.0, 1400 * MIB, 120), (255.0, 1500 * MIB, 121),
                    (400.0, 1500 * MIB, 200), (500.0, 1600 * MIB, 260))
    rises = name_rises(rows, (evaluation, flat), 10.0, 1200 * MIB)
    assert rises == (Rise(at_s=250.0, from_bytes=1200 * MIB, to_bytes=1500 * MIB, step=120, during=EVALUATION),
                     Rise(at_s=500.0, from_bytes=1500 * MIB, to_bytes=1600 * MIB, step=260, during=TRAINING))


def test_before_the_first_step_a_growth_is_start_up():
    rows = _samples((3.0, 2000, 0))
    assert name_rises(rows, (), 1.0, 1000)[0].during == START_UP


def _report(pid, peak, *, started=1000.5, cuda=False, rank=None):
    fields = memory_watch.CUDA_FIELDS if cuda else FIELDS
    extra = [peak + 100, 2, 100, 40] if cuda else []
    memory = {"started": started, "fields": list(fields), "sample_interval_s": 0.5, "num_steps": 30,
              "num_evaluations": 1, "num_checkpoints": 0, "first_steps": [[1.0, 500], [2.0, 600]],
              "samples": [[0.5, 0, 0, 0, *([0, 0, 0, 0] if cuda else [])], [3.0, peak, peak, 20, *extra]],
              "events": [{"kind": EVALUATION, "start_s": 2.5, "end_s": 2.9, "step": 10, "peak_before_bytes": 600,
                          "peak_after_bytes": peak}]}
    return {"pid": pid, "rank": rank, "memory": memory}


def test_the_runs_memory_is_its_highest_process_on_the_runs_clock():
    memory = high_water([_report(1, 900), _report(2, 1200, rank=1), {"pid": 3}], 1000.0, 2)
    assert memory is not None and (memory.pid, memory.rank, memory.peak_bytes) == (2, 1, 1200)
    assert memory.settled_peak_bytes == 600 and memory.settled_at_s == 2.5  # the process started 0.5 s in
    assert memory.rises == (Rise(at_s=3.4, from_bytes=600, to_bytes=1200, step=10, during=EVALUATION),)
    assert memory.passes[0].start_s == 3.0 and memory.num_alloc_retries is None
    assert high_water([{"pid": 1}], 1000.0, 2) is None


def test_on_cuda_the_allocators_retries_and_fragmentation_are_kept():
    memory = high_water([_report(1, 900, cuda=True)], 1000.0, 2)
    assert memory is not None
    assert (memory.num_alloc_retries, memory.max_reserved_bytes, memory.max_unallocated_reserved_bytes,
            memory.max_inactive_split_bytes) == (2, 1000, 100, 40)
    assert "2 retries" in memory_lines(memory)[-1]


def test_fewer_steps_than_the_baseline_needs_names_no_rise():
    memory = high_water([_report(1, 900)], 1000.0, 5)
    assert memory is not None and memory.settled_peak_bytes is None and memory.rises == () and not memory.rose
    assert "fewer than the 5" in high_water_text(memory)


def test_the_words_of_a_rise():
    assert [fmt_clock(s) for s in (12.34, 250, 7500)] == ["12.3 s", "4 min 10 s", "2 h 5 min"]
    memory = high_water([_report(1, 1536 * MIB)], 1000.0, 2)
    assert memory is not None
    memory = memory.__class__(**{**memory.__dict__, "settled_peak_bytes": 1229 * MIB,
                                 "rises": (Rise(at_s=250.0, from_bytes=1229 * MIB, to_bytes=1536 * MIB, step=120,
                                                during=EVALUATION),)})
    assert high_water_text(memory).startswith("peak rose from 1.2 GiB to 1.5 GiB at 4 min 10 s, during an "
                                              "evaluation pass")
    assert passes_text(memory) == "1 evaluation pass and no checkpoints seen in 30 optimizer steps"


@pytest.mark.parametrize("kind", [EVALUATION, CHECKPOINT])
def test_a_pass_record_round_trips_and_refuses_an_unknown_kind(kind):
    seen = PassSeen(kind=kind, start_s=1.0, end_s=2.0, step=3, peak_before_bytes=1, peak_after_bytes=2)
    assert PassSeen.from_dict(seen.to_dict()) == seen and seen.raised
    with pytest.raises(ValueError, match="kind"):
        PassSeen.from_dict({**seen.to_dict(), "kind": "lunch"})


def _command_probe(num_evaluations, num_checkpoints, confirmed=None):
    from dataclasses import replace

    from tests.unit.test_records import sample_probe

    probe = sample_probe()
    trial = replace(probe.trials[0], batch_size=probe.ceiling, num_evaluations=num_evaluations,
                    num_checkpoints=num_checkpoints)
    return replace(probe, command=("python", "train.py", "--batch-size", "{batch}"), steps=3, trials=(trial,),
                   confirmed=confirmed)


def test_a_probe_says_what_its_trials_steps_reached():
    from mbtune.report.probe import coverage_text

    assert coverage_text(_command_probe(0, 0)) == (
        "the trials' 3 steps reached no evaluation pass and no checkpoint: the ceiling covers training steps "
        "only; confirm it over a run with --confirm-duration")
    assert coverage_text(_command_probe(1, 0)) == "the trials' 3 steps reached 1 evaluation pass, no checkpoint"
    assert coverage_text(_command_probe(None, None)) == ""  # not watched: nothing said


def test_a_probes_confirmation_round_trips_and_is_shown():
    import json

    from rich.console import Console

    from mbtune.probing.confirm import FITS, ConfirmResult, ConfirmRun
    from mbtune.probing.records import ProbeResult
    from mbtune.report.probe import summary_panel

    memory = high_water([_report(1, 900)], 1000.0, 2)
    confirmed = ConfirmResult(command=("python", "train.py"), device="cpu", memory_budget_bytes=2**30, duration_s=60.0,
                              runs=(ConfirmRun(outcome=FITS, exit_code=0, peak_bytes=900, processes=1, wall_s=61.0,
                                               stopped=True, high_water=memory),))
    probe = _command_probe(0, 0, confirmed)
    assert ProbeResult.from_dict(json.loads(json.dumps(probe.to_dict()))) == probe
    console = Console(width=200, record=True)
    console.print(summary_panel(probe))
    text = console.export_text()
    assert "covers training steps only" in text and "--confirm-duration" not in text
    assert "fits at batch 3 over 1 min 1 s, then asked to stop" in text and "peak rose from 600 B" in text
