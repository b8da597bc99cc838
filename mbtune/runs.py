"""Library entry points: each turns a config into a typed record by wiring pure logic to real trials, and
the runs that save what they measure (probe, sweep, tune and qualify wrapped in a RunStore: lock, journal,
save; without a profiles folder nothing is written).

The CLI and the Python API (api.py) call exactly one of the run_* functions per command; tests call the
*_workload functions directly.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from mbtune.config import TRAIN, CheckConfig, ProbeConfig, QualifySpec, SweepConfig, TrialConfig, lr_for
from mbtune.errors import (
    EXIT_COULD_NOT_RUN,
    BudgetTooSmallError,
    ConfigError,
    DeviceError,
    Interrupted,
    MbtuneError,
    TrialFailedError,
    WorkloadBrokenError,
)
from mbtune.records import (
    ERROR,
    HARNESS_FAULT,
    OK,
    OOM,
    Balance,
    DeviceInfo,
    ProbeResult,
    Profile,
    RecomputeCeiling,
    SkippedPoint,
    SweepPoint,
    SweepReport,
    TrialOutcome,
    TrialResult,
)
from mbtune.serving.records import ServeReport
from mbtune.verdicts import ComparisonRow, Verdict

if TYPE_CHECKING:
    from mbtune.ceiling import SearchResult
    from mbtune.store import RunStore
    from mbtune.workloads.facts import WorkloadFacts

PROBE_TRIAL, SWEEP_POINT, BALANCE = "probe_trial", "sweep_point", "balance"
log = logging.getLogger(__name__)
REPLAYED = "replayed from the journal"

# Without a budget on CPU the real ceiling would be the machine's RAM and the kernel's OOM killer; cap
# trials below what is available instead.
DEFAULT_CPU_BUDGET_FRACTION = 0.8


class TrialProgress(Protocol):
    """What a long job reports while it runs (report/ implements it; None means silent)."""

    def set_total(self, total: int | None) -> None: ...

    def start_trial(self, description: str) -> None: ...

    def end_trial(self, status: str, detail: str = "") -> None: ...


def probe_workload(config: ProbeConfig, progress: TrialProgress | None = None,
                   store: RunStore | None = None, *,
                   on_trial: Callable[[TrialOutcome], None] | None = None) -> ProbeResult:
    """Find the memory ceiling and safe batch of a workload on a device with real, isolated trials.

    With a store, every finished trial is journaled, and trials journaled by an interrupted run are
    replayed in order instead of run again (the search is deterministic given its outcomes). `on_trial`
    sees each outcome as it comes (and may end the probe by raising)."""
    from mbtune.ceiling import search_ceiling
    from mbtune.device import resolve_device
    from mbtune.workloads.facts import workload_facts

    # Bad names and options fail here, before any trial; user code runs in a child under a deadline.
    workload = workload_facts(config.workload, config.workload_options, timeout_s=config.load_timeout_s)
    device = resolve_device(config.device)
    warnings = list(config.warnings())
    budget = _budget(config, device, warnings)
    search_budget = budget if budget is not None else describe(device, config.trial_timeout_s).total_memory_bytes
    trial_config = replace(config, memory_budget_bytes=budget)

    replay = deque(TrialOutcome.from_dict(r) for r in store.replayed(PROBE_TRIAL)) if store else deque()
    recompute = config.recompute[0]

    def run(batch_size: int) -> TrialOutcome:
        if progress:
            progress.start_trial(f"batch {batch_size}" + (f" (recompute {recompute})" if len(config.recompute) > 1
                                                          else ""))
        nonlocal workload
        if replay:
            outcome = replay.popleft()
            if outcome.batch_size != batch_size:
                raise ConfigError(f"the journal does not match this probe (it ran batch {outcome.batch_size} "
                                  f"where this run asks for {batch_size})", hint="Run without --resume.")
            workload = workload.with_counted_flops(outcome.flops_counted, tried=outcome.ok)
            if progress:
                progress.end_trial(outcome.status, REPLAYED)
            if on_trial:
                on_trial(outcome)
            return outcome
        log.debug("probe trial at batch %d on %s", batch_size, device)
        outcome = run_classified_trial(trial_config.trial(batch_size=batch_size, device=device, recompute=recompute,
                                                          count_flops=workload.needs_flops_count
                                                          and config.mode == TRAIN),
                                       config.trial_timeout_s)
        log.info("batch %d: %s in %.1f s", batch_size, outcome.status, outcome.wall_s)
        workload = workload.with_counted_flops(outcome.flops_counted, tried=outcome.ok)
        if store:
            store.record(PROBE_TRIAL, outcome.to_dict())
        if progress:
            progress.end_trial(outcome.status, _trial_detail(outcome))
        if on_trial:
            on_trial(outcome)
        return outcome

    def search() -> SearchResult:
        return search_ceiling(run, granularity=config.granularity, max_batch=config.max_batch,
                              budget_bytes=search_budget, margin=config.margin, confirm=config.confirm,
                              resolution=config.resolution)

    found = search()
    others = []
    for recompute in config.recompute[1:]:  # the run above reads it: one search per mode, in order
        other = search()
        others.append(RecomputeCeiling(
            recompute=recompute, ceiling=other.ceiling, first_failing=other.first_failing,
            safe_batch=other.safe_batch, safe_batch_verified=other.safe_batch_verified, trials=len(other.trials),
            peak_memory_bytes=_peak_at(other.trials, other.ceiling)))
        warnings += [f"recompute {recompute}: {w}" for w in other.warnings]
    warnings += workload.warnings  # with the FLOPs count's, made in the first trial for a user's workload
    return ProbeResult(
        workload=config.workload, workload_options=dict(config.workload_options),
        device=_device_info(found.trials, device, config.trial_timeout_s), trials=found.trials,
        ceiling=found.ceiling, first_failing=found.first_failing, margin=config.margin,
        granularity=config.granularity, safe_batch=found.safe_batch,
        safe_batch_verified=found.safe_batch_verified, memory_budget_bytes=budget,
        memory_model=found.memory_model, precision=config.precision, optimizer=config.optimizer,
        num_parameters=workload.num_parameters, flops_per_sample=workload.flops_per_sample,
        max_batch=config.max_batch, confirm=config.confirm, steps=config.steps, resolution=found.resolution,
        safe_batch_first=found.safe_batch_first, warnings=tuple(warnings) + found.warnings,
        recompute=config.recompute[0], recompute_ceilings=tuple(others), mode=config.mode,
    )


def _peak_at(trials: Sequence[TrialOutcome], batch_size: int) -> int | None:
    """The highest peak memory of the trials that ran at this batch size."""
    peaks = [t.peak_memory_bytes for t in trials if t.ok and t.batch_size == batch_size and t.peak_memory_bytes]
    return max(peaks) if peaks else None


# When a trial under a memory cap fails with an error that is not a recognised OOM, it is run once more
# with this much more room: if it then runs (or fails for memory), the first failure was memory too.
# Under a tight cap the allocation can fail deep inside a library (oneDNN's "could not create a
# primitive", OpenMP's thread creation) with no allocator message to recognise.
RECHECK_BUDGET_FACTOR = 2


def run_classified_trial(trial: TrialConfig, timeout_s: float) -> TrialOutcome:
    """run_trial, with errors under a memory cap re-checked with more room before they count as errors."""
    from mbtune.worker import run_trial

    outcome = run_trial(trial, timeout_s=timeout_s)
    if outcome.status != ERROR or trial.memory_budget_bytes is None or outcome.error_kind == HARNESS_FAULT:
        return outcome
    roomier = replace(trial, memory_budget_bytes=trial.memory_budget_bytes * RECHECK_BUDGET_FACTOR + 64 * 2**20)
    recheck = run_trial(roomier, timeout_s=timeout_s)
    if recheck.status not in (OK, OOM):
        return outcome
    return replace(outcome, status=OOM, error=f"{outcome.error} [out of memory: the same trial "
                   f"{'ran' if recheck.ok else 'ran out of memory'} with {RECHECK_BUDGET_FACTOR}x the budget]")


def _budget(config: ProbeConfig, device: str, warnings: list[str]) -> int | None:
    """The trial budget: as given; on CPU without one, a share of the memory available now."""
    from mbtune.device.cpu import available_memory_bytes

    if config.memory_budget_bytes is not None or device != "cpu":
        return config.memory_budget_bytes
    budget = int(available_memory_bytes() * DEFAULT_CPU_BUDGET_FRACTION)
    warnings.append(f"no --memory-budget on CPU: trials are capped at {budget / 2**30:.1f} GiB "
                    f"({DEFAULT_CPU_BUDGET_FRACTION:.0%} of available memory)")
    return budget


def _trial_detail(outcome: TrialOutcome) -> str:
    if outcome.ok and outcome.samples_per_s:
        return f"{outcome.samples_per_s:,.1f} samples/s"
    return (outcome.error.strip().splitlines() or [""])[-1][:80]


def _device_info(trials: tuple[TrialOutcome, ...], device: str, timeout_s: float) -> DeviceInfo:
    for trial in trials:
        if trial.device is not None:
            return trial.device
    return describe(device, timeout_s)


def describe(device: str, timeout_s: float = 120.0) -> DeviceInfo:
    """DeviceInfo of a resolved device. A GPU is read in a fresh process, so this process never
    initialises CUDA; the CPU is read here (nothing to initialise, and no trial process to wait for)."""
    from mbtune.trial import describe_device
    from mbtune.worker import run_isolated

    if device == "cpu":
        from mbtune.device.cpu import CpuBackend

        return CpuBackend().info()
    result = run_isolated(describe_device, device, timeout_s=timeout_s)
    if result.status != OK:
        raise TrialFailedError(f"could not read the facts of device {device}: {result.error}")
    return result.value


def sweep_workload(config: SweepConfig, progress: TrialProgress | None = None,
                   store: RunStore | None = None) -> SweepReport:
    """Run the sweep grid as real pipelines, one fresh process per stage, and rank what they measured.

    Ctrl-C (Interrupted) starts nothing new: the report keeps every finished point, marked interrupted.
    With a store, every finished point is journaled and points journaled earlier are not run again.
    """
    from mbtune.device import resolve_device
    from mbtune.device.peak_flops import peak_flops
    from mbtune.grid import plan_grid
    from mbtune.workloads.facts import workload_facts

    workload = workload_facts(config.workload, config.workload_options, timeout_s=config.load_timeout_s)
    device = resolve_device(config.device)
    info = describe(device)
    log.info("sweep of %s (%d blocks) on %s", config.workload, workload.num_blocks, info.name)
    num_stages, threads, max_processes, warnings = _placement(config, device)
    warnings += workload.warnings
    if config.measured_steps * config.repeats < 2:
        warnings.append("one measured step per point (--steps 1, --repeats 1) states no spread: each range is "
                        "that one step; measure --steps 2 or more")
    config = _with_saved_limits(config, info, warnings)
    grid = plan_grid(config, num_blocks=workload.num_blocks, num_stages=num_stages, max_processes=max_processes,
                     nnodes=config.nnodes)
    # A resumed sweep keeps the split its journaled points ran with.
    replayed = [Balance.from_dict(b) for b in store.replayed(BALANCE)] if store else []
    balance = replayed[0] if replayed else _balance(config, grid.points, device, threads)
    if store and not replayed:
        store.record(BALANCE, balance.to_dict())
    peak = peak_flops(info.name, config.precision)
    results: list[TrialResult] = []
    done = {r.point: r for r in map(TrialResult.from_dict, store.replayed(SWEEP_POINT))} if store else {}
    if progress:
        progress.set_total(len(grid.points))

    def run_one(point: SweepPoint) -> TrialResult:
        nonlocal workload
        if progress:
            progress.start_trial(point.label)
        result, detail = done.get(point), REPLAYED
        if result is None:
            result = _run_repeats(point, config, device, threads, workload, peak * point.num_processes if peak else None,
                                  balance.block_times_s or None)
            detail = _result_detail(result)
            if store:
                store.record(SWEEP_POINT, result.to_dict())
        workload = workload.with_counted_flops(result.flops_counted, tried=result.ok)  # counted in its first point
        results.append(result)
        if progress:
            progress.end_trial(result.status, detail)
        return result

    interrupted, note = False, ""
    not_run: tuple[SkippedPoint, ...] = ()
    try:
        if config.strategy == "quick":
            not_run, note = _quick(grid.points, run_one, config, balance.block_times_s)
        else:
            for point in grid.points:
                run_one(point)
    except (Interrupted, KeyboardInterrupt):  # Ctrl-C on the command line, or in a notebook
        interrupted = True
    finally:
        if config.launcher == "torchrun" and config.nnodes == 1:  # across nodes, the command ends the session
            from mbtune.pipeline.torchrun import close_session

            close_session(config.nodes, 0)
    warnings += [w for w in workload.warnings if w not in warnings]  # the FLOPs count's, from the first point
    report = _sweep_report(config, info, results, grid.skipped + not_run, len(grid.points), interrupted,
                           warnings, (note,) if note else ())
    return replace(report, balance=balance)


def _sweep_report(config: SweepConfig, info: DeviceInfo, results: list[TrialResult],
                  skipped: tuple[SkippedPoint, ...], num_grid_points: int, interrupted: bool,
                  warnings: list[str], notes: tuple[str, ...]) -> SweepReport:
    from mbtune.grid import rank_results, recompute_pairs, tied_with_best, tradeoff
    from mbtune.lr import lr_advice

    fixed = config.global_batches
    ranking, pareto = rank_results(results, config.objective, fixed)
    rows, padding = tradeoff(results, ranking)
    advice = lr_advice(config.optimizer, (r.point.global_batch for r in results if r.ok), lr=config.lr,
                       reference_batch=config.reference_batch)
    return SweepReport(
        workload=config.workload, workload_options=dict(config.workload_options), device=info,
        objective=config.objective, results=tuple(results), skipped=skipped, ranking=ranking, pareto=pareto,
        ties=tied_with_best(results, ranking, config.objective, same_global_batch=bool(fixed)),
        global_batches=fixed, global_batch_default=config.global_batch is None and bool(fixed),
        tradeoff=rows, padding=padding or (), recompute_pairs=recompute_pairs(results),
        repeats=config.repeats, strategy=config.strategy,
        num_grid_points=num_grid_points, ceiling=config.ceiling,
        safe_batch=config.safe_batch, ceiling_peak_memory_bytes=config.ceiling_peak_memory_bytes,
        warmup_steps=config.warmup_steps, measured_steps=config.measured_steps, interrupted=interrupted,
        warnings=tuple(warnings), notes=notes, lr_advice=advice,
    )


def _quick(points: tuple[SweepPoint, ...], run_one: Callable[[SweepPoint], TrialResult],
           config: SweepConfig, block_times_s: tuple[float, ...] = ()) -> tuple[tuple[SkippedPoint, ...], str]:
    """The quick strategy: the simulator, calibrated on a few points, picks what to run next."""
    from mbtune.planning.api import quick_sweep

    found = quick_sweep(points, run_one, workload=config.workload, workload_options=config.workload_options,
                        optimizer=config.optimizer, block_times_s=block_times_s)
    not_run = tuple(
        SkippedPoint(point=point, reason="not run (quick strategy): predicted "
                     + (f"{rate:,.1f} samples/s" if rate is not None else "n/a"))
        for point, rate in zip(found.unrun, found.unrun_predicted_samples_per_s))
    note = (f"quick strategy ran {len(found.results)} of {found.num_grid_points} grid points "
            f"({found.fraction_run:.0%}); stopped because {found.stopped_because}")
    return not_run, note


def _with_saved_limits(config: SweepConfig, info: DeviceInfo, warnings: list[str]) -> SweepConfig:
    """Without a safe batch, take the one probed earlier for this device and workload, if saved."""
    from mbtune.errors import ProfileError
    from mbtune.profiles import load_profile, profile_path

    if config.from_profile is not None:
        return replace(config, **limits_from_profile(config.from_profile, config))
    if config.safe_batch is not None or config.profiles_dir is None:
        return config
    path = profile_path(config.profiles_dir, info, config.workload)
    if not path.exists():
        return config
    try:
        probe = load_profile(path).probe
    except ProfileError as exc:
        warnings.append(f"ignored the saved probe: {exc.one_line()}")
        return config
    if probe is None or dict(config.workload_options) != probe.workload_options:
        return config
    warnings.append(f"micro-batch sizes are bounded by the safe batch {probe.safe_batch} probed in {path}")
    return replace(config, **sweep_limits(probe))


def _placement(config: SweepConfig, device: str) -> tuple[int, int | None, int | None, list[str]]:
    """Stages that really run, torch threads per rank process, the most processes a point may have (GPUs:
    one rank each; None: no limit), and what the user should know. On the CPU every point's processes
    get the same threads, the cores over the most processes a point has (stages x the most replicas), so
    costs measured at one point are costs at another (calibration pools them)."""
    warnings: list[str] = []
    p, nodes = config.num_stages, config.nnodes  # across nodes, each node holds its share of a point's ranks
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
    most = -(-p * max(config.data_parallel) // nodes)  # a node's share of the largest point
    if most > cores:
        replicas = f" x {max(config.data_parallel)} data-parallel replicas" if max(config.data_parallel) > 1 else ""
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


def _run_repeats(point: SweepPoint, config: SweepConfig, device: str, threads: int | None, workload: WorkloadFacts,
                 peak_total: float | None, block_times_s: tuple[float, ...] | None = None) -> TrialResult:
    """The point run config.repeats times, each in fresh processes, merged (stopping at a failed one)."""
    from mbtune.grid import merge_repeats

    runs: list[TrialResult] = []
    while len(runs) < config.repeats and (not runs or runs[-1].ok):
        runs.append(_run_point(point, config, device, threads, workload, peak_total, block_times_s))
        workload = workload.with_counted_flops(runs[-1].flops_counted, tried=runs[-1].ok)
    return replace(merge_repeats(runs), flops_counted=next((r.flops_counted for r in runs if r.flops_counted), None))


def _run_point(point: SweepPoint, config: SweepConfig, device: str, threads: int | None, workload: WorkloadFacts,
               peak_total: float | None, block_times_s: tuple[float, ...] | None = None) -> TrialResult:
    from mbtune.device.load import LoadMeter, busy_warning
    from mbtune.device.nvml import NvmlSampler
    from mbtune.grid import summarize_point
    from mbtune.pipeline import PipelineSpec, run_pipeline_point

    spec = PipelineSpec(
        workload=config.workload, workload_options=config.workload_options, schedule=point.schedule,
        num_ranks=point.num_stages, data_parallel=point.data_parallel_size, recompute=point.recompute,
        virtual_stages=point.virtual_stages if point.virtual_stages > 1 else None,
        num_microbatches=point.num_microbatches, micro_batch_size=point.micro_batch_size,
        grad_accum_steps=point.grad_accum_steps, warmup_steps=config.warmup_steps,
        measured_steps=config.measured_steps, seed=config.seed, device="cuda" if device.startswith("cuda") else "cpu",
        optimizer=config.optimizer, learning_rate=lr_for(config.optimizer, config.lr), precision=config.precision,
        threads=threads, balance="time" if block_times_s else "parameters", block_weights=block_times_s,
        count_flops=workload.needs_flops_count,
    )
    # Rank r runs on CUDA device r; only those GPUs are sampled, and only the samples of the measured steps
    # are summarised (the ranks report when those ran).
    gpus = range(spec.world_size) if spec.device == "cuda" else ()
    with NvmlSampler(cuda_indices=gpus) as sampler, LoadMeter() as meter:
        if config.launcher == "torchrun":
            from mbtune.pipeline.torchrun import session

            outcome = session(config.nodes, config.command_line).run_point(spec, timeout_s=config.point_timeout_s)
        else:
            outcome = run_pipeline_point(spec, timeout_s=config.point_timeout_s)
    workload = workload.with_counted_flops(outcome.flops_counted, tried=outcome.ok)
    result = summarize_point(point, outcome, tokens_per_sample=workload.tokens_per_sample,
                             flops_per_sample=workload.flops_per_sample, peak_flops_total=peak_total)
    window, uuids = outcome.measured_window_unix_s, outcome.device_uuids
    load = meter.load(rank_cpu_s=outcome.rank_cpu_time_s, our_pids=outcome.pids, num_ranks=spec.world_size,
                      gpu_pids=sampler.compute_pids(uuids, window) if gpus else None)
    warning = busy_warning(point.label, load)
    backend = "nccl" if spec.device == "cuda" else "gloo"
    ran_as = f"{spec.world_size} process(es), {backend}"
    if config.launcher == "torchrun":
        ran_as += f", torchrun on {config.nnodes} node(s)" if config.nnodes > 1 else ", torchrun"
    if spec.data_parallel > 1:
        ran_as += f" ({spec.num_ranks} stages x {spec.data_parallel} replicas, gradients all-reduced)"
    return replace(result, nvml=sampler.summary(uuids, window), ran_as=ran_as, load=load,
                   warnings=result.warnings + ((warning,) if warning else ()), flops_counted=outcome.flops_counted)


def _result_detail(result: TrialResult) -> str:
    if result.ok and result.samples_per_s:
        return f"{result.samples_per_s:,.1f} samples/s"
    return (result.error.strip().splitlines() or [""])[-1][:80]


class SweepLimits(TypedDict):
    """The SweepConfig fields a probe sets."""

    safe_batch: int | None
    ceiling: int | None
    ceiling_peak_memory_bytes: int | None
    recompute_safe_batch: int | None


def sweep_limits(probe: ProbeResult) -> SweepLimits:
    """What a sweep takes from a probe: the safe batch, the ceiling and the peak memory at the ceiling."""
    plain, full = probe.ceiling_with("none"), probe.ceiling_with("full")
    return {"safe_batch": plain.safe_batch if plain else None, "ceiling": plain.ceiling if plain else None,
            "ceiling_peak_memory_bytes": plain.peak_memory_bytes if plain else None,
            "recompute_safe_batch": full.safe_batch if full is not None else None}


def tune_workload(probe_config: ProbeConfig, sweep_config: SweepConfig, progress: TrialProgress | None = None,
                  store: RunStore | None = None, *, check: bool = True) -> tuple[ProbeResult, SweepReport]:
    """Probe, then sweep around the probed safe batch, then (with `check`) check the best row's update
    against the plain model's."""
    probe = probe_workload(probe_config, progress, store)
    sweep_config = replace(sweep_config, **sweep_limits(probe))
    sweep = sweep_workload(sweep_config, progress, store)
    if check and sweep.best is not None and not sweep.interrupted:
        sweep = _checked(sweep, sweep_config, progress)
    return probe, sweep


