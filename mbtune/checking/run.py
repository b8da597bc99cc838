"""`mbtune check`: is the pipelined update the one the recipe means?

One optimizer step runs through the real pipeline (its schedule, micro-batches, accumulation, precision,
one process per rank) with its gradients captured, and the plain unpipelined model runs the same global
batch, from the same weights and samples, in a fresh process. Per block, the worst difference of the
gradients is held to a tolerance that depends on the precision.

When they differ, a third computation says why where it can: the plain model's gradients of the loss as
the pipeline forms it (each micro-batch's loss divided by micro-batches x accumulation steps, summed). If
the pipeline matches that and not the whole batch's loss, the loss is a mean whose denominator changes
from micro-batch to micro-batch (masked or padded tokens): the micro-batches' means do not add up to the
batch's mean, and no pipeline can fix that; the loss must.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mbtune.checking.config import CheckConfig
from mbtune.checking.records import BlockCheck, CheckResult
from mbtune.errors import (
    HarnessError,
    TrialFailedError,
)
from mbtune.records import OK
from mbtune.settings import lr_for

if TYPE_CHECKING:
    from mbtune.pipeline.timeline import PipelineOutcome

PASS, FAIL = "PASS", "FAIL"
# (rtol, atol) per precision: a block passes when max |pipeline - plain| <= atol + rtol x max |plain|.
# fp32 differs only by summation order; bf16 autocast by its 8-bit mantissa, per stage and per micro-batch.
TOLERANCES = {"fp32": (1e-4, 1e-6), "bf16": (5e-2, 1e-4)}
CUDA_FP32 = (1e-3, 1e-5)  # TF32 matmuls and nondeterministic reductions
VARYING_MEAN = ("the loss is a mean whose count changes from micro-batch to micro-batch (masked or padded "
                "tokens, say): the micro-batches' means do not add up to the whole batch's mean")
VARYING_MEAN_FIX = ("Sum the loss over its elements and divide by one count for the whole global batch (or by a "
                    "fixed count per sample), not by each micro-batch's own count.")

BATCH_STATISTICS_FIX = ("That is micro-batching by design, not a bug of the loss: use GroupNorm or LayerNorm for a "
                        "pipeline that is the plain model, or accept per-micro-batch statistics.")


def check_update(config: CheckConfig, run_point: Callable[..., PipelineOutcome] | None = None) -> CheckResult:
    """Run the configuration's pipeline and the plain model for one optimizer step; compare per block.
    `run_point(spec, timeout_s=...)` runs the pipeline (default: the local launcher's run_pipeline_point;
    a sweep under torchrun passes its session's)."""
    from mbtune.pipeline.launch import run_pipeline_point
    from mbtune.pipeline.point_spec import PipelineSpec
    from mbtune.worker import run_isolated
    from mbtune.workloads.facts import workload_facts

    workload_facts(config.workload, config.workload_options, timeout_s=config.load_timeout_s)  # loads, or says why
    point = config.point
    spec = PipelineSpec.for_point(point, workload=config.workload, workload_options=config.workload_options,
                                  device=config.device, warmup_steps=0, measured_steps=1, seed=config.seed,
                                  optimizer=config.optimizer, lr=lr_for(config.optimizer, config.lr),
                                  precision=config.precision, capture_grads=True)
    outcome = (run_point or run_pipeline_point)(spec, timeout_s=config.timeout_s)
    if outcome.status != OK:
        raise TrialFailedError(f"the pipeline of {point.label} ended as {outcome.status}: "
                               f"{(outcome.error or 'no error text').strip().splitlines()[-1]}",
                               detail=outcome.error_detail)
    plain = run_isolated(plain_gradients, spec, timeout_s=config.timeout_s)
    if plain.status != OK:
        raise HarnessError(f"the plain model's step ended as {plain.status}: "
                           f"{(plain.error or 'no error text').strip().splitlines()[-1]}", detail=plain.error_tail)
    grads: dict[str, Any] = {}
    for report in outcome.pipeline_reports:  # all-reduced: every replica holds the same gradients
        grads.update(report.grads or {})
    result = compare(config, grads, float(outcome.loss or math.nan), plain.value)
    return with_handovers(result, [c for report in outcome.pipeline_reports for c in report.crossings])


def with_handovers(result: CheckResult, crossings: Sequence[Any]) -> CheckResult:
    """The result with what each stage boundary received held to what was sent (the first difference fails
    the check, whatever the gradients say: a hand-over that arrives changed trains on values nobody sent)."""
    from mbtune.pipeline.handover import first_difference

    compared, difference = first_difference(crossings)
    result = replace(result, handovers_compared=compared)
    if not difference:
        return result
    return replace(result, status=FAIL, handover_difference=difference,
                   cause=f"a hand-over arrived other than it was sent: {difference}",
                   hint="Hand over tensors whose shape is the same for every micro-batch; report the dtype and "
                        "torch version to mbtune's issues if it still differs.")


def tolerance_for(precision: str, device: str) -> tuple[float, float]:
    """(rtol, atol) that a correct pipeline stays within at this precision on this device."""
    if precision == "fp32" and device.startswith("cuda"):
        return CUDA_FP32
    return TOLERANCES[precision]


def compare(config: CheckConfig, grads: dict[str, Any], loss: float, plain: dict[str, Any]) -> CheckResult:
    """Per block: the pipeline's gradients against the plain model's; the verdict and, on a failure, why.
    `plain` holds the whole batch's loss and gradients, and the gradients of the loss as the pipeline
    forms it (see plain_gradients)."""
    rtol, atol = tolerance_for(config.precision, config.device)
    blocks = _block_diffs(grads, plain["grads"], rtol, atol)
    missing = sorted(set(plain["grads"]) ^ set(grads))
    loss_diff = abs(loss - plain["loss"]) / max(abs(plain["loss"]), 1e-12)
    failed = missing or not all(b.ok for b in blocks) or not loss_diff <= max(rtol, 1e-6) * 10
    cause = hint = ""
    if failed:
        summed = _block_diffs(grads, plain["summed_grads"], rtol, atol)
        mixing = plain.get("batch_statistics") or []
        if mixing:
            where = ", ".join(mixing[:3]) + (f" and {len(mixing) - 3} more" if len(mixing) > 3 else "")
            cause = (f"a sample's output depends on the other samples of its micro-batch (batch statistics: {where}):"
                     " a pipeline computes them per micro-batch, the plain model over the whole batch")
            hint = BATCH_STATISTICS_FIX
        elif not missing and all(b.ok for b in summed):
            cause, hint = VARYING_MEAN, VARYING_MEAN_FIX
        elif missing:
            cause = f"parameters that only one side has: {', '.join(missing[:3])}"
            hint = "Every block's parameters must be built the same way on every call of its builder."
        else:
            cause = ("the pipelined gradients differ from the plain model's, and not as a per-micro-batch mean "
                     "would make them")
            hint = ("Look for randomness the seed does not fix (dropout), state that crosses samples (batch "
                    "norm) or a loss that depends on the batch's size.")
    return CheckResult(
        workload=config.workload, workload_options=dict(config.workload_options), device=config.device,
        precision=config.precision, point=config.point, status=FAIL if failed else PASS, loss_pipeline=loss,
        loss_plain=plain["loss"], loss_rel_diff=loss_diff, rtol=rtol, atol=atol, blocks=tuple(blocks),
        cause=cause, hint=hint,
    )


def _block_diffs(grads: dict[str, Any], reference: dict[str, Any], rtol: float, atol: float) -> list[BlockCheck]:
    grads, reference = _arrays(grads), _arrays(reference)
    by_block: dict[int, list[str]] = {}
    for name in reference:
        by_block.setdefault(int(name.split(".", 1)[0]), []).append(name)
    found = []
    for block, names in sorted(by_block.items()):
        shared = [n for n in names if n in grads]
        worst_abs = max((float(abs(grads[n] - reference[n]).max()) for n in shared), default=math.inf)
        scale = max((float(abs(reference[n]).max()) for n in shared), default=0.0)
        found.append(BlockCheck(block=block, max_abs_diff=worst_abs, max_rel_diff=worst_abs / scale if scale else
                                (0.0 if worst_abs == 0 else math.inf), ok=worst_abs <= atol + rtol * scale))
    return found


def _arrays(tensors: dict[str, Any]) -> dict[str, Any]:
    """numpy arrays (float64) of tensors or arrays, so both sides compare alike."""
    import numpy as np

    return {name: np.asarray(t.double().numpy() if hasattr(t, "double") else t, dtype=np.float64)
            for name, t in tensors.items()}


def plain_gradients(spec: Any) -> dict[str, Any]:
    """In a fresh process: the plain model's loss and gradients on one optimizer step's samples at once,
    and its gradients of the loss as the pipeline forms it (each micro-batch's loss over micro-batches x
    accumulation steps x replicas, summed). The same weights and samples as the pipeline's ranks."""
    import torch

    from mbtune.pipeline.handover import step_batch
    from mbtune.training import autocast_for
    from mbtune.workloads import load_workload
    from mbtune.workloads.chain import batch_cat, batch_chunk, batch_to

    workload = load_workload(spec.workload, spec.workload_options)
    device = torch.device("cuda:0" if spec.device == "cuda" else "cpu")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = workload.build(seed=spec.seed).to(device)
    model.train()
    batches = [step_batch(workload, spec.replicas_batch_size, seed=spec.seed, step_index=0, accum_index=a)
               for a in range(spec.grad_accum_steps)]
    inputs = batch_to(batch_cat([b[0] for b in batches]), device)
    targets = torch.cat([b[1] for b in batches]).to(device)
    with autocast_for(spec.precision, device):
        loss = workload.loss(model(inputs), targets)
    loss.backward()
    whole = _numpy_grads(model)
    model.zero_grad(set_to_none=True)
    chunks = spec.num_micro_batches * spec.data_parallel_size  # each replica's micro-batches, replica after replica
    parts = chunks * spec.grad_accum_steps
    for batch_inputs, batch_targets in batches:
        for x, y in zip(batch_chunk(batch_to(batch_inputs, device), chunks), batch_targets.to(device).chunk(chunks)):
            with autocast_for(spec.precision, device):
                part = workload.loss(model(x), y) / parts
            part.backward()
    summed = _numpy_grads(model)
    first = batches[0][0]
    return {"loss": float(loss.detach()), "grads": whole, "summed_grads": summed,
            "batch_statistics": _batch_statistics(model, batch_to(first, device), chunks)}


def _batch_statistics(model: Any, inputs: Any, chunks: int) -> list[str]:
    """Where a sample's output depends on the other samples of its batch (BatchNorm's batch statistics, or
    anything else that mixes samples): the batch-norm modules by name, or ["the model"] when the outputs
    of the whole batch and of its micro-batches differ with no batch norm to name. [] when they agree."""
    import torch

    from mbtune.workloads.chain import batch_chunk, tensors_of

    with torch.no_grad():
        whole = [t.double() for t in tensors_of(model(inputs))]
        parts = [[t.double() for t in tensors_of(model(x))] for x in batch_chunk(inputs, chunks)]
    # Per-sample outputs only: a scalar (the model's own loss beside its logits) is a reduction over the batch.
    joined = [(a, torch.cat(pieces)) for a, pieces in zip(whole, zip(*parts)) if a.dim() and all(p.dim() for p in pieces)]
    differ = any(a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in joined)
    if not differ:
        return []
    norms = [name for name, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             or any("batch_norm" in str(node.target) for node in getattr(getattr(m, "graph", None), "nodes", ()))]
    named = [n.replace(".piece.", ".", 1) for n in norms if "norm" in n.lower() or "bn" in n.lower()]
    return named or norms or ["the model"]


def _numpy_grads(model: Any) -> dict[str, Any]:
    """The gradients as numpy arrays: they cross back to the parent by value (a tensor would be sent as a
    shared-memory handle, gone with this process)."""
    return {name: p.grad.detach().to("cpu").double().numpy().copy() for name, p in model.named_parameters()
            if p.grad is not None}
