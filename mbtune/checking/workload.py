"""The workload validated before any pipeline runs (`mbtune check --workload X` with no pipeline options):
in one fresh process on the CPU, in seconds, per block:

- what it hands over (shapes, dtypes, contiguity) and whether that can cross a stage boundary;
- that every boundary hands over both ways: each block run alone on its predecessor's output as a stage
  receives it (detached), the gradients sent back block by block, give the gradients of the whole chain;
- its parameters (a tie's copies once) and its training FLOPs (forward and backward, FlopCounterMode);
- for a model split by mbtune (Workload.from_module, hf:), that the chain computes the model's own loss.
"""

from __future__ import annotations

import math
from typing import Any

from mbtune.checking.records import BlockValidation, ValidationResult
from mbtune.checking.run import FAIL, PASS, TOLERANCES
from mbtune.errors import HarnessError, TrialFailedError
from mbtune.records import OK

VALIDATION_BATCH = 4


def validate_workload(workload: str, options: tuple[tuple[str, Any], ...] = (), *, seed: int = 0,
                      timeout_s: float = 120.0) -> ValidationResult:
    """Validate the workload in a fresh process (user code runs there, as in every trial)."""
    from mbtune.worker import run_isolated

    outcome = run_isolated(_validate, workload, options, seed, timeout_s=timeout_s)
    if outcome.status != OK:
        error = (outcome.error or "no error text").strip()
        if "WorkloadError" in error or "ConfigError" in error:
            raise TrialFailedError(f"the workload does not load: {error.splitlines()[-1]}", detail=outcome.error_tail)
        raise HarnessError(f"the validation ended as {outcome.status}: {error.splitlines()[-1]}",
                           detail=outcome.error_tail)
    value: ValidationResult = outcome.value
    return value


def _validate(workload_name: str, options: tuple[tuple[str, Any], ...], seed: int) -> ValidationResult:
    import torch

    from mbtune.workloads import load_workload
    from mbtune.workloads.chain import batch_to

    torch.manual_seed(seed)
    workload = load_workload(workload_name, options)
    inputs, targets = workload.make_batch(VALIDATION_BATCH, torch.Generator().manual_seed(seed))
    inputs = batch_to(inputs, "cpu")
    chain = workload.build(seed=seed)
    chain.train()
    flops = _flops_per_block(chain, workload, inputs, targets)
    whole_grads, loss = _chain_gradients(chain, workload, inputs, targets)
    outputs, per_block_grads, no_grad = _boundary_gradients(chain, workload, inputs, targets)
    rtol, atol = TOLERANCES["fp32"]
    copies = workload.tied_copies()
    blocks = []
    for index, block in enumerate(chain):
        names = [n for n, _ in block.named_parameters()]
        diffs = [_rel_diff(per_block_grads.get(f"{index}.{n}"), whole_grads.get(f"{index}.{n}")) for n in names]
        worst = max(diffs, default=0.0)
        blocks.append(BlockValidation(
            block=index, name=_block_name(block), parameters=sum(p.numel() for n, p in block.named_parameters()
                                                                 if (index, n) not in copies),
            flops_per_sample=flops.get(index, 0.0) / VALIDATION_BATCH, hands_over=_describe(outputs[index]),
            crosses=_crosses(outputs[index]) if index < len(chain) - 1 else "",
            gradient_back=index not in no_grad, max_rel_diff=worst,
            ok=worst <= rtol * 10 + atol and index not in no_grad and not _crosses(outputs[index]).startswith("no")))
    model_loss = _whole_model_loss(workload, seed, inputs, targets)
    loss_diff = abs(model_loss - loss) / max(abs(model_loss), 1e-12) if model_loss is not None else None
    failed = [b for b in blocks if not b.ok]
    cause = ""
    if failed:
        first = failed[0]
        cause = (f"block {first.block} ({first.name}): " + (
            "its input gets no gradient back: the hand-over breaks the graph" if not first.gradient_back else
            f"its output cannot cross a stage boundary ({first.crosses})" if first.crosses.startswith("no") else
            f"its gradients through a stage boundary differ from the chain's ({first.max_rel_diff:.2g})"))
    elif loss_diff is not None and not loss_diff <= 1e-5:
        cause = f"the blocks' loss {loss:.6g} is not the model's own {model_loss:.6g}"
    return ValidationResult(workload=workload_name, workload_options=dict(options), status=FAIL if cause else PASS,
                            batch_size=VALIDATION_BATCH, loss=loss, model_loss=model_loss, blocks=tuple(blocks),
                            ties=tuple(tuple(f"{b}.{n.removeprefix('piece.')}" for b, n in tie) for tie in workload.ties),
                            cause=cause)