def _checked(sweep: SweepReport, config: SweepConfig, progress: TrialProgress | None) -> SweepReport:
    """The sweep with its best row checked (check.py); a check that cannot run says why, and Ctrl-C during
    it keeps the sweep (as interrupted)."""
    from mbtune.check import check_update

    assert sweep.best is not None
    point = sweep.best.point
    if progress:
        progress.start_trial(f"check {point.label}")
    try:
        run_point = None
        if config.launcher == "torchrun":  # the best row ran across these nodes: its check does too
            from mbtune.pipeline.torchrun import session

            run_point = session(config.nodes, config.command_line).run_point
        result = check_update(CheckConfig.for_point(
            point, workload=config.workload, workload_options=config.workload_options, device=config.device,
            precision=config.precision, optimizer=config.optimizer, lr=config.lr, seed=config.seed,
            timeout_s=config.point_timeout_s, load_timeout_s=config.load_timeout_s), run_point)
    except (Interrupted, KeyboardInterrupt):
        return replace(sweep, interrupted=True, check_error="interrupted")
    except MbtuneError as exc:
        if progress:
            progress.end_trial(ERROR, exc.one_line())
        return replace(sweep, check_error=exc.one_line())
    finally:
        if config.launcher == "torchrun" and config.nnodes == 1:
            from mbtune.pipeline.torchrun import close_session

            close_session(config.nodes, 0)
    if progress:
        progress.end_trial(OK if result.status == "PASS" else ERROR, f"check {result.status}")
    return replace(sweep, check=result)


