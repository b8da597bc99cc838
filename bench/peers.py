"""Peer batch-size finders for bench/probe.py: PyTorch Lightning's `Tuner.scale_batch_size(mode="binsearch")`
and Hugging Face Accelerate's `find_executable_batch_size`.

Each peer runs once, whole, in its own fresh process forked from mbtune's forkserver (torch preloaded) and
capped exactly as an mbtune CPU trial is: the peer's library is imported first, then the same
`CpuBackend.limit_memory` call mbtune's trial makes (the live tensor bytes of the process's main thread
counted against the budget, torch.OutOfMemoryError past it), then the workload is built and the peer
searches the way it was written to: it catches each OOM inside that one process and tries again. The optimizer and the training step are mbtune's own.

Both peers decide "this was an OOM" by reading the exception's message. A wrapper around that check
records every exception it was shown and what the peer decided. Where the peer would miss an error that
mbtune classifies as an OOM (same type and allocator messages as mbtune's trials use), the wrapper says
yes instead, so the peer keeps searching rather than crashing; each such translation is counted and
printed. With torch's CPU allocator message ("DefaultCPUAllocator: can't allocate memory") both peers'
own checks answer yes, so the translation is expected never to fire.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import logging
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mbtune.probing.config import TrialConfig
from mbtune.records import OK
from mbtune.worker import run_isolated

PEERS = ("lightning", "accelerate")
_MODULES = {"lightning": "lightning.pytorch", "accelerate": "accelerate"}
# A message of the kind torch's CPU allocator raises, for the static check.
CPU_ALLOCATOR_MESSAGE = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                         "memory: you tried to allocate 268435456 bytes. Error code 12 (Cannot allocate memory)")


@dataclass
class PeerLog:
    """What one peer did inside its process; sent back to the parent."""

    version: str = ""
    recognises_cpu_message: bool | None = None
    attempts: list[list] = field(default_factory=list)  # [batch size, steps done, ok | oom | error]
    seen: list[tuple[str, bool, bool]] = field(default_factory=list)  # (message, peer said OOM, translated)
    answer: int | None = None
    error: str = ""

    def start(self, batch_size: int) -> None:
        self.attempts.append([batch_size, 0, "running"])

    def step(self) -> None:
        if self.attempts:
            self.attempts[-1][1] += 1

    def finish(self, steps: int) -> None:
        """Settle each attempt's status. A pass that made a batch but trained no step and raised nothing is
        not a training attempt (Lightning prefetches a batch when it resets its loop after the search)."""
        self.attempts = [a for a in self.attempts if not (a[2] == "running" and a[1] == 0)]
        for attempt in self.attempts:
            if attempt[2] == "running":
                attempt[2] = OK if attempt[1] >= steps else "error"

    @property
    def translated(self) -> int:
        return sum(1 for _, _, shim in self.seen if shim)


@dataclass(frozen=True)
class PeerRun:
    """One peer's search as the parent saw it: the log, plus the process's wall time and fate."""

    log: PeerLog | None
    wall_s: float
    failure: str = ""  # why no answer came back (the process or the peer failed), else ""


def missing_reason(name: str) -> str | None:
    """Why a peer cannot run here (not installed), or None when it can."""
    module = _MODULES[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"{module} is not importable (pip install {name})"


def run_peer(name: str, trial: TrialConfig, *, start_batch: int, max_batch: int, max_trials: int,
             timeout_s: float) -> PeerRun:
    """Run one peer's whole search in a fresh capped process; wall time counts from that process's start."""
    result = run_isolated(_peer_main, name, trial, start_batch, max_batch, max_trials, timeout_s=timeout_s)
    if result.status != OK:
        return PeerRun(log=None, wall_s=result.wall_s, failure=f"{result.status}: {_last_line(result.error)}")
    log: PeerLog = result.value
    failure = f"crashed: {_last_line(log.error)}" if log.answer is None else ""
    return PeerRun(log=log, wall_s=result.wall_s, failure=failure)


def _last_line(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else "no error text"


def _peer_main(name: str, trial: TrialConfig, start_batch: int, max_batch: int, max_trials: int) -> PeerLog:
    """Inside the fresh process: import the peer, cap memory as an mbtune trial does, then search."""
    import traceback

    import torch

    from mbtune.device import get_backend
    from mbtune.workloads import load_workload

    warnings.filterwarnings("ignore")
    log = PeerLog()
    peer = _LIGHTNING if name == "lightning" else _ACCELERATE
    module = peer.load(log)  # imported before the cap: start-up, like torch in mbtune's trials
    backend = get_backend("cpu")
    backend.limit_memory(trial.memory_budget_bytes)
    torch.set_num_threads(trial.threads or os.cpu_count() or 1)
    try:
        workload = load_workload(trial.workload, trial.workload_options)
        log.answer = peer.search(module, workload, trial, backend, log, start_batch, max_batch, max_trials)
    except Exception as exc:  # noqa: BLE001 - the peer's failure is the finding
        log.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    log.finish(trial.steps)
    return log


def _watch(check: Callable[[BaseException], bool], log: PeerLog) -> Callable[[BaseException], bool]:
    """The peer's OOM check, recording what it was shown; says yes where the peer misses an mbtune OOM."""
    from mbtune.device import classify_error
    from mbtune.records import OOM

    def watched(exc: BaseException) -> bool:
        said = bool(check(exc))
        translated = not said and classify_error(exc) == OOM
        log.seen.append((str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__,
                         said, translated))
        if log.attempts and log.attempts[-1][2] == "running":
            log.attempts[-1][2] = "oom" if said or translated else "error"
        return said or translated

    return watched


