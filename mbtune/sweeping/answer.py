"""A sweep's answer: its report built from what its points measured (the ranking, the decision, the Pareto
front, the trade-off rows, the learning-rate advice). Pure."""

from __future__ import annotations

from mbtune.records import DeviceInfo
from mbtune.settings import lr_for
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.equivalence import decide
from mbtune.sweeping.lr import lr_advice
from mbtune.sweeping.ranking import rank_results, recompute_pairs, tied_with_best, tradeoff
from mbtune.sweeping.records import PointResult, SkippedPoint, SweepReport


def sweep_report(config: SweepConfig, info: DeviceInfo, results: list[PointResult],
                  skipped: tuple[SkippedPoint, ...], num_grid_points: int, interrupted: bool,
                  warnings: list[str], notes: tuple[str, ...], stopped_by: str = "") -> SweepReport:
    """What the sweep measured, ranked, its answer decided (sweeping/equivalence.py) and its rows' learning
    rates advised; `stopped_by`: what stopped the measuring before the race ended, if anything did."""

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
        decision=decide(results, ranking, config.equivalence, same_global_batch=bool(fixed), why=stopped_by)
        if config.objective == "throughput" else None,
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