def limits_from_profile(path: str, config: SweepConfig) -> SweepLimits:
    """sweep_limits of the probe saved in a profile: an error when it holds no probe, or a probe of another
    workload, other workload options or another precision than this sweep's."""
    from mbtune.errors import ProfileError
    from mbtune.profiles import load_profile

    probe = load_profile(path).probe
    if probe is None:
        raise ProfileError(f"profile {path} holds no probe", hint="Run mbtune probe first, or use mbtune tune.")
    ours = (config.workload, dict(config.workload_options), config.precision)
    theirs = (probe.workload, dict(probe.workload_options), probe.precision)
    for what, mine, saved in zip(("workload", "workload options", "precision"), ours, theirs):
        if mine != saved:
            raise ProfileError(f"--from-profile {path} probed {what} {saved!r}, this sweep runs {mine!r}",
                               hint="Give the profile of the same workload, options and precision.")
    return sweep_limits(probe)


# Errors that are bad input for probe and sweep but, for a qualification, mean this machine could not run
# what it is held to (no such device here, a budget or workload that fails here): an ERROR check.
_RUN_FAILURES = (DeviceError, BudgetTooSmallError, WorkloadBrokenError)

# Fields that say where and how to write, not what to measure: a resumed run may change them.
# Settings that change where or how patiently a run happens, not what it measures: a resumed run may change
# them (a rescheduled multi-node job gets a new endpoint and node numbers).
_NOT_MEASUREMENT = {"command_line", "profiles_dir", "extra_warnings", "trial_timeout_s", "point_timeout_s", "reference_batch",
                    "load_timeout_s", "rdzv_endpoint", "node_rank", "join_timeout_s"}


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """What a saved run produced."""

    probe: ProbeResult | None = None
    sweep: SweepReport | None = None
    serve: ServeReport | None = None
    saved_to: Path | None = None
    notes: tuple[str, ...] = ()

    @property
    def interrupted(self) -> bool:
        return any(part is not None and part.interrupted for part in (self.sweep, self.serve))