def _block_name(block: Any) -> str:
    from mbtune.workloads.pieces import TracedBlock

    return block.label if isinstance(block, TracedBlock) else type(block).__name__


def _flops_per_block(chain: Any, workload: Any, inputs: Any, targets: Any) -> dict[int, float]:
    """Training FLOPs (forward and backward) of each block on the batch, as FlopCounterMode attributes them."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        workload.loss(chain(inputs), targets).backward()
    chain.zero_grad(set_to_none=True)
    counts = counter.get_flop_counts()
    found: dict[int, float] = {}
    for key, per_op in counts.items():
        parts = key.split(".")
        if len(parts) == 2 and parts[1].isdigit():  # "<chain class>.<block index>"
            found[int(parts[1])] = float(sum(per_op.values()))
    return found


def _chain_gradients(chain: Any, workload: Any, inputs: Any, targets: Any) -> tuple[dict[str, Any], float]:
    loss = workload.loss(chain(inputs), targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in chain.named_parameters() if p.grad is not None}
    chain.zero_grad(set_to_none=True)
    return grads, float(loss.detach())


def _boundary_gradients(chain: Any, workload: Any, inputs: Any,
                        targets: Any) -> tuple[list[Any], dict[str, Any], set[int]]:
    """Every block alone on what it would receive as a stage, gradients sent back block by block."""
    import torch

    from mbtune.workloads.chain import as_received, call_block, tensors_of

    received: list[Any] = []
    outputs: list[Any] = []
    value = inputs
    for block in chain:
        value = as_received(value) if received else value
        received.append(value)
        value = call_block(block, value)
        outputs.append(value)
    loss = workload.loss(outputs[-1], targets)
    loss.backward()
    no_grad: set[int] = set()
    for index in range(len(chain) - 1, 0, -1):
        sent, got = tensors_of(outputs[index - 1]), tensors_of(received[index])
        pairs = [(s, g.grad) for s, g in zip(sent, got) if g.requires_grad]
        if any(grad is None for _, grad in pairs) and any(s.requires_grad for s, _ in pairs):
            no_grad.add(index)
        live = [(s, grad) for s, grad in pairs if grad is not None and s.requires_grad]
        if live:
            torch.autograd.backward([s for s, _ in live], [grad for _, grad in live])
    grads = {n: p.grad.detach().clone() for n, p in chain.named_parameters() if p.grad is not None}
    chain.zero_grad(set_to_none=True)
    return outputs, grads, no_grad


def _rel_diff(got: Any, expected: Any) -> float:
    if got is None and expected is None:
        return 0.0
    if got is None or expected is None:
        return math.inf
    scale = float(expected.abs().max())
    diff = float((got - expected).abs().max())
    return diff / scale if scale else (0.0 if diff == 0 else math.inf)


def _describe(value: Any) -> str:
    from mbtune.workloads.chain import tensors_of

    parts = []
    for tensor in tensors_of(value):
        layout = "" if tensor.is_contiguous() else " (not contiguous: sent as a copy)"
        parts.append(f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}{layout}")
    kind = "dict" if isinstance(value, dict) else "tuple" if isinstance(value, tuple | list) else ""
    return (f"{kind} " if kind else "") + "; ".join(parts)


def _crosses(value: Any) -> str:
    """Whether a block's output can be a stage's hand-over: "yes", or "no: why". Every dtype crosses (torch's
    shape inference runs a stage on buffers of zeros: pipeline/schedules.py); only tensors do."""
    import torch

    from mbtune.workloads.chain import tensors_of

    others = [v for v in tensors_of(value) if not isinstance(v, torch.Tensor)]
    if others:
        return f"no: a {type(others[0]).__name__} (only tensors cross a stage boundary)"
    return "yes"


def _whole_model_loss(workload: Any, seed: int, inputs: Any, targets: Any) -> float | None:
    """The loss of the user's own model (built under the same seed) where mbtune split it, else None."""
    import torch

    from mbtune.workloads.traced import TracedWorkload, whole_model_loss

    if not isinstance(workload, TracedWorkload):
        return None
    with torch.no_grad():
        return whole_model_loss(workload, seed, inputs, targets)
