"""The sweep run: placement of ranks on the machine, the timing pass, each point's repeats in fresh
processes, and the report; each point journaled where a journal is given (session.run_sweep keeps one)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mbtune.device.describe import describe
from mbtune.device.machine_state import StateSampler, run_versions
from mbtune.errors import (
    Interrupted,
)
from mbtune.journal import REPLAYED
from mbtune.pipeline.point import SweepPoint
from mbtune.progress import TrialProgress
from mbtune.records import DeviceInfo
from mbtune.sweeping.answer import sweep_report
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.records import Balance, PointResult, PredictedPoint, SkippedPoint, SweepReport
from mbtune.sweeping.repeat import LoadStreak
from mbtune.sweeping.stopping import INTERRUPTED

if TYPE_CHECKING:
    from mbtune.journal import Journal
    from mbtune.pipeline.warm import WarmRanks
    from mbtune.sweeping.race import Verdict
    from mbtune.sweeping.repeat import Measuring
    from mbtune.sweeping.screen import Predictor
    from mbtune.workloads.facts import WorkloadFacts

log = logging.getLogger(__name__)
# The planner's quick search (planning.api.quick_sweep): (points, run_point, *, workload, ...) -> its result.
QuickSweep = Callable[..., Any]
# The planner's predictor for a raced grid (planning.api.grid_predictor): (*, workload, workload_options, optimizer,
# block_times_s) -> a sweeping.screen.Predictor.
GridPredictor = Callable[..., Any]
SWEEP_POINT, BALANCE = "sweep_point", "balance"  # journal kinds: a point's result, the blocks' split


def sweep_workload(config: SweepConfig, progress: TrialProgress | None = None,
                   store: Journal | None = None, *, quick: QuickSweep | None = None,
                   predictor: GridPredictor | None = None) -> SweepReport:
    """Run the sweep grid as real pipelines, one fresh process per stage, and rank what they measured.

    Ctrl-C (Interrupted) starts nothing new: the report keeps every finished point, marked interrupted.
    With a store, every finished point is journaled and points journaled earlier are not run again. The
    quick strategy needs `quick`, the planner's search (planning.api.quick_sweep, which session.run_sweep
    passes): the planner calibrates on sweeps, so the sweep is handed it rather than importing it. A raced
    grid is screened (sweeping/screen.py) where `predictor` (planning.api.grid_predictor) is given.
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
    points.predictor = predictor
    interrupted, note = False, ""
    not_run: tuple[SkippedPoint, ...] = ()
    sampler = StateSampler(gpus=device.startswith("cuda"), versions=run_versions())
    try:
        sampler.__enter__()
        if config.strategy == "quick":
            assert quick is not None, "the quick strategy needs the planner's search"
            not_run, note = _quick(quick, grid.points, points.run, config, points.balance.block_times_s)
        else:
            points.run_all(grid.points)
    except (Interrupted, KeyboardInterrupt):  # Ctrl-C on the command line, or in a notebook
        interrupted = True
        points.keep_unfinished()
    finally:
        sampler.__exit__(None, None, None)
        if points.ranks is not None:
            points.ranks.close()
        if config.launcher == "torchrun" and config.nodes.nnodes == 1:  # across nodes, the command ends the session
            from mbtune.pipeline.torchrun import close_session

            close_session(config.nodes, 0)
    report = sweep_report(config, info, points.results, grid.skipped + not_run + tuple(points.unmeasured),
                           len(grid.points), interrupted,
                           warnings, tuple(n for n in (note, points.screen_note) if n), points.stopped_by)
    return replace(report, balance=points.balance, predicted=tuple(points.predicted.values()),
                   machine_state=sampler.state())


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
        # mbtune's own launcher keeps a point's rank processes for the next repeat and point (pipeline/warm.py);
        # torchrun's agent and a user's command start their own.
        self.ranks: WarmRanks | None = None
        if config.launcher == "local" and not config.command and not config.fresh_processes:
            from mbtune.pipeline.warm import WarmRanks

            self.ranks = WarmRanks()
        self.results: list[PointResult] = []
        self.order: dict[SweepPoint, int] = {}
        self.unfinished: dict[SweepPoint, Measuring] = {}
        self.standing = ""  # the race's first look, once a round has ended
        self.unmeasured: list[SkippedPoint] = []  # points the time budget stopped before a repeat could be kept
        self.predictor: GridPredictor | None = None  # the planner's, where a raced grid is screened
        self.predict: Predictor | None = None  # what it gave for this sweep's workload
        self.waiting: dict[SweepPoint, Measuring] = {}  # not measured yet, until the first points predict them
        self.predicted: dict[SweepPoint, PredictedPoint] = {}  # left out of the race on their prediction
        self.screen_note = ""
        self.screens = 0
        self.stopped_by = ""  # what stopped the measuring before the race ended, if anything did
        self.load = LoadStreak()
        # A resumed sweep's rounds start again from one: the journaled points' rounds are not this run's.
        self.done = {r.point: replace(r, repeat_rounds=())
                     for r in map(PointResult.from_dict, store.replayed(SWEEP_POINT))} if store else {}
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
        the speed of its own minutes alone. Raced (config.races, sweeping/race.py): screened where a predictor
        is given (the first round measures a few points, then the simulator's prediction leaves out those that
        could be neither better than the best nor equal to it: sweeping/screen.py), after the first round each
        round visits the points best first, and a point leaves once the race says so; once the time budget is
        spent, only points not yet measured at all run, and then every point stops."""
        import time

        from mbtune.sweeping.screen import MIN_SCREENED_GRID, first_points

        config = self.config
        self.order = {point: index for index, point in enumerate(points)}
        for point in points:
            if point in self.done:
                self._finished(point, self.done[point], REPLAYED)
        todo = [point for point in points if point not in self.done]
        self.unfinished = {point: self._measuring(point) for point in todo}
        if self.predictor is not None and config.screens and len(points) >= MIN_SCREENED_GRID:
            first = set(first_points(points))
            self.waiting = {p: self.unfinished.pop(p) for p in todo if p not in first}
        deadline = time.monotonic() + config.time_budget_s if config.time_budget_s and config.races else None
        rounds = 0
        while self.unfinished or self.waiting:
            rounds += 1
            if rounds > 1 and (self.waiting or (self.predicted and self.screens < 2)):
                self._screen()
            visit = list(self.unfinished)
            if config.races and rounds > 1:
                visit.sort(key=lambda p: -(self.unfinished[p].rate() or 0.0))
            # Points of one placement one after another: kept rank processes serve them all (a stable sort).
            visit.sort(key=lambda p: p.num_processes)
            ran = False  # whether this round ran a repeat (not every point was held back by the time budget)
            for point in visit:
                measuring = self.unfinished.get(point)
                if measuring is None:
                    continue
                # Past the time budget, only a point never measured runs (every point in the race has a figure).
                if deadline is not None and measuring.measured and time.monotonic() + measuring.repeat_s() > deadline:
                    continue
                if rounds > 1 and config.races and measuring.measured:
                    verdict = self._verdict(point)
                    if verdict.stopped:
                        self._stop(point, verdict.stopped, verdict.detail)
                        continue
                measuring.round = rounds
                if self.progress:
                    self.progress.working(f"{self.standing}{point.label}, repeat {len(measuring.runs) + 1}"
                                          f"{measuring.so_far()}")
                measuring.repeat()
                ran = True
                if measuring.stopped:
                    self._stop(point, measuring.stopped)
            if (deadline is not None and self.unfinished and not self.waiting
                    and (not ran or time.monotonic() >= deadline)):
                self._out_of_time(config.time_budget_s or 0.0)
            if config.races:
                self.standing = self._standing(rounds)
        self.results.sort(key=lambda r: self.order.get(r.point, len(self.order)))

    def _screen(self) -> None:
        """The simulator, calibrated on every point measured so far, predicts the points not measured yet: those
        it leaves out wait as predicted, the rest join the race (a point left out earlier comes back where a
        later prediction no longer rules it out)."""
        from mbtune.sweeping.screen import left_out

        self.screens += 1
        config = self.config
        current = self._current()
        pending = {**self.waiting, **{p: self._measuring(p) for p in self.predicted}}
        assert self.predictor is not None, "screened only where the planner's predictor was given"
        if self.predict is None:
            self.predict = self.predictor(workload=config.workload, workload_options=config.workload_options,
                                          optimizer=config.optimizer, block_times_s=self.balance.block_times_s)
        error, out = left_out(list(pending), current, self.predict, size=config.equivalence,
                              fixed_global_batch=bool(config.global_batches))
        self.predicted = {p.point: p for p in out}
        self.unfinished |= {p: m for p, m in pending.items() if p not in self.predicted}
        self.waiting = {}
        measured = len({r.point for r in current})
        if error is None:
            busy = any(r.load is not None and r.load.busy for r in current)
            self.screen_note = (f"measured every point: the simulator, calibrated on the first {measured}, could not "
                                "state its error on them" + (" (measured while the machine was busy)" if busy else ""))
        else:
            self.screen_note = (f"predicted the grid from {measured} measured points (the simulator's largest miss on a "
                                f"point it had not seen: {error:.0%}); {len(self.predicted)} point(s) left out as "
                                "predicted, the rest raced (--measure-all measures every point)")

    def _current(self) -> list[PointResult]:
        """What every point measured so far: the finished ones' results, then those still measuring."""
        return [*self.results, *(m.result() for m in self.unfinished.values() if m.measured)]

    def _verdict(self, point: SweepPoint) -> Verdict:
        from mbtune.sweeping.race import STAYS, race_verdict

        if not self.unfinished[point].measured:
            return STAYS
        current = self._current()
        index = next(i for i, r in enumerate(current) if r.point == point)
        return race_verdict(index, current, fixed_global_batch=bool(self.config.global_batches),
                            size=self.config.equivalence)

    def _standing(self, rounds: int) -> str:
        """The first look, for the progress line: the best so far and how many points are still in the race."""
        from mbtune.sweeping.ranking import rank_results

        current = self._current()
        ranking, _ = rank_results(current, "throughput", self.config.global_batches)
        if not ranking:
            return ""
        best = current[ranking[0]]
        return (f"after round {rounds}: best so far {best.point.label} ({best.samples_per_s:,.1f} samples/s), "
                f"{len(self.unfinished)} of {len(self.order)} still in the race; ")

    def _stop(self, point: SweepPoint, stopped: str, detail: str = "") -> None:
        measuring = self.unfinished.pop(point)
        measuring.stopped = stopped
        self._finished(point, replace(measuring.result(), stopped_detail=detail), "")

    def _out_of_time(self, budget_s: float) -> None:
        """The time budget is spent: every point still measuring stops with what it has (dropped where the race
        separates it from the best already)."""
        from mbtune.sweeping.stopping import DROPPED, TIME_BUDGET

        self.stopped_by = f"the time budget ({budget_s:g} s) was spent" + load_seen(self._current())
        for point in list(self.unfinished):  # what the race can already say of each, it says
            verdict = self._verdict(point)
            if verdict.stopped == DROPPED:
                self._stop(point, DROPPED, verdict.detail)
            else:
                self._stop(point, TIME_BUDGET, f"the sweep's time budget ({budget_s:g} s) was spent")

    def keep_unfinished(self) -> None:
        """Interrupted: the points still measuring keep the repeats they finished (not journaled: a resumed
        sweep measures them anew)."""
        for measuring in self.unfinished.values():
            if measuring.measured:
                self.results.append(replace(measuring.result(), stopped=INTERRUPTED))
        self.unfinished = {}
        self.results.sort(key=lambda r: self.order.get(r.point, len(self.order)))

    def _measuring(self, point: SweepPoint) -> Measuring:
        from mbtune.sweeping.repeat import Measuring

        peak = self.peak_flops * point.num_processes if self.peak_flops else None
        return Measuring(point, self.config, self.device, self.threads, self.workload, peak,
                          self.balance.block_times_s or None, self.ranks, self.load)

    def _finished(self, point: SweepPoint, result: PointResult, detail: str) -> PointResult:
        if self.store and detail != REPLAYED:
            self.store.record(SWEEP_POINT, result.to_dict())
        self.results.append(result)
        if self.progress:
            self.progress.start_trial(point.label)
            self.progress.end_trial(result.status, detail or _result_detail(result))
        return result


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


def load_seen(results: Sequence[PointResult]) -> str:
    """How loaded the machine was while these were measured, where other processes loaded it at all."""
    busy = [r.load for r in results if r.load is not None and r.load.busy]
    if not busy:
        return ""
    shares = [b.other_cpu_share for b in busy if b.other_cpu_share is not None]
    most = f", other processes taking up to {max(shares):.0%} of the CPUs" if shares else ""
    return f", with the machine busy in {len(busy)} of {len(results)} points{most}"


def _result_detail(result: PointResult) -> str:
    if result.ok and result.samples_per_s:
        return f"{result.samples_per_s:,.1f} samples/s"
    return (result.error.strip().splitlines() or [""])[-1].strip()  # the cause, whole