def run_probe(config: ProbeConfig, progress: TrialProgress | None = None, *, profiles_dir: Path | None,
              resume: bool = False) -> RunOutcome:
    """probe_workload, journaled and saved to its profile."""
    return _saved_run("probe", {"probe": config}, config.workload, config.device, profiles_dir, resume,
                      config.command_line, lambda store: (probe_workload(config, progress, store), None))


def run_sweep(config: SweepConfig, progress: TrialProgress | None = None, *, profiles_dir: Path | None,
              resume: bool = False) -> RunOutcome:
    """sweep_workload, journaled and saved to its profile (next to the probe already there)."""
    if config.from_profile is not None:
        limits_from_profile(config.from_profile, config)  # a wrong profile is bad input, before any file
    return _saved_run("sweep", {"sweep": config}, config.workload, config.device, profiles_dir, resume,
                      config.command_line, lambda store: (None, sweep_workload(config, progress, store)))


def run_tune(probe_config: ProbeConfig, sweep_config: SweepConfig, progress: TrialProgress | None = None, *,
             profiles_dir: Path | None, resume: bool = False, check: bool = True) -> RunOutcome:
    """tune_workload, journaled and saved: the probe and the sweep into one profile."""
    return _saved_run("tune", {"probe": probe_config, "sweep": sweep_config}, probe_config.workload,
                      probe_config.device, profiles_dir, resume, probe_config.command_line,
                      lambda store: tune_workload(probe_config, sweep_config, progress, store, check=check))


