"""What the parent needs to know of a workload, learnt in a fresh process under a deadline.

Importing a user's module and calling its factory runs user code: it may hang, exit, or crash the
interpreter. mbtune's own process never runs it; a child does, under `load_timeout_s`, and hands back
the facts (block count, parameters, FLOPs and tokens per sample) or the reason there are none. A second
child counts the FLOPs on the meta device, where a failure costs only the count. The
built-in workloads are mbtune's own code and load here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mbtune.errors import HarnessError, MbtuneError, WorkloadError, WorkloadLoadError
from mbtune.records import ERROR, HARNESS_FAULT, Record
from mbtune.settings import DEFAULT_LOAD_TIMEOUT_S

if TYPE_CHECKING:
    from mbtune.worker import ChildResult


@dataclass(frozen=True, kw_only=True)
class WorkloadFacts(Record):
    """A workload as the parent sees it: sizes and rates, no modules."""

    name: str
    num_blocks: int
    num_parameters: int  # a tied tensor once
    flops_per_sample: float | None = None  # the workload's own figure, else the counted one
    tokens_per_sample: int | None = None
    flops_counted: float | None = None  # FlopCounterMode's count (flops.py), None where the meta device cannot run it
    warnings: tuple[str, ...] = ()


# The FLOPs count runs the workload's forward and backward once, on the meta device: a second child, under
# its own deadline, so that a forward that cannot run there (or hangs, or kills its process) leaves the count
# unknown instead of failing the load.
COUNT_TIMEOUT_S = 60.0


def workload_facts(name: str, options: Sequence[tuple[str, Any]] = (), *,
                   timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> WorkloadFacts:
    """Load the workload in a fresh process (never this one) and return its facts, with its training FLOPs
    per sample counted in another (see COUNT_TIMEOUT_S)."""
    from dataclasses import replace

    from mbtune.workloads.flops import flops_warning

    facts = in_child(_facts, name, tuple(options), timeout_s=timeout_s)
    counted, why = _counted(name, tuple(options), min(timeout_s, COUNT_TIMEOUT_S))
    warning = (flops_warning(name, facts.flops_per_sample, counted) if why is None
               else f"workload {name!r}: its FLOPs per sample could not be counted ({why}): MFU is unknown"
               if facts.flops_per_sample is None else None)
    return replace(facts, flops_per_sample=facts.flops_per_sample or counted, flops_counted=counted,
                   warnings=facts.warnings + ((warning,) if warning else ()))


@functools.lru_cache(maxsize=64)
def _counted(name: str, options: tuple[tuple[str, Any], ...], timeout_s: float) -> tuple[float | None, str | None]:
    """(FLOPs per sample, None), or (None, why there is no count). mbtune's own workloads are counted here."""
    from mbtune.worker import run_isolated

    if ":" not in name:
        counted = _count(name, options)
        return counted, None if counted is not None else "the meta device could not run its step"
    result = run_isolated(_count, name, options, timeout_s=timeout_s)
    if result.status != "ok":
        return None, {"timeout": f"its step did not finish within {timeout_s:g} s on the meta device",
                      "killed": "the counting process was killed"}.get(
            result.status, (result.error.strip().splitlines() or ["no error text"])[-1].strip())
    return result.value, None if result.value is not None else "the meta device could not run its step"


def _count(name: str, options: tuple[tuple[str, Any], ...]) -> float | None:
    from mbtune.workloads import load_workload
    from mbtune.workloads.flops import count_flops_per_sample

    return count_flops_per_sample(load_workload(name, options))


