"""The sweep run: placement of ranks on the machine, the timing pass, each point's repeats in fresh
processes, and the report; each point journaled where a journal is given (session.run_sweep keeps one)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mbtune.device.describe import describe
from mbtune.errors import (
    Interrupted,
)
from mbtune.journal import REPLAYED
from mbtune.pipeline.point import SweepPoint
from mbtune.progress import TrialProgress
from mbtune.records import DeviceInfo
from mbtune.settings import lr_for
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.records import Balance, PointResult, SkippedPoint, SweepReport
from mbtune.sweeping.stopping import INTERRUPTED

if TYPE_CHECKING:
    from mbtune.journal import Journal
    from mbtune.workloads.facts import WorkloadFacts

log = logging.getLogger(__name__)
# The planner's quick search (planning.api.quick_sweep): (points, run_point, *, workload, ...) -> its result.
QuickSweep = Callable[..., Any]
SWEEP_POINT, BALANCE = "sweep_point", "balance"  # journal kinds: a point's result, the blocks' split


def sweep_workload(config: SweepConfig, progress: TrialProgress | None = None,
                   store: Journal | None = None, *, quick: QuickSweep | None = None) -> SweepReport:
    """Run the sweep grid as real pipelines, one fresh process per stage, and rank what they measured.

    Ctrl-C (Interrupted) starts nothing new: the report keeps every finished point, marked interrupted.
    With a store, every finished point is journaled and points journaled earlier are not run again. The
    quick strategy needs `quick`, the planner's search (planning.api.quick_sweep, which session.run_sweep
    passes): the planner calibrates on sweeps, so the sweep is handed it rather than importing it.
    """
    from mbtune.device import resolve_device
    from mbtune.settings import MAX_PROCESSES
    from mbtune.sweeping.feasible import refuse_unrunnable
    from mbtune.sweeping.grid import plan_grid
    from mbtune.workloads.facts import WorkloadFacts, workload_facts

    # A command is the user's own: nothing of it is loaded here, and it splits its model itself.
    workload = (WorkloadFacts(name=config.workload, num_blocks=MAX_PROCESSES * max(2, config.stages_per_rank),
                              num_parameters=0) if config.command else
                workload_facts(config.workload, config.workload_options, timeout_s=config.load_timeout_s))
    device = resolve_device(config.device)
    info = describe(device)
    log.info("sweep of %s (%d blocks) on %s", config.workload, workload.num_blocks, info.name)
    num_ranks, threads, max_processes, warnings = _placement(config, device)
    warnings += [*config.extra_warnings, *workload.warnings]
    if config.repeats is not None and config.measured_steps * config.repeats < 2:
        warnings.append("one measured step per point (--steps 1, --repeats 1) states no spread: each range is "
                        "that one step; measure --steps 2 or more")
    grid = plan_grid(config, num_blocks=workload.num_blocks, num_ranks=num_ranks, max_processes=max_processes,
                     nnodes=config.nodes.nnodes)
    refuse_unrunnable(config, num_blocks=workload.num_blocks, grid=grid)
    points = _Points(config, device, threads, workload, info, progress, store, grid.points)
    interrupted, note = False, ""
    not_run: tuple[SkippedPoint, ...] = ()
    try:
        if config.strategy == "quick":
            assert quick is not None, "the quick strategy needs the planner's search"
            not_run, note = _quick(quick, grid.points, points.run, config, points.balance.block_times_s)
        else:
            points.run_all(grid.points)
    except (Interrupted, KeyboardInterrupt):  # Ctrl-C on the command line, or in a notebook
        interrupted = True
        points.keep_unfinished()
    finally:
        if config.launcher == "torchrun" and config.nodes.nnodes == 1:  # across nodes, the command ends the session
            from mbtune.pipeline.torchrun import close_session

            close_session(config.nodes, 0)
    report = _sweep_report(config, info, points.results, grid.skipped + not_run, len(grid.points), interrupted,
                           warnings, (note,) if note else ())
    return replace(report, balance=points.balance)


class _Points:
    """The sweep's points, each run for real (its repeats in fresh processes, journaled), or taken from an
    interrupted run's journal; and the split of blocks over stages every point runs with."""

    def __init__(self, config: SweepConfig, device: str, threads: int | None, workload: WorkloadFacts,
                 info: DeviceInfo, progress: TrialProgress | None, store: Journal | None,
                 points: Sequence[SweepPoint]) -> None:
        from mbtune.device.peak_flops import peak_flops

        self.config, self.device, self.threads, self.workload = config, device, threads, workload
        self.progress, self.store = progress, store
        self.peak_flops = peak_flops(info.name, config.precision)
        self.results: list[PointResult] = []
        self.order: dict[SweepPoint, int] = {}
        self.unfinished: dict[SweepPoint, _Measuring] = {}
        self.done = {r.point: r for r in map(PointResult.from_dict, store.replayed(SWEEP_POINT))} if store else {}
        # A resumed sweep keeps the split its journaled points ran with.
        replayed = [Balance.from_dict(b) for b in store.replayed(BALANCE)] if store else []
        self.balance = replayed[0] if replayed else _balance(config, points, device, threads)
        if store and not replayed:
            store.record(BALANCE, self.balance.to_dict())
        if progress:
            progress.set_total(len(points))

    def run(self, point: SweepPoint) -> PointResult:
        """One point, measured to its end (the quick strategy chooses the next point from this one's result)."""
        if point in self.done:
            return self._finished(point, self.done[point], REPLAYED)
        measuring = self._measuring(point)
        while not measuring.stopped:
            measuring.repeat()
        return self._finished(point, measuring.result(), "")

    def run_all(self, points: Sequence[SweepPoint]) -> None:
        """Every point, measured round-robin: one repeat of each point still measuring, then the next round,
        until each has stopped. A machine whose speed drifts over minutes then slows every point alike, and
        the points compare as they would side by side; one measured to its end before the next would carry
        the speed of its own minutes alone."""
        self.order = {point: index for index, point in enumerate(points)}
        for point in points:
            if point in self.done:
                self._finished(point, self.done[point], REPLAYED)
        self.unfinished = {point: self._measuring(point) for point in points if point not in self.done}
        rounds = 0
        while self.unfinished:
            rounds += 1
            for point, measuring in list(self.unfinished.items()):
                measuring.round = rounds
                if self.progress:
                    self.progress.working(f"{point.label}, repeat {len(measuring.runs) + 1}{measuring.so_far()}")
                measuring.repeat()
                if measuring.stopped:
                    del self.unfinished[point]
                    self._finished(point, measuring.result(), "")
        self.results.sort(key=lambda r: self.order.get(r.point, len(self.order)))

    def keep_unfinished(self) -> None:
        """Interrupted: the points still measuring keep the repeats they finished (not journaled: a resumed
        sweep measures them anew)."""
        for measuring in self.unfinished.values():
            if measuring.runs:
                self.results.append(replace(measuring.result(), stopped=INTERRUPTED))
        self.unfinished = {}
        self.results.sort(key=lambda r: self.order.get(r.point, len(self.order)))

    def _measuring(self, point: SweepPoint) -> _Measuring:
        peak = self.peak_flops * point.num_processes if self.peak_flops else None
        return _Measuring(point, self.config, self.device, self.threads, self.workload, peak,
                          self.balance.block_times_s or None)

    def _finished(self, point: SweepPoint, result: PointResult, detail: str) -> PointResult:
        if self.store and detail != REPLAYED:
            self.store.record(SWEEP_POINT, result.to_dict())
        self.results.append(result)
        if self.progress:
            self.progress.start_trial(point.label)
            self.progress.end_trial(result.status, detail or _result_detail(result))
        return result