def _saved_run(kind: str, configs: dict[str, Any], workload: str, device: str, profiles_dir: Path | None,
               resume: bool, command_line: str, body: Any) -> RunOutcome:
    """Run `body(store)` -> (probe, sweep) or (probe, sweep, serve) under a RunStore, and save what it
    returns into the profile (without a profiles folder: no store, nothing written)."""
    from mbtune.device import resolve_device
    from mbtune.store import RunStore
    from mbtune.workloads.facts import workload_facts

    if profiles_dir is None:
        return RunOutcome(**_sections(body(None)))
    first = next(iter(configs.values()))
    workload_facts(workload, first.workload_options, timeout_s=first.load_timeout_s)  # bad input fails before any file
    resolved = resolve_device(device)
    if "probe" in configs:  # settings the resolved device cannot run (fp16 on CPU) fail before any file
        configs["probe"].trial(batch_size=configs["probe"].granularity, device=resolved)
    info = describe(resolved)
    with RunStore(profiles_dir, info, workload, kind=kind, config=_comparable(configs), resume=resume) as store:
        sections = _sections(body(store))
        saved = store.save(command_line=command_line, **sections)
        outcome = RunOutcome(**sections, saved_to=saved, notes=tuple(store.notes))
        if not outcome.interrupted:
            store.finish()
        return outcome


