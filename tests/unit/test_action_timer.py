"""The action timer's two clocks: perf_counter spans on the CPU, and CUDA-event spans read after the step,
here with fake events on a fake device clock (pure logic, no GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mbtune.actions import BACKWARD, FORWARD, LOSS
from mbtune.pipeline.action_timer import ActionTimer, event_offsets_s


class FakeDevice:
    """A device clock in milliseconds that work advances, and the events recorded on it."""

    def __init__(self, now_ms: float = 0.0) -> None:
        self.now_ms = now_ms
        self.synchronized = 0

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def work(self, ms: float) -> None:
        self.now_ms += ms


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.at_ms: float | None = None

    def record(self) -> None:
        self.at_ms = self.device.now_ms

    def synchronize(self) -> None:
        self.device.synchronized += 1

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.at_ms is not None and end_event.at_ms is not None, "both events must have been recorded"
        return end_event.at_ms - self.at_ms


def _stage(device: FakeDevice, *, forward_ms: float, backward_ms: float) -> SimpleNamespace:
    return SimpleNamespace(
        stage_index=0, is_last=True,
        forward_one_chunk=lambda chunk, *args, **kw: device.work(forward_ms),
        backward_one_chunk=lambda chunk, *args, **kw: device.work(backward_ms),
        backward_weight_one_chunk=lambda chunk, *args, **kw: None,
    )


def test_event_offsets_are_seconds_after_the_reference():
    device = FakeDevice(now_ms=100.0)
    reference, first, second = device.event(), device.event(), device.event()
    reference.record()
    device.work(1.5)
    first.record()
    device.work(2.5)
    second.record()
    assert event_offsets_s(reference, [first, second]) == pytest.approx([0.0015, 0.004])
    assert event_offsets_s(reference, []) == []


def test_event_spans_become_records_only_after_the_step_with_one_wait():
    device = FakeDevice(now_ms=5_000.0)  # the device clock's zero means nothing: only differences count
    timer = ActionTimer(new_event=device.event)
    stage = _stage(device, forward_ms=2.0, backward_ms=3.0)
    timer.instrument(stage)
    loss = timer.wrap_loss(lambda output, target: device.work(0.5))

    timer.begin_step()
    device.work(1.0)  # e.g. the first micro-batch arriving: not the stage's compute
    timer.start(step=0, accum=0, origin_s=123.0)
    stage.forward_one_chunk(0)
    loss(None, None)
    device.work(0.25)
    stage.backward_one_chunk(0, full_backward=True)
    timer.stop()
    device.work(4.0)  # the optimizer update
    timer.end_step()
    assert timer.records == [] and device.synchronized == 0  # nothing waits for the device inside the step

    step_s = timer.finish_step()
    assert device.synchronized == 1
    assert step_s == pytest.approx(0.01075)
    spans = [(r.kind, r.step, r.accum, r.stage, r.microbatch, r.start_s, r.end_s) for r in timer.records]
    assert spans == [
        (FORWARD, 0, 0, 0, 0, pytest.approx(0.001), pytest.approx(0.003)),
        (LOSS, 0, 0, 0, 0, pytest.approx(0.003), pytest.approx(0.0035)),
        (BACKWARD, 0, 0, 0, 0, pytest.approx(0.00375), pytest.approx(0.00675)),
    ]
    assert timer.finish_step() is None and len(timer.records) == 3  # a step is read once


def test_cpu_spans_are_perf_counter_times_recorded_at_once():
    timer = ActionTimer()
    calls = []
    stage = SimpleNamespace(stage_index=1, is_last=False, forward_one_chunk=lambda chunk: calls.append(chunk),
                            backward_one_chunk=lambda chunk, **kw: None, backward_weight_one_chunk=lambda chunk: None)
    timer.instrument(stage)
    timer.begin_step()
    stage.forward_one_chunk(7)  # not started: not timed
    timer.start(step=2, accum=1, origin_s=0.0)
    stage.forward_one_chunk(3)
    timer.end_step()
    [record] = timer.records
    assert calls == [7, 3]
    assert (record.step, record.accum, record.stage, record.kind, record.microbatch) == (2, 1, 1, FORWARD, 3)
    assert 0.0 < record.start_s <= record.end_s
    assert timer.finish_step() is None


def test_event_spans_need_the_step_origin_first():
    device = FakeDevice()
    timer = ActionTimer(new_event=device.event)
    stage = _stage(device, forward_ms=1.0, backward_ms=1.0)
    timer.instrument(stage)
    timer.start(step=0, accum=0, origin_s=0.0)
    with pytest.raises(AssertionError, match="begin_step"):
        stage.forward_one_chunk(0)
