"""The probe's ceiling, predicted before any trial runs: a trial's own training steps (trial.train_steps: the
model as built, its optimizer and state, its outputs held into the next step) run on fake tensors, shapes
and storages without memory or arithmetic, their live tensor bytes counted as the CPU budget counts them
(device/tensor_bytes.py). A few sizes give the line bytes = fixed + per sample x batch; the largest size
whose predicted peak fits the budget is checked on fake tensors too, and the probe starts there.

On the CPU the prediction counts what the trial counts. On CUDA it predicts the allocated peak: the fake
step's tensors and the cuBLAS workspaces torch takes from the allocator (one per thread that multiplies
matrices: the step's own and autograd's). The budget caps what the allocator reserves, which is more (its
blocks rounded and split), so the predicted ceiling leaves ALLOCATOR_SLACK of the budget to it, and the
trials find how far the prediction was.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from mbtune.device.cuda import training_workspace_bytes
from mbtune.errors import WorkloadError
from mbtune.probing.config import TrialConfig
from mbtune.probing.records import CeilingPrediction
from mbtune.workloads import Workload, failed_part, load_workload

# The sizes the line is fitted through, in granules: far enough apart that the fixed part (weights and
# optimizer state) does not blur the slope, small enough to predict in a second or two.
LINE_SIZES = (1, 9)
MAX_CHECKS = 16  # fake steps spent finding the largest size that fits, past the first two


class _FakeBackend:
    """What train_steps needs of a device, on fake tensors."""

    def __init__(self, device: str) -> None:
        self.torch_device = device

    def synchronize(self) -> None:
        """Nothing runs: nothing to wait for."""


def predict_trial_peak(config: TrialConfig, workload: Workload | None = None) -> int:
    """The peak live tensor bytes of this trial's training steps, from the same steps on fake tensors.
    `workload`: the config's, loaded already (a traced model is traced once, for real, on meta)."""
    import torch

    from mbtune.device.tensor_bytes import TensorBytes, fake_tensors
    from mbtune.probing.trial import train_steps
    if workload is None:
        workload = load_workload(config.workload, config.workload_options)
    device = "cuda" if config.device.startswith("cuda") else "cpu"
    count = TensorBytes(device_type=device)
    with fake_tensors(), count, torch.random.fork_rng(devices=[]):
        for _ in train_steps(workload, replace(config, memory_budget_bytes=None), _FakeBackend(config.device)):
            pass
    return count.peak_bytes + training_workspace_bytes(config.device)


def predict_ceiling(config: TrialConfig, memory_budget_bytes: int, granularity: int,
                    max_batch: int | None = None) -> CeilingPrediction | None:
    """The largest size whose predicted peak fits `memory_budget_bytes` (None: not even one granule fits)."""
    peaks: dict[int, int] = {}
    workload = load_workload(config.workload, config.workload_options)

    def peak(size: int) -> int:
        if size not in peaks:
            try:
                peaks[size] = predict_trial_peak(replace(config, batch_size=size), workload)
            except Exception as exc:  # the workload's error, told as the trials tell it: naming its part
                part = failed_part(exc)
                if part is None:
                    raise
                raise WorkloadError(f"in {part}: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
        return peaks[size]

    if config.device.startswith("cuda"):
        from mbtune.device.cuda import ALLOCATOR_SLACK

        memory_budget_bytes = int(memory_budget_bytes / (1 + ALLOCATOR_SLACK))
    small, large = (n * granularity for n in LINE_SIZES)
    if peak(small) > memory_budget_bytes:
        return None
    per_sample = max((peak(large) - peak(small)) / (large - small), 1.0)
    fixed = peak(small) - per_sample * small
    top = None if max_batch is None else max(granularity, max_batch // granularity * granularity)
    size = _largest_fitting(peak, memory_budget_bytes, granularity, small, large, top)
    return CeilingPrediction(ceiling=size, peak_bytes=peak(size), fixed_bytes=fixed, per_sample_bytes=per_sample)


def _largest_fitting(peak: Callable[[int], int], budget: int, granularity: int, small: int, large: int,
                     top: int | None) -> int:
    """The largest multiple of the granularity whose peak fits the budget, `small` known to fit: each step
    aims where the line through the two sizes nearest the budget crosses it (the line from small sizes
    bends: weights and state dominate there), inside the bracket found so far; it bisects where the line
    points outside the bracket, and every other step while the bracket is wide."""
    g = granularity
    lo, hi = small, None  # fits / does not fit
    near = [small, large]
    for _ in range(MAX_CHECKS):
        a, b = sorted(near[-2:])
        slope = max((peak(b) - peak(a)) / (b - a), 1.0)  # every size tried is new: a < b
        aim = math.floor((b + (budget - peak(b)) / slope) / g) * g
        if hi is not None and (aim <= lo or aim >= hi or (hi - lo > 4 * g and len(near) % 2)):
            aim = (lo + hi) // 2 // g * g  # the line is no help here, or every other step: bisect
        size = max(lo + g, aim) if hi is None else min(max(lo + g, aim), hi - g)
        if top is not None:
            size = min(size, top)
        if size <= lo:
            break
        if peak(size) <= budget:
            lo = size
        else:
            hi = size
        near.append(size)
        if hi is not None and hi - lo <= g:
            break
    return lo