def _sections(parts: tuple) -> dict[str, Any]:
    return dict(zip(("probe", "sweep", "serve"), parts, strict=False))


def _comparable(configs: dict[str, Any]) -> dict[str, Any]:
    """The measurement settings of each config, as JSON would return them."""
    plain = {name: {k: v for k, v in dataclasses.asdict(c).items() if k not in _NOT_MEASUREMENT}
             for name, c in configs.items()}
    return json.loads(json.dumps(plain))


def compare_files(a: Path, b: Path, *, allow_different_device: bool = False,
                  allow_different_workload: bool = False) -> tuple[ComparisonRow, ...]:
    """Two saved profiles side by side (ratios B / A), refused where they differ in device model, or in
    workload, options, precision or optimizer, unless allowed."""
    from mbtune.profiles import load_profile
    from mbtune.qualify import check_same_device, check_same_workload, compare_profiles, device_model

    first, second = load_profile(a), load_profile(b)
    check_same_device(device_model(first), device_model(second), allow=allow_different_device, what="the profiles")
    check_same_workload(first, second, allow=allow_different_workload)
    return compare_profiles(first, second)


def check_config_from_profile(path: Path, rank: int, **settings: Any) -> CheckConfig:
    """The CheckConfig of the rank-th row (1: the best) of a saved profile's sweep, on its workload, options,
    precision and optimizer (the probe's, where it saved them); `settings` give the rest."""
    from mbtune.profiles import load_profile

    profile = load_profile(path)
    sweep = profile.sweep
    if sweep is None or not sweep.ranking:
        raise ConfigError(f"{path} holds no ranked sweep rows to check",
                          hint="Run mbtune sweep or tune first, or pass the configuration's flags instead of --from.")
    if not 1 <= rank <= len(sweep.ranking):
        raise ConfigError(f"--rank {rank} is out of range: {path} ranks {len(sweep.ranking)} row(s)",
                          hint=f"Use --rank 1 to {len(sweep.ranking)}.")
    point = sweep.results[sweep.ranking[rank - 1]].point
    probe = profile.probe
    return CheckConfig.for_point(point, workload=sweep.workload,
                                 workload_options=tuple(sorted(sweep.workload_options.items())),
                                 precision=probe.precision if probe else "fp32",
                                 optimizer=probe.optimizer if probe else "adamw", **settings)