def _sweep_report(config: SweepConfig, info: DeviceInfo, results: list[PointResult],
                  skipped: tuple[SkippedPoint, ...], num_grid_points: int, interrupted: bool,
                  warnings: list[str], notes: tuple[str, ...]) -> SweepReport:
    from mbtune.sweeping.lr import lr_advice
    from mbtune.sweeping.ranking import rank_results, recompute_pairs, tied_with_best, tradeoff

    fixed = config.global_batches
    ranking, pareto = rank_results(results, config.objective, fixed)
    rows, padding = tradeoff(results, ranking)
    advice = lr_advice(config.optimizer, (r.point.global_batch for r in results if r.ok), lr=config.lr,
                       reference_batch=config.reference_batch)
    return SweepReport(
        workload=config.workload, workload_options=dict(config.workload_options), device=info,
        objective=config.objective, precision=config.precision, optimizer=config.optimizer,
        lr=lr_for(config.optimizer, config.lr), results=tuple(results), skipped=skipped, ranking=ranking, pareto=pareto,
        ties=tied_with_best(results, ranking, config.objective, same_global_batch=bool(fixed)),
        global_batches=fixed, global_batch_default=config.global_batch is None and bool(fixed),
        tradeoff=rows, padding=padding or (), recompute_pairs=recompute_pairs(results),
        repeats=config.repeats, target_ci=config.target_ci if config.repeats is None else None,
        strategy=config.strategy,
        num_grid_points=num_grid_points, ceiling=config.ceiling,
        safe_batch=config.safe_batch, ceiling_peak_memory_bytes=config.ceiling_peak_memory_bytes,
        warmup_steps=config.warmup_steps, measured_steps=config.measured_steps, interrupted=interrupted,
        warnings=tuple(warnings), notes=notes, lr_advice=advice, command=config.command,
        steps_from_output=config.steps_from_output, grid=config.grid,
    )


