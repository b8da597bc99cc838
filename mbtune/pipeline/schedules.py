"""Typed wrappers over torch.distributed.pipelining: the only module that imports that API.

Besides the public classes (PipelineStage and the schedules), the action timer and on_forward_chunk reach
into stage methods torch marks as public but schedules call internally (forward_one_chunk, backward_one_chunk,
backward_weight_one_chunk). Their signatures are those of torch 2.6-2.14; pyproject pins that range.

`schedule_action_orders` reads a schedule's per-rank action order for the planner's simulator without modules
or a process group: it builds the schedule over stand-in stages and reads `pipeline_order`, skipping torch's
private lowering to send/recv actions (`_prepare_schedule_with_comms`) but keeping its validation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from mbtune.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, LOSS
from mbtune.pipeline.theory import schedule_info
from mbtune.pipeline.timeline import ActionRecord

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def schedule_class(schedule: str) -> type:
    """The torch schedule class behind an mbtune schedule name."""
    return getattr(torch_schedules, schedule_info(schedule).torch_class)


# A stage's (inputs, outputs) of one micro-batch, given where the shapes are known before the first step.
StageShapes = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


def build_stage(module: nn.Module, *, stage_index: int, num_model_stages: int, device: torch.device,
                group: Any = None, shapes: StageShapes | None = None) -> PipelineStage:
    """Wrap one stage's module; shapes are inferred by torch from the first micro-batch, unless given.
    `num_model_stages` counts every stage of the model over all ranks (virtual stages included), what torch
    calls num_stages; `group` is the process group of this stage's pipeline (None: the whole world)."""
    if shapes is None:
        return PipelineStage(module, stage_index, num_model_stages, device, group=group)
    inputs, outputs = shapes
    return PipelineStage(module, stage_index, num_model_stages, device, input_args=inputs, output_args=outputs,
                         group=group)