def run_qualify(spec: QualifySpec, progress: TrialProgress | None = None, *,
                profiles_dir: Path | None, repeats: int | None = None,
                launch: dict[str, Any] | None = None) -> Verdict:
    """Re-run a baseline's (or a spec's) probe and sweep here and judge them: PASS, FAIL, INCONCLUSIVE or
    ERROR per check (see mbtune.qualify). Each sweep point runs `repeats` times (default 3), each in fresh
    processes.

    Bad input (an unreadable baseline, another device model) raises; a run that cannot complete (no
    device, a crash, a trial killed) becomes an ERROR check, so CI gets a verdict either way. `launch`:
    the SweepConfig launcher fields (--launcher torchrun and its nodes) the sweep runs with."""
    from mbtune import qualify
    from mbtune.device import resolve_device
    from mbtune.profiles import load_profile

    repeats = qualify.DEFAULT_REPEATS if repeats is None else repeats
    if repeats < 1:
        raise ConfigError(f"repeats={repeats} is out of range", hint="Use --repeats 1 or more (default 3).")
    baseline = load_profile(Path(spec.baseline)) if spec.baseline else None
    probe_config, sweep_config = _qualify_configs(spec, baseline, repeats)
    if sweep_config is not None and launch:
        sweep_config = dataclasses.replace(sweep_config, **launch)
    probe = sweep = info = None
    probe_error = None
    try:
        info = describe(resolve_device(probe_config.device if probe_config else _serve_device(spec)))
        qualify.check_same_device(qualify.device_model(baseline) if baseline else None,
                                  f"{info.backend}: {info.name}", allow=spec.allow_different_device,
                                  what="the baseline and this machine")
        if probe_config is None:
            pass  # a serving spec alone
        elif sweep_config is None:
            probe = run_probe(probe_config, progress, profiles_dir=profiles_dir).probe
        else:
            outcome = run_tune(probe_config, sweep_config, progress, profiles_dir=profiles_dir)
            probe, sweep = outcome.probe, outcome.sweep
    except MbtuneError as exc:
        if not (isinstance(exc, _RUN_FAILURES) or exc.exit_code == EXIT_COULD_NOT_RUN):
            raise
        probe_error = exc.one_line()
    serve, serve_error = None, None
    if spec.serve is not None:
        serve, serve_error = _qualify_serve(spec, progress, profiles_dir) if info else (None, probe_error)
    checks = qualify.run_errors(probe_error, sweep)
    if baseline is not None:
        checks += qualify.against_baseline(baseline.probe, baseline.sweep, probe, sweep, tolerance=spec.tolerance)
    checks += qualify.against_thresholds(dict(spec.thresholds), probe, sweep)
    checks += qualify.serve_thresholds(dict(spec.thresholds), serve, serve_error)
    return Verdict(checks=tuple(checks), device=info, baseline=spec.baseline,
                   baseline_device=qualify.device_model(baseline) if baseline else None, tolerance=spec.tolerance,
                   repeats=repeats if sweep_config is not None else None, probe=probe, sweep=sweep)


