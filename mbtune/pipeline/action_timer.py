"""The action timer: when each forward, backward and loss of a stage ran within a step (the timeline's
records). It wraps the stage methods schedules call (forward_one_chunk, backward_one_chunk,
backward_weight_one_chunk; see pipeline/schedules.py); on CUDA it times with events read after the step,
never a synchronize around each action (that would remove the overlap being measured)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mbtune.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, LOSS
from mbtune.pipeline.timeline import ActionRecord

if TYPE_CHECKING:  # the stage type only: pipeline/schedules.py alone imports torch's pipelining
    from torch.distributed.pipelining import PipelineStage

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TimingEvent(Protocol):
    """What ActionTimer needs of a CUDA event (torch.cuda.Event(enable_timing=True)); tests pass fakes."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...  # milliseconds from this event to end_event


def event_offsets_s(reference: TimingEvent, events: Sequence[TimingEvent]) -> list[float]:
    """Seconds from the reference event to each event, on the device's own clock (all must have completed).

    With the reference recorded at the step's origin, these are the events' times on the step's
    perf_counter clock, relative to that origin: the same clock the CPU path reads directly."""
    return [reference.elapsed_time(event) / 1000.0 for event in events]


@dataclass
class _PendingSpan:
    """An action timed by events, waiting for the step to end before its times are read."""

    step: int
    accum: int
    stage: int
    kind: str
    microbatch: int
    start: TimingEvent
    end: TimingEvent


class ActionTimer:
    """Records when each stage computes what, by wrapping the stage's per-micro-batch methods.

    Waiting for activations or gradients happens in the schedule before these calls, so the recorded spans
    are compute only. On the CPU a span is two perf_counter reads. Given `new_event` (on CUDA: a timing
    event factory), a span is a pair of events recorded on the current stream and nothing waits for the
    device inside the step, so compute keeps overlapping communication as it would in training; the
    events are read once by `finish_step`, after the step's closing barrier.
    """

    def __init__(self, *, new_event: Callable[[], TimingEvent] | None = None) -> None:
        self.records: list[ActionRecord] = []
        self._new_event = new_event
        self._enabled = False
        self._step = 0
        self._accum = 0
        self._origin_s = 0.0
        self._pending_loss: tuple[int, int] | None = None  # (stage, micro-batch) whose loss comes next
        self._reference: TimingEvent | None = None  # recorded at the step's origin
        self._step_end: TimingEvent | None = None
        self._spans: list[_PendingSpan] = []

    def begin_step(self) -> None:
        """Mark the origin of a measured optimizer step on the device (call right after its opening
        barrier, where the origin's perf_counter is read); nothing to do on the CPU."""
        self._spans, self._step_end = [], None
        self._reference = self._recorded() if self._new_event else None

    def start(self, *, step: int, accum: int, origin_s: float) -> None:
        """Record from now on, tagging spans with this step and relative to origin_s (perf_counter)."""
        self._enabled, self._step, self._accum, self._origin_s = True, step, accum, origin_s

    def stop(self) -> None:
        self._enabled = False

    def end_step(self) -> None:
        """Mark the end of the step's device work (call before its closing barrier)."""
        if self._reference is not None:
            self._step_end = self._recorded()

    def finish_step(self) -> float | None:
        """After the step's closing barrier: turn its events into ActionRecords (one wait for the device)
        and return the device's step time in seconds, origin to end_step; None on the CPU."""
        reference, spans, step_end = self._reference, self._spans, self._step_end
        self._reference, self._spans, self._step_end = None, [], None
        if reference is None:
            return None
        events = [e for span in spans for e in (span.start, span.end)] + ([step_end] if step_end else [])
        if events:
            events[-1].synchronize()
        offsets = event_offsets_s(reference, events)
        for i, span in enumerate(spans):
            self.records.append(ActionRecord(step=span.step, accum=span.accum, stage=span.stage, kind=span.kind,
                                             microbatch=span.microbatch, start_s=offsets[2 * i],
                                             end_s=offsets[2 * i + 1]))
        return offsets[-1] if step_end is not None else None

    def instrument(self, stage: PipelineStage) -> None:
        """Shadow the stage's compute methods with timed versions (instance attributes win over the class)."""
        # torch declares these as methods; shadowing them on the instance is the point here.
        stage.forward_one_chunk = self._wrap(  # type: ignore[method-assign]
            stage, stage.forward_one_chunk, "fwd_chunk_id", lambda kw: FORWARD)
        stage.backward_one_chunk = self._wrap(  # type: ignore[method-assign]
            stage, stage.backward_one_chunk, "bwd_chunk_id",
            lambda kw: BACKWARD if kw.get("full_backward", True) else BACKWARD_INPUT,
        )
        stage.backward_weight_one_chunk = self._wrap(  # type: ignore[method-assign]
            stage, stage.backward_weight_one_chunk, "bwd_chunk_id", lambda kw: BACKWARD_WEIGHT
        )

    def wrap_loss(self, loss_fn: LossFn) -> LossFn:
        """Time the loss as its own action. Only losses that follow a timed forward of the last stage count,
        which leaves out the call torch makes while inferring shapes."""

        @functools.wraps(loss_fn)
        def timed_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            pending, self._pending_loss = self._pending_loss, None
            if not self._enabled or pending is None:
                return loss_fn(output, target)
            return self._timed(lambda: loss_fn(output, target), stage=pending[0], kind=LOSS, microbatch=pending[1])

        return timed_loss

    def _wrap(self, stage: PipelineStage, method: Callable[..., Any], chunk_arg: str,
              kind_of: Callable[[dict[str, Any]], str]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._enabled:
                return method(*args, **kwargs)
            microbatch = args[0] if args else kwargs[chunk_arg]
            kind = kind_of(kwargs)
            result = self._timed(lambda: method(*args, **kwargs), stage=stage.stage_index, kind=kind,
                                 microbatch=microbatch)
            if kind == FORWARD and stage.is_last:
                self._pending_loss = (stage.stage_index, microbatch)
            return result

        return timed

    def _recorded(self) -> TimingEvent:
        assert self._new_event is not None
        event = self._new_event()
        event.record()
        return event

    def _timed(self, run: Callable[[], Any], *, stage: int, kind: str, microbatch: int) -> Any:
        if self._new_event is not None:
            assert self._reference is not None, "begin_step() must mark the step's origin before actions run"
            start_event = self._recorded()
            result = run()
            self._spans.append(_PendingSpan(step=self._step, accum=self._accum, stage=stage, kind=kind,
                                            microbatch=int(microbatch), start=start_event, end=self._recorded()))
            return result
        start = time.perf_counter()
        result = run()
        end = time.perf_counter()
        self.records.append(ActionRecord(
            step=self._step, accum=self._accum, stage=stage, kind=kind, microbatch=int(microbatch),
            start_s=start - self._origin_s, end_s=end - self._origin_s,
        ))
        return result
