"""Inference on a workload, inside a fresh process: what the server's model process is given (ModelSpec),
and the service-time curve (the latency of one batch of each size, warm). The batches run through
mbtune.probing.inference.InferenceModel, as the inference probe's trials (probing/trial.py) do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mbtune.probing.inference import InferenceModel
from mbtune.serving.config import pin_process, serve_threads
from mbtune.serving.records import ServiceCurve, ServiceTime, TensorSignature
from mbtune.workloads import load_workload

# Each size of the curve: warm-up passes, then timed passes until both counts below are reached (or the
# most passes, or the time cap).
WARMUP_PASSES = 2
MIN_PASSES = 7
MIN_TIMED_S = 0.3
MAX_PASSES = 40
MAX_TIMED_S = 3.0


NO_MODEL = ""  # ModelSpec.workload of a server that measures the load generator (serving/generator.py)


class NoModel:
    """A model that answers at once: a server holding it measures what the pipes and the load generator
    carry on this machine, and nothing else."""

    def gather(self, indices: list[int]) -> list[int]:
        return indices

    def run(self, inputs: object) -> float:
        return 0.0


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The model a serving process holds: the workload, where, at what precision, on how many threads."""

    workload: str
    workload_options: tuple[tuple[str, Any], ...] = ()
    device: str = "cpu"
    precision: str = "fp32"
    threads: int | None = None  # None: serve_threads' default
    seed: int = 0
    cores: tuple[int, ...] = ()  # the serving process runs on these cores alone (): not pinned

    def pin(self) -> None:
        """Keep the serving process to its cores (where it has some)."""
        pin_process(self.cores)

    def served(self, pool_size: int = 0) -> InferenceModel | NoModel:
        """The model a server process holds: load()'s, or for NO_MODEL one that answers at once (on the
        process's cores either way)."""
        if self.workload != NO_MODEL:
            return self.load(pool_size)
        self.pin()
        return NoModel()

    def load(self, pool_size: int = 0) -> InferenceModel:
        """In the serving process: its cores and torch threads set, the model built and ready."""
        self.pin()
        torch.set_num_threads(serve_threads(self.threads))
        return InferenceModel(load_workload(self.workload, self.workload_options), device=self.device,
                              precision=self.precision, seed=self.seed, pool_size=pool_size)


@dataclass(frozen=True, kw_only=True)
class CurveSpec:
    """What the service-time child measures."""

    model: ModelSpec
    sizes: tuple[int, ...] = (1,)
    stop_above_s: float | None = None  # sizes after one whose median passes this are not measured


def measure_curve(spec: CurveSpec) -> ServiceCurve:
    """The service-time curve, measured in this (fresh) process, sizes in ascending order."""
    model = spec.model.load()
    times, stopped = [], ""
    for size in sorted(set(spec.sizes)):
        inputs = model.inputs(size)
        for _ in range(WARMUP_PASSES):
            model.run(inputs)
        passes: list[float] = []
        while len(passes) < MAX_PASSES and sum(passes) < MAX_TIMED_S and (
                len(passes) < MIN_PASSES or sum(passes) < MIN_TIMED_S):
            passes.append(model.run(inputs))
        times.append(ServiceTime(batch_size=size, times_s=tuple(passes)))
        del inputs
        if spec.stop_above_s is not None and times[-1].median_s > spec.stop_above_s:
            larger = [s for s in spec.sizes if s > size]
            if larger:
                stopped = (f"sizes above {size} not measured: one batch of {size} takes "
                           f"{times[-1].median_s * 1e3:.1f} ms, over the {spec.stop_above_s * 1e3:g} ms budget")
            break
    inputs, outputs = model.signature()
    return ServiceCurve(times=tuple(times), threads=serve_threads(spec.model.threads), stopped=stopped,
                        inputs=tuple(TensorSignature(dtype=d, dims=s) for d, s in inputs),
                        outputs=tuple(TensorSignature(dtype=d, dims=s) for d, s in outputs))