@functools.lru_cache(maxsize=64)
def in_child(target: Callable[..., Any], name: str, options: tuple[tuple[str, Any], ...], *,
             timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> Any:
    """target(name, options), which loads workload `name` and returns a picklable value, run in a fresh
    process under a deadline.

    A bad name or option, or a factory that breaks the contract (one that calls sys.exit or os._exit
    instead of returning, or whose blocks build no modules), raises WorkloadError (bad input, exit 2), as
    loading it here would. A factory that hangs or whose process is killed raises WorkloadLoadError (exit
    3) saying which; a process that died before it reached the factory, HarnessError. What came back is
    kept for this process's lifetime (a run asks for the same facts more than once); failures are not
    kept, so they are tried again."""
    from mbtune.worker import run_isolated

    if ":" not in name:  # a built-in workload (or an unknown name): mbtune's own code, no user code to guard
        return target(name, options)
    result = run_isolated(_guarded, target, name, options, timeout_s=timeout_s)
    if result.status == "ok" and result.value[0] == "value":
        return result.value[1]
    raise _failure(result, name, timeout_s)


def _failure(result: ChildResult, name: str, timeout_s: float) -> MbtuneError:
    """The error of a loading process that gave no value (see in_child)."""
    if result.status == "ok":
        kind, payload = result.value
        if kind == "bad_input":
            message, hint = payload
            return WorkloadError(message, hint=hint)
        if kind == "failed":
            why = (payload.strip().splitlines() or ["no error text"])[-1]
            return WorkloadLoadError(f"loading workload {name!r} failed: {why}", detail=payload)
        return WorkloadError(f"workload {name!r}: {payload}", hint=_RETURN)
    if result.status == "timeout":
        return WorkloadLoadError(
            f"loading workload {name!r} did not finish within {timeout_s:g} s",
            hint="Raise --load-timeout if its import or factory is slow, or fix one that hangs.")
    why = result.error.strip().splitlines()[-1] if result.error.strip() else f"exit code {result.exitcode}"
    if result.error_kind == HARNESS_FAULT:  # the child died before reaching the factory
        return HarnessError(f"could not start a process to load workload {name!r}", hint=why,
                            detail=result.error_tail or result.error)
    if result.status == ERROR and result.exitcode is not None and result.exitcode >= 0:
        # _guarded answers every exception and exit: a process that ended on its own without a word called
        # os._exit in the workload's module or factory.
        return WorkloadError(f"workload {name!r}: loading it ended its process with exit code {result.exitcode} "
                             "instead of returning (os._exit in its module or factory?)", hint=_RETURN)
    return WorkloadLoadError(f"loading workload {name!r} failed: {why}", detail=result.error_tail or result.error)


_RETURN = "A factory must return a Workload, not end its process."


def _guarded(target: Callable[..., Any], name: str, options: tuple[tuple[str, Any], ...]) -> tuple[str, Any]:
    """Runs in the child: ("value", value) | ("bad_input", (message, hint)) | ("exited", text) |
    ("failed", traceback text)."""
    import traceback

    try:
        return "value", target(name, options)
    except WorkloadError as exc:
        return "bad_input", (exc.message, exc.hint)
    except SystemExit as exc:
        return "exited", f"its factory called sys.exit({exc.code!r}) instead of returning"
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        return "failed", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip()


def _facts(name: str, options: tuple[tuple[str, Any], ...]) -> WorkloadFacts:
    from mbtune.workloads import load_workload

    workload = load_workload(name, options)
    _check_blocks(name, workload)
    return WorkloadFacts(name=name, num_blocks=workload.num_blocks, num_parameters=workload.num_parameters(),
                         flops_per_sample=workload.flops_per_sample, tokens_per_sample=workload.tokens_per_sample)


def _check_blocks(name: str, workload: Any) -> None:
    """Each block builder builds a module (on the meta device: nothing allocated), or the workload is refused."""
    import torch
    from torch import nn

    with torch.device("meta"):
        for index, build in enumerate(workload.blocks):
            module = build()
            if not isinstance(module, nn.Module):
                raise WorkloadError(f"workload {name!r}: block {index}'s builder returned {type(module).__name__}, "
                                    "not an nn.Module", hint="Each block builder must return a torch.nn.Module.")