def _quick(quick_sweep: QuickSweep, points: tuple[SweepPoint, ...], run_one: Callable[[SweepPoint], PointResult],
           config: SweepConfig, block_times_s: tuple[float, ...] = ()) -> tuple[tuple[SkippedPoint, ...], str]:
    """The quick strategy: the simulator, calibrated on a few points, picks what to run next."""
    found = quick_sweep(points, run_one, workload=config.workload, workload_options=config.workload_options,
                        optimizer=config.optimizer, block_times_s=block_times_s)
    not_run = tuple(
        SkippedPoint(point=point, reason="not run (quick strategy): predicted "
                     + (f"{rate:,.1f} samples/s" if rate is not None else "n/a"))
        for point, rate in zip(found.unrun, found.unrun_predicted_samples_per_s))
    note = (f"quick strategy ran {len(found.results)} of {found.num_grid_points} grid points "
            f"({found.fraction_run:.0%}); stopped because {found.stopped_because}")
    return not_run, note


def _placement(config: SweepConfig, device: str) -> tuple[int, int | None, int | None, list[str]]:
    """Stages that really run, torch threads per rank process, the most processes a point may have (GPUs:
    one rank each; None: no limit), and what the user should know. On the CPU every point's processes
    get the same threads, the cores over the most processes a point has (stages x the most replicas), so
    costs measured at one point are costs at another (calibration pools them)."""
    warnings: list[str] = []
    p, nodes = config.num_ranks, config.nodes.nnodes  # across nodes, each node holds its share of a point's ranks
    if device.startswith("cuda"):
        import torch

        gpus = torch.cuda.device_count() * nodes  # as many on every node as here
        if p > gpus:
            warnings.append(
                f"{p} stages need {p} GPUs (NCCL allows one rank per GPU) but {gpus} is visible: ran one rank "
                f"holding every stage on cuda:0 (micro-batching and accumulation are real; a {p}-GPU pipeline "
                "bubble is not measured; see the theoretical column)")
            p = 1
        return p, config.threads, gpus, warnings
    cores = os.cpu_count() or 1
    most = -(-p * max(config.data_parallel_size) // nodes)  # a node's share of the largest point
    if most > cores:
        replicas = f" x {max(config.data_parallel_size)} data-parallel replicas" if max(config.data_parallel_size) > 1 else ""
        where = f" per node ({nodes} nodes)" if nodes > 1 else ""
        warnings.append(f"{p} stages{replicas} ({most} processes{where}) on {cores} CPU cores oversubscribe the "
                        "machine: timings are distorted")
    return p, config.threads or max(1, cores // most), None, warnings


def _balance(config: SweepConfig, points: Sequence[SweepPoint], device: str, threads: int | None) -> Balance:
    """How the sweep splits blocks over stages; by time, the timing pass's figures (pipeline/balance.py) at
    the grid's median micro-batch size, measured once, before any point."""
    if config.balance != "time" or not points:
        return Balance(by=config.balance)
    from mbtune.pipeline.balance import measure_block_times

    sizes = sorted(p.micro_batch_size for p in points)
    size = sizes[(len(sizes) - 1) // 2]  # the lower median: a size the grid runs
    times = measure_block_times(config.workload, config.workload_options, micro_batch_size=size, device=device,
                                seed=config.seed, precision=config.precision, threads=threads,
                                timeout_s=config.point_timeout_s)
    return Balance(by="time", block_times_s=times, micro_batch_size=size)


class _Measuring:
    """One point's repeats in fresh processes, one at a time: config.repeats of them, or until its throughput
    is known (sweeping/stopping.py); `result` merges them. Until known, a repeat measured while other
    processes loaded the machine is run again (at most MAX_BUSY_RERUNS per point); a failed repeat fails the
    point; the repeats after the first measure enough steps to fill MIN_REPEAT_WINDOW_S each (at most
    MAX_STEPS); the time cap counts this point's own repeats, not the others' run between them."""

    def __init__(self, point: SweepPoint, config: SweepConfig, device: str, threads: int | None,
                 workload: WorkloadFacts, peak_total: float | None,
                 block_times_s: tuple[float, ...] | None = None) -> None:
        self.point, self.config, self.device, self.threads = point, config, device, threads
        self.workload, self.peak_total, self.block_times_s = workload, peak_total, block_times_s
        self.steps = config.measured_steps
        self.runs: list[PointResult] = []
        self.reruns, self.spent_s, self.stopped = 0, 0.0, ""
        self.round = 0  # the round-robin round the next repeat runs in (0: measured on its own)
        self.rounds: list[int] = []  # the round each kept repeat ran in

    def repeat(self) -> None:
        import time

        from mbtune.sweeping.stopping import FAILED, FIXED, MAX_BUSY_RERUNS, should_stop

        config, point = self.config, self.point
        started = time.monotonic()
        run = _run_point(point, replace(config, measured_steps=self.steps), self.device, self.threads,
                         self.workload, self.peak_total, self.block_times_s)
        self.spent_s += time.monotonic() - started
        # Until known only (fixed repeats run exactly as many as asked), and on one node (across nodes this
        # host's load is not the point's whole story): elsewhere a busy repeat keeps its warning.
        if (run.ok and run.load is not None and run.load.busy and self.reruns < MAX_BUSY_RERUNS
                and config.repeats is None and config.nodes.nnodes == 1):
            self.reruns += 1
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
            self.stopped = should_stop(self._rates(), target_width=config.target_ci, elapsed_s=self.spent_s,
                                       repeat_s=self.spent_s / (len(self.runs) + self.reruns),
                                       max_time_s=config.max_time_per_point_s) or ""

    def _rates(self) -> list[float]:
        return [self.point.global_batch / r.step_time_median_s for r in self.runs if r.step_time_median_s]

    def so_far(self) -> str:
        """The mean rate so far and its interval, for the progress line (empty before the first)."""
        from mbtune.sweeping.stopping import interval

        rates = self._rates()
        if not rates:
            return ""
        known = interval(rates, "")
        spread = f" +-{known.half:.1%}" if known else ""
        return f" (so far {sum(rates) / len(rates):,.1f} samples/s{spread})"

    def result(self) -> PointResult:
        from mbtune.sweeping.measured import merge_repeats

        rounds = tuple(self.rounds) if self.round else ()
        return replace(merge_repeats(self.runs), stopped=self.stopped, busy_reruns=self.reruns, repeat_rounds=rounds)


MIN_REPEAT_WINDOW_S = 0.5  # until known, a repeat measures at least this long (the first one calibrates)
MAX_STEPS = 50


def steps_to_fill(step_times_s: Sequence[float], steps: int) -> int:
    """Measured steps for a repeat to last MIN_REPEAT_WINDOW_S, from one repeat's step times; never fewer
    than `steps`, never more than MAX_STEPS."""
    window = sum(step_times_s)
    if window <= 0:
        return steps
    import math

    return max(steps, min(MAX_STEPS, math.ceil(len(step_times_s) * MIN_REPEAT_WINDOW_S / window)))


def _run_point(point: SweepPoint, config: SweepConfig, device: str, threads: int | None, workload: WorkloadFacts,
               peak_total: float | None, block_times_s: tuple[float, ...] | None = None) -> PointResult:
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
        else:
            outcome = run_pipeline_point(spec, timeout_s=config.point_timeout_s)
    result = summarize_point(point, outcome, tokens_per_sample=workload.tokens_per_sample,
                             flops_per_sample=workload.flops_per_sample, peak_flops_total=peak_total)
    window, uuids = outcome.measured_window_unix_s, outcome.device_uuids
    load = meter.load(rank_cpu_s=outcome.rank_cpu_time_s, our_pids=outcome.pids, num_ranks=spec.world_size,
                      gpu_pids=sampler.compute_pids(uuids, window) if gpus else None)
    warning = busy_warning(point.label, load)
    backend = "nccl" if spec.device == "cuda" else "gloo"
    ran_as = f"{spec.world_size} process(es), {backend}"
    if cores := outcome.pinned_cores:
        ran_as += ", pinned to cores " + " | ".join(",".join(map(str, c)) for c in cores)
    if config.launcher == "torchrun":
        ran_as += f", torchrun on {config.nodes.nnodes} node(s)" if config.nodes.nnodes > 1 else ", torchrun"
    if spec.data_parallel_size > 1:
        ran_as += f" ({spec.num_ranks} stages x {spec.data_parallel_size} replicas, gradients all-reduced)"
    return replace(result, nvml=sampler.summary(uuids, window), ran_as=ran_as, load=load,
                   warnings=result.warnings + ((warning,) if warning else ()))


def _result_detail(result: PointResult) -> str:
    if result.ok and result.samples_per_s:
        return f"{result.samples_per_s:,.1f} samples/s"
    return (result.error.strip().splitlines() or [""])[-1].strip()  # the cause, whole
