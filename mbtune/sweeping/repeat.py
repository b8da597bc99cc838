"""One sweep point's repeats (Measuring) and one repeat of it (run_point): on mbtune's own launcher, its
kept rank processes (pipeline/warm.py) or fresh ones, under torchrun, or the user's own command."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from mbtune.pipeline.point import SweepPoint
from mbtune.settings import lr_for
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.records import PointResult

if TYPE_CHECKING:
    from mbtune.pipeline.warm import WarmRanks
    from mbtune.workloads.facts import WorkloadFacts

log = logging.getLogger(__name__)


class LoadStreak:
    """How many repeats in a row, over every point of a sweep, ran while other processes loaded the machine: a
    load that lasts is the machine's state, not a moment to wait out."""

    LASTING = 2  # busy repeats in a row from which the load is taken to last

    def __init__(self) -> None:
        self.busy = 0

    def saw(self, busy: bool) -> None:
        self.busy = self.busy + 1 if busy else 0

    @property
    def lasting(self) -> bool:
        return self.busy >= self.LASTING


class Measuring:
    """One point's repeats in fresh processes, one at a time: config.repeats of them, or until its throughput
    is known (sweeping/stopping.py); `result` merges them. Until known, a repeat measured while other
    processes loaded the machine is run again (at most MAX_BUSY_RERUNS per point) while the load looks
    passing; once it lasts (LoadStreak), busy repeats are kept, marked with the load they saw, and a point
    never measured quietly keeps its busy repeats: a busy machine's figures come with a caveat, never as
    nothing. A failed repeat fails the point; the repeats after the first measure enough steps to fill
    MIN_REPEAT_WINDOW_S each (at most MAX_STEPS); the time cap counts this point's own repeats, not the
    others' run between them."""

    def __init__(self, point: SweepPoint, config: SweepConfig, device: str, threads: int | None,
                 workload: WorkloadFacts, peak_total: float | None,
                 block_times_s: tuple[float, ...] | None = None, ranks: WarmRanks | None = None,
                 load: LoadStreak | None = None) -> None:
        self.point, self.config, self.device, self.threads, self.ranks = point, config, device, threads, ranks
        self.workload, self.peak_total, self.block_times_s = workload, peak_total, block_times_s
        self.load = load or LoadStreak()
        self.steps = config.measured_steps
        self.runs: list[PointResult] = []
        self.busy: list[PointResult] = []  # busy repeats run again: the point's figure while it has no other
        self.reruns, self.spent_s, self.stopped = 0, 0.0, ""
        self.round = 0  # the round-robin round the next repeat runs in (0: measured on its own)
        self.rounds: list[int] = []  # the round each kept repeat ran in
        self._merged: tuple[int, PointResult] | None = None  # (repeats merged, their merge)

    def repeat(self) -> None:
        import time

        from mbtune.sweeping.stopping import FAILED, FIXED, MAX_BUSY_RERUNS, should_stop

        config, point = self.config, self.point
        started = time.monotonic()
        sets = self.ranks.starts if self.ranks is not None else 0

        def once() -> PointResult:
            return run_point(point, replace(config, measured_steps=self.steps), self.device, self.threads,
                             self.workload, self.peak_total, self.block_times_s, self.ranks)

        run = once()
        if not run.ok and self.ranks is not None and self.ranks.starts == sets:
            # It failed on processes kept from earlier points (what they still hold, a rank that died between
            # points): the point is judged on a fresh set, as it would run alone.
            log.info("%s failed on kept rank processes (%s); running it on fresh ones", point.label, run.status)
            run = once()
        self.spent_s += time.monotonic() - started
        # Until known only (fixed repeats run exactly as many as asked), and on one node (across nodes this
        # host's load is not the point's whole story): elsewhere a busy repeat keeps its warning.
        busy = run.ok and run.load is not None and run.load.busy
        lasting = self.load.lasting
        self.load.saw(busy)
        if (busy and not lasting and self.reruns < MAX_BUSY_RERUNS and config.repeats is None
                and config.nodes.nnodes == 1):
            assert run.load is not None
            self.reruns += 1
            self.busy.append(run)
            log.info("%s: measured while the machine was busy (%s); running it again", point.label, run.load.reason)
            return
        self.runs.append(run)
        self.rounds.append(self.round)
        if not run.ok:
            self.stopped = FAILED
        elif config.repeats is not None:
            self.stopped = FIXED if len(self.runs) >= config.repeats else ""
        else:
            if len(self.runs) == 1:
                self.steps = steps_to_fill(run.step_times_s, self.steps)
            # Raced, the sweep's time budget bounds the measuring, not a point's own cap: a point still tied
            # with the best goes on until the race decides it.
            cap = math.inf if config.races else config.max_time_per_point_s
            self.stopped = should_stop(self._rates(), target_width=config.target_ci, elapsed_s=self.spent_s,
                                       repeat_s=self.repeat_s(), max_time_s=cap) or ""

    @property
    def measured(self) -> bool:
        """Whether the point has a figure (a busy one, if nothing else)."""
        return bool(self.runs or self.busy)

    def _kept(self) -> list[PointResult]:
        return self.runs or self.busy

    def _rates(self) -> list[float]:
        return [self.point.global_batch / r.step_time_median_s for r in self._kept() if r.step_time_median_s]

    def rate(self) -> float | None:
        """The mean rate so far (None before the first repeat)."""
        rates = self._rates()
        return sum(rates) / len(rates) if rates else None

    def repeat_s(self) -> float:
        """How long a repeat of this point has taken, on average so far."""
        return self.spent_s / max(1, len(self.runs) + self.reruns)

    def so_far(self) -> str:
        """The mean rate so far and its interval, for the progress line (empty before the first)."""
        from mbtune.sweeping.stopping import interval

        rate = self.rate()
        if rate is None:
            return ""
        known = interval(self._rates(), "")
        spread = f" +-{known.half:.1%}" if known else ""
        return f" (so far {rate:,.1f} samples/s{spread})"

    def result(self) -> PointResult:
        from mbtune.sweeping.measured import merge_repeats

        kept = self._kept()
        if self._merged is None or self._merged[0] != len(kept) + len(self.runs):
            merged = merge_repeats(kept)
            if not any(b is not None for b in merged.peak_memory_bytes):
                # The repeat that counted memory ran while the machine was busy and was run again uncounted: a
                # CPU load moves time, not the bytes held, so its count stands.
                counted = next((r for r in self.busy if any(b is not None for b in r.peak_memory_bytes)), None)
                if counted is not None:
                    merged = replace(merged, peak_memory_bytes=counted.peak_memory_bytes)
            self._merged = (len(kept) + len(self.runs), merged)
        rounds = tuple(self.rounds) if self.round and self.runs else ()
        return replace(self._merged[1], stopped=self.stopped, busy_reruns=self.reruns, repeat_rounds=rounds)


