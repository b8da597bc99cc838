"""Typed wrappers over torch.distributed.pipelining: the only module that imports that API.

Besides the public classes (PipelineStage and the schedules), the action timer (pipeline/action_timer.py) and
on_forward_chunk reach into stage methods torch marks as public but schedules call internally (forward_one_chunk, backward_one_chunk,
backward_weight_one_chunk). Their signatures are those of torch 2.6-2.14; pyproject pins that range.

`schedule_action_orders` reads a schedule's per-rank action order for the planner's simulator without modules
or a process group: it builds the schedule over stand-in stages and reads `pipeline_order`, skipping torch's
private lowering to send/recv actions (`_prepare_schedule_with_comms`) but keeping its validation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from mbtune.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from mbtune.pipeline.action_timer import LossFn
from mbtune.pipeline.theory import schedule_info


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


def _zeroed_shape_inference() -> None:
    """torch (2.12 and later) infers a stage's shapes before the first step by running its forward on buffers
    made from the previous stage's metadata, uninitialised: an integer hand-over there (targets a stage's loss
    reads, position ids) holds garbage, and an index out of range ends the run (`IndexError: Target
    -4874794365354615295 is out of bounds`). Those buffers are made zeros here: an index, a mask and a count
    every model takes. The step itself receives what was sent (check holds every byte of it to that)."""
    try:
        from torch.distributed.pipelining._utils import _TensorMeta
    except ImportError:  # older torch: shapes inferred otherwise, integer hand-overs refused (see below)
        return
    plain = _TensorMeta.to_tensor
    if getattr(plain, "mbtune_zeroed", False):
        return

    def zeroed(self: Any, device: Any) -> torch.Tensor:
        tensor = plain(self, device)
        with torch.no_grad():
            return tensor.zero_()

    zeroed.mbtune_zeroed = True  # type: ignore[attr-defined]
    _TensorMeta.to_tensor = zeroed  # type: ignore[method-assign]


_zeroed_shape_inference()


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


def build_schedule(schedule: str, stages: Sequence[PipelineStage], *, num_micro_batches: int, loss_fn: LossFn) -> Any:
    """Build the torch schedule over this rank's stages (in increasing stage order).

    Gradients are never rescaled by torch (scale_grads=False): torch divides every .grad by the number of
    micro-batches at the end of each step, which would also shrink gradients accumulated over earlier
    steps. The caller scales the loss instead.
    """
    cls = schedule_class(schedule)
    if not schedule_info(schedule).stage_list:
        if len(stages) != 1:
            raise ValueError(f"{schedule} takes one stage per rank, got {len(stages)}")
        return cls(stages[0], num_micro_batches, loss_fn=loss_fn, scale_grads=False)
    return cls(list(stages), num_micro_batches, loss_fn=loss_fn, scale_grads=False)


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


def prime_schedule(schedule: Any, args: tuple[torch.Tensor, ...], *, target: torch.Tensor | None) -> bool:
    """Do now, before any timed step, what torch does at the start of a schedule's first step: the ranks'
    p2p vote, each stage's shape inference (a forward of the first micro-batch on buffers, and the backward's
    metadata) and the receive buffers; every rank of the pipeline calls it with what its first step takes.
    The first step then runs as every later one does. False (nothing done) where this torch's schedules set
    themselves up otherwise: the first step does it, and is a warm-up step's to pay."""
    import inspect

    try:
        from torch.distributed.pipelining.schedules import _TARGET_CHUNK_SPEC, _split_tensor

        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        initialize = getattr(schedule, "_initialize_stages", None) or schedule._initialize_stage
        has_backward = schedule._has_backward
        split_inputs, n = schedule._split_inputs, schedule._n_microbatches
    except (AttributeError, ImportError):
        return False
    if list(inspect.signature(initialize).parameters)[:3] != ["args", "kwargs", "target"]:
        return False
    for stage in stages:  # as step() sets it before setting up
        stage.has_backward = has_backward
    args_split, kwargs_split = split_inputs(args, {})
    targets = list(_split_tensor(target, _TARGET_CHUNK_SPEC, n)) if target is not None else None
    initialize(args_split[0], kwargs_split[0], targets[0] if targets else None)
    return True


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


def schedule_action_orders(schedule: str, *, num_ranks: int, num_micro_batches: int,
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
            built = cls(stages[0], num_micro_batches, loss_fn=loss_fn, scale_grads=False)
        else:
            built = cls(stages, num_micro_batches, loss_fn=loss_fn, scale_grads=False)
    except (AssertionError, RuntimeError) as exc:
        raise ValueError(f"torch refuses {schedule} with {num_ranks} ranks and {num_micro_batches} micro-batches: "
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
