"""Library entry points of planning: what `mbtune plan`, `mbtune sweep --strategy quick` and the pictures call.

Everything here takes a saved Profile (or sweep results) and returns a typed record; torch is imported only
to read the workload's blocks on the meta device (no weights allocated, no device touched).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mbtune.errors import ConfigError, ProfileError
from mbtune.pipeline.point import SweepPoint
from mbtune.planning.accuracy import LEAVE_ONE_OUT, validate
from mbtune.planning.calibrate import calibrate, point_orders
from mbtune.planning.cluster import count_points, plan_cluster
from mbtune.planning.config import PlanConfig
from mbtune.planning.hardware import on_device
from mbtune.planning.planner import (
    Link,
    deepen,
    plan,
    plan_notes,
    predict,
    with_scatter,
    without_per_sample_memory,
)
from mbtune.planning.quick import quick_search, simulator_predictor
from mbtune.planning.records import (
    SCATTER_MEASURED,
    BlockFacts,
    CostModel,
    PlanReport,
    Prediction,
    QuickResult,
    Validation,
)
from mbtune.saving.profiles import Profile
from mbtune.sweeping.records import PointResult, SweepReport
from mbtune.sweeping.screen import Predictor


def block_facts(workload: str, workload_options: Sequence[tuple[str, Any]] | dict[str, Any] = ()) -> BlockFacts:
    """Parameters, forward FLOPs, output and saved-activation bytes per sample of every block, read on the
    meta device in a child process under a deadline (the workload's code never runs in this one). Where a
    block cannot run on the meta device, weights fall back to parameter counts and the activation sizes are
    left unknown."""
    from mbtune.workloads.facts import in_child

    return in_child(_block_facts_here, workload, tuple(sorted(dict(workload_options).items())))


def _block_facts_here(workload: str, options: tuple[tuple[str, Any], ...]) -> BlockFacts:
    from mbtune.workloads import load_workload

    loaded = load_workload(workload, options)
    try:
        return _meta_facts(loaded)
    except Exception:  # noqa: BLE001 - any failure of user code on the meta device: fall back to parameters
        parameters = tuple(_parameters(loaded))
        source = "parameters" if any(parameters) else "equal"
        weights = tuple(float(p) for p in parameters) if any(parameters) else (1.0,) * len(parameters)
        return BlockFacts(num_blocks=len(parameters), parameters=parameters, weights=weights, weight_source=source,
                          split_weights=tuple(loaded.compute_weights()))


def _parameters(workload: Any) -> list[int]:
    import torch

    with torch.device("meta"):
        return [sum(p.numel() for p in build().parameters()) for build in workload.blocks]


def _meta_facts(workload: Any) -> BlockFacts:
    """Run every block at batch sizes 1 and 2 on meta tensors: the differences are per sample, so weights
    (which autograd also saves) drop out of the saved-activation count."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from mbtune.workloads.chain import as_received, batch_to, call_block, tensors_of

    inputs: dict[int, Any] = {b: batch_to(workload.make_batch(b, torch.Generator().manual_seed(0))[0], "meta") for b in (1, 2)}
    parameters, flops, outputs, saved = [], [], [], []
    for build in workload.blocks:
        with torch.device("meta"):
            module = build()
        parameters.append(sum(p.numel() for p in module.parameters()))
        measured = {}
        for b in (1, 2):
            sizes: list[int] = []

            def pack(tensor: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
                sizes.append(tensor.numel() * tensor.element_size())
                return tensor

            with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = call_block(module, inputs[b])
            measured[b] = (counter.get_total_flops(), sum(t.numel() * t.element_size() for t in tensors_of(out)),
                           sum(sizes))
            inputs[b] = as_received(out)
        flops.append(max(0, measured[2][0] - measured[1][0]))
        outputs.append(max(0, measured[2][1] - measured[1][1]))
        saved.append(max(0, measured[2][2] - measured[1][2]))
    source = "flops" if any(flops) else "parameters" if any(parameters) else "equal"
    weights = {"flops": flops, "parameters": parameters, "equal": [1] * len(flops)}[source]
    return BlockFacts(num_blocks=len(parameters), parameters=tuple(parameters), weights=tuple(float(w) for w in weights),
                      weight_source=source, output_bytes_per_sample=tuple(outputs), saved_bytes_per_sample=tuple(saved),
                      split_weights=tuple(workload.compute_weights()))


def _sweep_of(profile: Profile) -> SweepReport:
    sweep = profile.sweep
    if sweep is None or not any(r.ok and r.timeline for r in sweep.results):
        raise ProfileError("the profile holds no sweep with measured timelines to calibrate the simulator from",
                           hint="Run mbtune sweep (or mbtune tune) for this workload first.")
    return sweep


def sweep_facts(sweep: SweepReport) -> BlockFacts:
    """The block facts of a sweep's workload, with the stages split as that sweep split them (by the block
    times it measured, where it balanced by time)."""
    return with_balance(block_facts(sweep.workload, sweep.workload_options), sweep.balance.block_times_s
                        if sweep.balance.by == "time" else ())


def with_balance(facts: BlockFacts, block_times_s: Sequence[float]) -> BlockFacts:
    """The facts splitting stages by these block times (none given: as they were)."""
    return replace(facts, split_weights=tuple(block_times_s)) if block_times_s else facts


def _optimizer(profile: Profile) -> str:
    """The optimizer the profile's sweep trained with (its state is part of every rank's memory)."""
    assert profile.sweep is not None, "plans calibrate on a sweep"
    return profile.sweep.optimizer


def calibrate_results(results: Sequence[PointResult], *, workload: str, workload_options: dict[str, Any] | None = None,
                      device: str = "", optimizer: str = "adamw", facts: BlockFacts | None = None) -> CostModel:
    """The cost model fitted to sweep results (see mbtune.planning.calibrate)."""
    facts = facts or block_facts(workload, workload_options or {})
    return calibrate(results, facts, workload=workload, workload_options=workload_options, device=device,
                     optimizer=optimizer)


def calibrate_profile(profile: Profile) -> CostModel:
    """The cost model fitted to the timelines of a profile's sweep."""
    sweep = _sweep_of(profile)
    return calibrate_results(sweep.results, workload=sweep.workload, workload_options=sweep.workload_options,
                             device=sweep.device.name, optimizer=_optimizer(profile), facts=sweep_facts(sweep))


def validate_results(results: Sequence[PointResult], *, workload: str, workload_options: dict[str, Any] | None = None,
                     optimizer: str = "adamw", method: str = LEAVE_ONE_OUT, facts: BlockFacts | None = None,
                     scatter: str = SCATTER_MEASURED) -> Validation:
    """Predicted against measured step time and bubble for every point that ran (median and worst error),
    with the measurements' noise floor beside them."""
    facts = facts or block_facts(workload, workload_options or {})
    return validate(results, lambda runs: calibrate(runs, facts, workload=workload, optimizer=optimizer),
                    method=method, scatter=scatter)


def validate_profile(profile: Profile, *, method: str = LEAVE_ONE_OUT, scatter: str = SCATTER_MEASURED) -> Validation:
    """validate_results over a profile's sweep."""
    sweep = _sweep_of(profile)
    return validate_results(sweep.results, workload=sweep.workload, workload_options=sweep.workload_options,
                            optimizer=_optimizer(profile), method=method, scatter=scatter, facts=sweep_facts(sweep))


def memory_limit(profile: Profile) -> tuple[float | None, str]:
    """The memory a rank may use, and what it is: the probe's peak at its ceiling (the same measure as the
    stage peaks), else the probe's budget."""
    sweep, probe = profile.sweep, profile.probe
    if sweep is not None and sweep.ceiling_peak_memory_bytes:
        return float(sweep.ceiling_peak_memory_bytes), f"peak at the probed ceiling (batch {sweep.ceiling})"
    if probe is not None:
        peaks = [t.peak_memory_bytes for t in probe.trials if t.ok and t.batch_size == probe.ceiling and t.peak_memory_bytes]
        if peaks:
            return float(max(peaks)), f"peak at the probed ceiling (batch {probe.ceiling})"
        if probe.memory_budget_bytes:
            return float(probe.memory_budget_bytes), "the probe's memory budget"
    return None, ""


def _tokens_per_sample(results: Sequence[PointResult]) -> int | None:
    for r in results:
        if r.ok and r.tokens_per_s and r.samples_per_s:
            return round(r.tokens_per_s / r.samples_per_s)
    return None


def plan_from_profile(profile: Profile | str | Path, config: PlanConfig | None = None, **options: Any) -> PlanReport:
    """Calibrate on the profile's sweep (a loaded Profile, or the path of a saved one), validate against
    it, and predict, rank and recommend the config's grid, with memory per rank checked against the probed
    ceiling. Where the probe's memory model is not resolved, memory per rank has no per-sample part.

    Keyword settings instead of a config build one (as `mbtune.plan` does: by the flags' names), keeping
    the recommended timeline."""
    if config is None:
        from mbtune.settings import build

        config = build(PlanConfig, {"keep_timeline": True, **options}, what="plan")
    elif options:
        raise TypeError(f"plan_from_profile takes a PlanConfig or keyword options, not both ({', '.join(options)})")
    if not isinstance(profile, Profile):
        from mbtune.saving.profiles import load_profile

        profile = load_profile(Path(profile))
    sweep = _sweep_of(profile)
    facts = sweep_facts(sweep)  # the stages split as the sweep split them
    per_sample, warnings = per_sample_memory(profile)
    if not per_sample:
        facts = without_per_sample_memory(facts)
    optimizer = _optimizer(profile)
    model = calibrate(sweep.results, facts, workload=sweep.workload, workload_options=sweep.workload_options,
                      device=sweep.device.name, optimizer=optimizer)
    if config.target_device is not None:
        try:
            model, note = on_device(model, sweep.device.name, config.target_device, sweep.precision)
        except ValueError as exc:
            raise ConfigError(str(exc), field="target_device") from None
        warnings.append(note)
    validation = None if config.validation_method is None else validate(
        sweep.results, lambda runs: calibrate(runs, facts, workload=sweep.workload, optimizer=optimizer),
        method=config.validation_method, scatter=config.scatter)
    grid = config.grid()
    if grid.micro_batch_size is None and grid.global_batch is None:
        sizes = [r.point.micro_batch_size for r in sweep.results if r.ok]
        grid = replace(grid, micro_batch_size=max(statistics.multimode(sizes)))  # the most common; ties: largest
    if config.link_bandwidth_bytes_per_s is None and config.link_latency_s is None:
        warnings.append("no link given: stage-to-stage hand-overs cost what they cost on the profiled machine")
    limit, source = memory_limit(profile)
    if config.device_memory_bytes is not None:
        limit, source = float(config.device_memory_bytes), "each device's memory (--device-memory)"
    if config.num_gpus is not None:
        report = _plan_cluster(model, config, memory_limit_bytes=limit, memory_limit_source=source,
                               tokens_per_sample=_tokens_per_sample(sweep.results), validation=validation,
                               warnings=warnings, per_sample_memory=per_sample)
    else:
        report = plan(model, grid, link=config.link(), memory_limit_bytes=limit, memory_limit_source=source,
                      tokens_per_sample=_tokens_per_sample(sweep.results), validation=validation, warnings=warnings,
                      scatter=config.scatter, per_sample_memory=per_sample)
    report = replace(report, device=sweep.device, estimated_for=config.target_device or "")
    recommended = recommended_timeline(report) if config.keep_timeline else None
    return replace(report, recommended_timeline=recommended.timeline) if recommended is not None else report


def _plan_cluster(model: CostModel, config: PlanConfig, *, memory_limit_bytes: float | None, memory_limit_source: str,
                  tokens_per_sample: int | None, validation: Validation | None, warnings: list[str],
                  per_sample_memory: bool) -> PlanReport:
    """plan --gpus: every split of the GPUs estimated, the best simulated and ranked (planning/cluster.py)."""
    if config.num_blocks is not None:
        model = deepen(model, config.num_blocks)
    model = with_scatter(model, config.scatter)
    link = config.link()
    grid = config.cluster_grid()
    if not count_points(grid, model.facts.num_blocks, 1):
        raise ConfigError(f"no way to split {grid.num_gpus} GPUs for global batch {grid.global_batch} with the "
                          f"model's {model.facts.num_blocks} blocks: every pipeline deep enough for the replicas "
                          "that divide the batch needs more blocks than the model has, or more micro-batches",
                          field="num_blocks", hint="Plan a deeper model of the same blocks (--blocks), or "
                                                   "another global batch.")
    ranked, skipped, enumerated, simulated = plan_cluster(model, grid, link=link, memory_limit_bytes=memory_limit_bytes,
                                                          tokens_per_sample=tokens_per_sample, orders_of=point_orders)
    notes = [*warnings, f"{enumerated} ways to split {grid.num_gpus} GPUs for global batch {grid.global_batch} "
                        f"estimated in closed form; the best {simulated} simulated and ranked here",
             *plan_notes(model, data_parallel=any(p.point.data_parallel_size > 1 for p in ranked), link=link,
                         scatter=config.scatter, memory_limit_bytes=memory_limit_bytes)]
    if model.facts.num_blocks < grid.num_gpus:
        notes.append(f"the model has {model.facts.num_blocks} blocks: pipelines deeper than that are not planned "
                     "(plan a deeper model of the same blocks with --blocks)")
    return PlanReport(workload=model.workload, workload_options=dict(model.workload_options), model=model,
                      num_blocks=model.facts.num_blocks, scatter=config.scatter, per_sample_memory=per_sample_memory,
                      predictions=tuple(ranked), skipped=tuple(skipped),
                      recommended=0 if ranked and ranked[0].fits is not False else None, validation=validation,
                      warnings=tuple(notes), memory_limit_bytes=memory_limit_bytes,
                      memory_limit_source=memory_limit_source, link_bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                      link_latency_s=link.latency_s, ranks_per_node=link.ranks_per_node, num_gpus=grid.num_gpus,
                      num_candidates=enumerated, num_simulated=simulated)


def per_sample_memory(profile: Profile) -> tuple[bool, list[str]]:
    """Whether the plan may count memory per sample, and the note that says why not: a probe whose memory
    model is not resolved (its slope not clearly above its own scatter) measured no per-sample memory, so
    the plan uses none either: measured peaks less parameter state are the base."""
    model = profile.probe.memory_model if profile.probe is not None else None
    if model is None or model.resolved:
        return True, []
    return False, [("no per-sample memory (the probe's memory model is not resolved): memory per rank is the "
                    "measured base plus parameter state, in-flight activations not counted")]


def recommended_timeline(report: PlanReport) -> Prediction | None:
    """The recommended prediction again, with its simulated timeline (for pictures and traces): the one the
    plan kept, else simulated now."""
    best = report.best
    if best is None:
        return None
    if report.recommended_timeline:
        return replace(best, timeline=report.recommended_timeline)
    return predict(deepen(report.model, best.num_blocks), best.point, memory_limit_bytes=report.memory_limit_bytes,
                   link=Link(bandwidth_bytes_per_s=report.link_bandwidth_bytes_per_s, latency_s=report.link_latency_s,
                             ranks_per_node=report.ranks_per_node),
                   keep_timeline=True, seed=best.seed)


def grid_predictor(*, workload: str, workload_options: Sequence[tuple[str, Any]] | dict[str, Any] = (),
                   optimizer: str = "adamw", block_times_s: Sequence[float] = ()) -> Predictor:
    """A raced sweep's predictor (sweeping/screen.py): the simulator calibrated on the points measured so far
    predicts each point's samples/s and its busiest rank's peak memory. `block_times_s`: the sweep balances
    stages by these (see SweepReport.balance)."""
    from mbtune.planning.calibrate import calibrate, usable
    from mbtune.planning.planner import predict

    facts = with_balance(block_facts(workload, workload_options), block_times_s)

    def predict_points(results: Sequence[PointResult],
                       points: Sequence[SweepPoint]) -> list[tuple[float, float | None] | None]:
        if not usable(results):
            raise ValueError("no point ran ok yet")
        model = calibrate(results, facts, workload=workload, optimizer=optimizer)
        found: list[tuple[float, float | None] | None] = []
        for point in points:
            try:
                prediction = predict(model, point)
            except ValueError:
                found.append(None)
                continue
            found.append((prediction.samples_per_s, prediction.max_memory_bytes or None))
        return found

    return predict_points


def quick_sweep(points: Sequence[SweepPoint], run_point: Callable[[SweepPoint], PointResult], *, workload: str,
                workload_options: Sequence[tuple[str, Any]] | dict[str, Any] = (), optimizer: str = "adamw",
                num_calibration: int = 3, min_gain: float = 0.02, max_fraction: float = 1 / 3,
                block_times_s: Sequence[float] = ()) -> QuickResult:
    """`mbtune sweep --strategy quick`: quick_search over the grid's runnable points with the simulator as
    the predictor; `run_point` runs one point for real (the sweep's own runner). `block_times_s`: the
    sweep balances stages by these (see SweepReport.balance)."""
    facts = with_balance(block_facts(workload, workload_options), block_times_s)
    return quick_search(points, run_point, predict_rates=simulator_predictor(facts, workload=workload, optimizer=optimizer),
                        num_calibration=num_calibration, min_gain=min_gain, max_fraction=max_fraction)