MIN_REPEAT_WINDOW_S = 0.5  # until known, a repeat measures at least this long (the first one calibrates)
MAX_STEPS = 50


def steps_to_fill(step_times_s: Sequence[float], steps: int) -> int:
    """Measured steps for a repeat to last MIN_REPEAT_WINDOW_S, from one repeat's step times; never fewer
    than `steps`, never more than MAX_STEPS."""
    window = sum(step_times_s)
    if window <= 0:
        return steps

    return max(steps, min(MAX_STEPS, math.ceil(len(step_times_s) * MIN_REPEAT_WINDOW_S / window)))


def run_point(point: SweepPoint, config: SweepConfig, device: str, threads: int | None, workload: WorkloadFacts,
               peak_total: float | None, block_times_s: tuple[float, ...] | None = None,
               ranks: WarmRanks | None = None) -> PointResult:
    from mbtune.device.machine_load import LoadMeter, busy_warning
    from mbtune.device.nvml import NvmlSampler
    from mbtune.pipeline.launch import run_pipeline_point
    from mbtune.pipeline.point_spec import PipelineSpec
    from mbtune.sweeping.measured import summarize_point

    if config.command:
        import resource

        from mbtune.sweeping.command import run_command_point

        def children_cpu_s() -> float:  # the command's processes, once they were waited for
            used = resource.getrusage(resource.RUSAGE_CHILDREN)
            return used.ru_utime + used.ru_stime

        with LoadMeter() as meter:
            before = children_cpu_s()
            result = run_command_point(point, config, device)
            spent = children_cpu_s() - before
        load = meter.load(rank_cpu_s=spent, num_ranks=point.num_processes)
        warning = busy_warning(point.label, load)
        return replace(result, load=load, warnings=result.warnings + ((warning,) if warning else ()))
    spec = PipelineSpec.for_point(
        point, workload=config.workload, workload_options=config.workload_options, device=device,
        warmup_steps=config.warmup_steps, measured_steps=config.measured_steps, seed=config.seed,
        optimizer=config.optimizer, lr=lr_for(config.optimizer, config.lr), precision=config.precision,
        threads=threads, balance="time" if block_times_s else "parameters", block_weights=block_times_s,
        pin_cpus=config.pin_cpus and device == "cpu")
    # Rank r runs on CUDA device r; only those GPUs are sampled, and only the samples of the measured steps
    # are summarised (the ranks report when those ran).
    gpus = range(spec.world_size) if spec.device == "cuda" else ()
    with NvmlSampler(cuda_indices=gpus) as sampler, LoadMeter() as meter:
        if config.launcher == "torchrun":
            from mbtune.pipeline.torchrun import session

            outcome = session(config.nodes, config.command_line).run_point(spec, timeout_s=config.point_timeout_s)
        elif ranks is not None:
            outcome = ranks.run(spec, timeout_s=config.point_timeout_s)
        else:
            outcome = run_pipeline_point(spec, timeout_s=config.point_timeout_s)
    result = summarize_point(point, outcome, tokens_per_sample=workload.tokens_per_sample,
                             flops_per_sample=workload.flops_per_sample, peak_flops_total=peak_total)
    window, uuids = outcome.measured_window_unix_s, outcome.device_uuids
    # Kept ranks are alive at both ends of the meter: it counts their CPU time itself, as this process's children.
    rank_cpu_s = 0.0 if ranks is not None and outcome.ok else outcome.rank_cpu_time_s
    load = meter.load(rank_cpu_s=rank_cpu_s, our_pids=outcome.pids, num_ranks=spec.world_size,
                      gpu_pids=sampler.compute_pids(uuids, window) if gpus else None)
    warning = busy_warning(point.label, load)
    backend = "nccl" if spec.device == "cuda" else "gloo"
    ran_as = f"{spec.world_size} process(es), {backend}" + (", kept between repeats and points" if ranks else "")
    if cores := outcome.pinned_cores:
        ran_as += ", pinned to cores " + " | ".join(",".join(map(str, c)) for c in cores)
    if config.launcher == "torchrun":
        ran_as += f", torchrun on {config.nodes.nnodes} node(s)" if config.nodes.nnodes > 1 else ", torchrun"
    if spec.data_parallel_size > 1:
        ran_as += f" ({spec.num_ranks} stages x {spec.data_parallel_size} replicas, gradients all-reduced)"
    return replace(result, nvml=sampler.summary(uuids, window), ran_as=ran_as, load=load,
                   warnings=result.warnings + ((warning,) if warning else ()))