def _serve_device(spec: QualifySpec) -> str:
    assert spec.serve is not None, "a spec with neither a probe nor a baseline has a serve section"
    return spec.serve.device


def _qualify_serve(spec: QualifySpec, progress: TrialProgress | None,
                   profiles_dir: Path | None) -> tuple[ServeReport | None, str | None]:
    """The spec's serving run, or why it could not complete (an ERROR check, as a probe's would be)."""
    from mbtune.serving.run import run_serve

    assert spec.serve is not None
    try:
        return run_serve(spec.serve, progress, profiles_dir=profiles_dir).serve, None
    except MbtuneError as exc:
        if not (isinstance(exc, _RUN_FAILURES) or exc.exit_code == EXIT_COULD_NOT_RUN):
            raise
        return None, exc.one_line()


def _qualify_configs(spec: QualifySpec, baseline: Profile | None,
                     repeats: int) -> tuple[ProbeConfig | None, SweepConfig | None]:
    """The spec's own configs, or the ones that reproduce what the baseline measured; sweeps run each
    point `repeats` times. A serving spec alone has neither."""
    from mbtune.errors import ProfileError

    if spec.probe is None and baseline is None:
        return None, None
    if spec.probe is not None:
        return spec.probe, dataclasses.replace(spec.sweep, repeats=repeats) if spec.sweep else None
    if baseline is None or baseline.probe is None:
        raise ProfileError(f"baseline {spec.baseline} holds no probe to re-run",
                           hint="Qualify against a profile written by mbtune probe or tune.")
    was = baseline.probe
    probe = ProbeConfig(workload=was.workload, workload_options=tuple(sorted(was.workload_options.items())),
                        device=was.device.label if was.device.backend == "cuda" else "cpu",
                        memory_budget_bytes=was.memory_budget_bytes, margin=was.margin, granularity=was.granularity,
                        precision=was.precision, optimizer=was.optimizer, max_batch=was.max_batch,
                        confirm=was.confirm, resolution=was.resolution, steps=was.steps,
                        recompute=(was.recompute, *(c.recompute for c in was.recompute_ceilings)),
                        command_line=baseline.metadata.command_line)
    if baseline.sweep is None:
        return probe, None
    points = tuple(r.point for r in baseline.sweep.results if r.ok)
    sweep = SweepConfig(workload=was.workload, workload_options=probe.workload_options, device=probe.device,
                        num_stages=max(p.num_stages for p in points) if points else 1, points=points,
                        objective=baseline.sweep.objective, warmup_steps=baseline.sweep.warmup_steps,
                        measured_steps=baseline.sweep.measured_steps, repeats=repeats,
                        balance=baseline.sweep.balance.by)
    return probe, sweep