@dataclass(frozen=True)
class _Peer:
    load: Callable[[PeerLog], Any]
    search: Callable[..., int]


def _load_lightning(log: PeerLog) -> Any:
    import lightning
    import lightning.pytorch.tuner.batch_size_scaling as scaling
    from lightning.pytorch.utilities.memory import is_oom_error

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    log.version = lightning.__version__
    log.recognises_cpu_message = bool(is_oom_error(RuntimeError(CPU_ALLOCATOR_MESSAGE)))
    # The binsearch loop calls the name it imported into its own module.
    scaling.is_oom_error = _watch(scaling.is_oom_error, log)
    return lightning


def _search_lightning(lightning: Any, workload: Any, trial: TrialConfig, backend: Any, log: PeerLog,
                      start_batch: int, max_batch: int, max_trials: int) -> int:
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.tuner import Tuner
    from torch.utils.data import DataLoader, IterableDataset

    from mbtune.settings import lr_for
    from mbtune.training import make_optimizer

    class Batches(IterableDataset):
        """Endless synthetic batches at the module's current batch size; each pass is one attempt."""

        def __init__(self, module: LightningModule) -> None:
            self.module = module

        def __len__(self) -> int:
            # Lightning 2.6 asks a reloaded loader for its length before iterating it again after an OOM;
            # an endless stream answers "more than any search needs".
            return 2**20

        def __iter__(self):
            batch_size = self.module.batch_size
            log.start(batch_size)
            generator = torch.Generator().manual_seed(trial.seed)
            while True:
                yield workload.make_batch(batch_size, generator)

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = start_batch
            self.model = workload.build(seed=trial.seed)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            inputs, targets = batch
            return workload.loss(self.model(inputs), targets)

        def on_train_batch_end(self, *args: Any) -> None:
            log.step()

        def configure_optimizers(self) -> Any:
            return make_optimizer(trial.optimizer, list(self.parameters()), lr=lr_for(trial.optimizer, trial.lr))

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Batches(self), batch_size=None, num_workers=0)

    with tempfile.TemporaryDirectory(prefix="bench-lightning-") as root:
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=trial.steps, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=root, num_sanity_val_steps=0)
        tuner = Tuner(trainer)
        # margin=0: the raw answer, comparable with the other ceilings (newer Lightning shaves 5% by
        # default); max_val lifts its 8192 cap. Older releases take neither.
        extra = {"margin": 0.0, "max_val": max_batch}
        accepted = inspect.signature(tuner.scale_batch_size).parameters
        found = tuner.scale_batch_size(Module(), mode="binsearch", steps_per_trial=trial.steps,
                                       init_val=start_batch, max_trials=max_trials,
                                       **{k: v for k, v in extra.items() if k in accepted})
    if found is None:
        raise RuntimeError("Tuner.scale_batch_size returned None")
    return int(found)


def _load_accelerate(log: PeerLog) -> Any:
    import accelerate
    import accelerate.utils.memory as memory

    log.version = accelerate.__version__
    log.recognises_cpu_message = bool(memory.should_reduce_batch_size(RuntimeError(CPU_ALLOCATOR_MESSAGE)))
    # find_executable_batch_size calls the module-level name.
    memory.should_reduce_batch_size = _watch(memory.should_reduce_batch_size, log)
    return accelerate


def _search_accelerate(accelerate: Any, workload: Any, trial: TrialConfig, backend: Any, log: PeerLog,
                       start_batch: int, max_batch: int, max_trials: int) -> int:
    from accelerate.utils import find_executable_batch_size

    from mbtune.probing.trial import _train

    found: list[int] = []

    @find_executable_batch_size(starting_batch_size=start_batch)
    def attempt(batch_size: int) -> None:
        # As Accelerate's docs ask: everything that depends on the batch size (here the model and its
        # optimizer too) is made inside; mbtune's own training step runs trial.steps steps.
        if len(log.attempts) >= max_trials:
            raise RuntimeError(f"gave up after {max_trials} attempts")
        log.start(batch_size)
        for _ in _train(workload, dataclasses.replace(trial, batch_size=batch_size), backend):
            log.step()
        found.append(batch_size)

    attempt()
    return found[-1]


_LIGHTNING = _Peer(load=_load_lightning, search=_search_lightning)
_ACCELERATE = _Peer(load=_load_accelerate, search=_search_accelerate)