def take_shapes_as_given(schedule: Any) -> None:
    """Have the schedule take its stages' given shapes without asking the other ranks first (torch's
    warm-up vote reads a value sent by every rank; a rank run alone on fake tensors has none to read).
    Every stage must have been built with its shapes."""
    try:
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError:  # torch before the vote (2.11 and older): a stage built with shapes takes them as given
        return

    def static(stages: Sequence[PipelineStage], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = static


class _HeldWork:
    """A fake process group's work that keeps its tensors alive for its own lifetime, as a real one does."""

    def __init__(self, work: Any, tensors: list[torch.Tensor]) -> None:
        self.work, self.tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


@contextlib.contextmanager
def works_hold_their_tensors() -> Iterator[None]:
    """While inside, the schedules' sends and receives return works that hold their tensors for their
    own lifetime, as a real process group's do (the fake one's hold nothing)."""
    plain = torch_schedules._batch_p2p

    def held(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        works = plain(p2p_ops, desc)
        tensors = [op.tensor for op in p2p_ops]
        return [_HeldWork(work, tensors) for work in works]

    torch_schedules._batch_p2p = held
    try:
        yield
    finally:
        torch_schedules._batch_p2p = plain


def on_forward_chunk(stage: PipelineStage, seen: Callable[[int], None]) -> None:
    """Have `seen` told the micro-batch of each forward the stage computes, before it computes it."""
    compute = stage.forward_one_chunk
    @functools.wraps(compute)
    def forward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        seen(args[0] if args else kwargs["fwd_chunk_id"])
        return compute(*args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk  # type: ignore[method-assign]


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run `callback` as the autograd backward pass in progress ends (called from inside the pass)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def build_schedule(schedule: str, stages: Sequence[PipelineStage], *, num_microbatches: int, loss_fn: LossFn) -> Any:
    """Build the torch schedule over this rank's stages (in increasing stage order).

    Gradients are never rescaled by torch (scale_grads=False): torch divides every .grad by the number of
    micro-batches at the end of each step, which would also shrink gradients accumulated over earlier
    steps. The caller scales the loss instead.
    """
    cls = schedule_class(schedule)
    if not schedule_info(schedule).stage_list:
        if len(stages) != 1:
            raise ValueError(f"{schedule} takes one stage per rank, got {len(stages)}")
        return cls(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(list(stages), num_microbatches, loss_fn=loss_fn, scale_grads=False)


def run_schedule_step(schedule: Any, args: tuple[torch.Tensor, ...], *, target: torch.Tensor | None,
                      losses: list[torch.Tensor] | None) -> None:
    """One schedule step: inputs on the first stage's rank, target and losses on the last stage's.

    The last stage's outputs are not kept (they would only add memory) where torch lets us say so.
    """
    try:
        if _accepts_return_outputs(type(schedule).step):
            schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            schedule.step(*args, target=target, losses=losses)
    except RuntimeError as exc:
        if _INTEGER_HANDOVER in str(exc):
            raise _integer_handover_error() from exc
        raise


# What torch before 2.13 raises where a stage receives a tensor that is not floating point: it makes every
# received tensor require a gradient, and sends a gradient back for every one.
_INTEGER_HANDOVER = "only Tensors of floating point dtype can require gradients"


def _integer_handover_error() -> Exception:
    from mbtune.errors import WorkloadError

    return WorkloadError(
        f"torch {torch.__version__} hands only floating-point tensors from one pipeline stage to the next, and "
        "this model hands over an integer or bool tensor (an attention mask, position ids)",
        hint="Use torch 2.13 or later, or have the model hand such values over as floating-point tensors.")


@functools.cache
def _accepts_return_outputs(step: Callable[..., Any]) -> bool:
    return "return_outputs" in inspect.signature(step).parameters


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


# torch's action letters -> mbtune's action kinds (the timeline's words).
_KIND_OF_ACTION = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}


class _OrderOnlyStage:
    """Stands in for a PipelineStage where only the schedule's action order is wanted: the schedule
    constructors read these attributes and nothing else (no module, no process group)."""

    def __init__(self, *, stage_index: int, num_model_stages: int, num_ranks: int, rank: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_model_stages  # torch's name for every stage of the model, virtual ones included
        self.group_size = num_ranks
        self.group_rank = rank
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


@functools.cache
def _order_only_class(cls: type) -> type:
    """The schedule class without the lowering to send/recv actions, which only running needs and which
    grows quadratically (seconds at 64 ranks); torch's own validation of the order still runs."""
    if not hasattr(cls, "_prepare_schedule_with_comms"):
        return cls

    def validate_only(self: Any, actions: dict, format: str = "compute_only") -> None:
        self._validate_and_set_stage_mapping(actions)

    return type(f"OrderOnly{cls.__name__}", (cls,), {"_prepare_schedule_with_comms": validate_only})


def schedule_action_orders(schedule: str, *, num_ranks: int, num_microbatches: int,
                           stages_per_rank: int = 1) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """Per rank, the compute actions torch's schedule runs in one pipeline step, in order, as
    (stage, kind, micro-batch) with kind forward | backward | backward_input | backward_weight.

    Read from the schedule's own `pipeline_order` (built by torch without modules or a process group), so
    the simulator follows exactly what torch would run. Idle slots, gradient reduction and resharding are
    left out; overlapped forward/backward pairs are flattened into their parts. ValueError where torch
    refuses the point.
    """
    from mbtune.pipeline.theory import stage_to_rank

    num_model_stages = num_ranks * stages_per_rank
    owners = stage_to_rank(schedule, num_ranks, num_model_stages)
    stages = [_OrderOnlyStage(stage_index=s, num_model_stages=num_model_stages, num_ranks=num_ranks, rank=0)
              for s in range(num_model_stages) if owners[s] == 0]
    cls = _order_only_class(schedule_class(schedule))
    loss_fn = _no_loss
    try:
        if not schedule_info(schedule).stage_list:
            built = cls(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            built = cls(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
    except (AssertionError, RuntimeError) as exc:
        raise ValueError(f"torch refuses {schedule} with {num_ranks} ranks and {num_microbatches} micro-batches: "
                         f"{exc}") from exc
    order = built.pipeline_order
    if order is None:
        raise ValueError(f"torch's {schedule_class(schedule).__name__} publishes no action order")
    return tuple(tuple(_flatten(order.get(rank) or ())) for rank in range(num_ranks))


def _no_loss(output: Any, target: Any) -> Any:
    return output


def _flatten(actions: Sequence[Any]) -> list[tuple[int, str, int]]:
    flat: list[tuple[int, str, int]] = []
    for action in actions:
        if action is None:
            continue
        if getattr(action, "sub_actions", None):
            flat.extend(_flatten(action.sub_actions))
            continue
        kind = _KIND_OF_ACTION.get(action.computation_type.value)
        if kind is not None and action.microbatch_index is not None:
            flat.append((action.stage_index, kind, int(action.microbatch_index)))
    return flat
