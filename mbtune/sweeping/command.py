"""A sweep of the user's own training command, for a job that pipelines with its own code
(torch.distributed.pipelining or a framework's): each point is the command with its placeholders filled in
from the point, run in fresh processes under the cap `mbtune confirm` uses (here only to count what each
process held: the budget is the whole device), ended after warm-up + measured optimizer steps by the same
step hook a probe's trial uses (probing/command.py). The grid, the repeats until known, the round-robin,
the ranking, the ties and the profile are the workload sweep's (sweeping/run.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mbtune.errors import ConfigError
from mbtune.probing.command import ANY_PLACEHOLDER, NAME, placeholders_in
from mbtune.records import OK

if TYPE_CHECKING:
    from mbtune.device.nvml import NvmlSampler
    from mbtune.pipeline.point import SweepPoint
    from mbtune.pipeline.timeline import StageReport
    from mbtune.records import NvmlSummary
    from mbtune.sweeping.config import SweepConfig
    from mbtune.sweeping.records import PointResult

# What a placeholder is filled with, from the point.
PLACEHOLDERS = {
    "micro_batch_size": lambda p: p.micro_batch_size,
    "micro_batches": lambda p: p.num_micro_batches,
    "accum": lambda p: p.grad_accum_steps,
    "schedule": lambda p: p.schedule,
    "batch": lambda p: p.micro_batch_size * p.num_micro_batches,  # one pipeline step's batch, per replica
    "stages": lambda p: p.num_ranks,
    "stages_per_rank": lambda p: p.stages_per_rank,
    "data_parallel": lambda p: p.data_parallel_size,
}


def check_grid(grid: object) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The settings a command's sweep adds (--grid NAME=v1,v2, repeated; or a mapping NAME -> values), each
    a name the command writes {NAME} and one value or more, refused in one line otherwise."""
    from collections.abc import Mapping

    items: list[tuple[str, tuple[str, ...]]] = []
    if isinstance(grid, Mapping):
        grid = tuple(grid.items())
    for item in grid if isinstance(grid, list | tuple) else (grid,):
        if isinstance(item, str):
            name, equals, values = item.partition("=")
            if not equals:
                raise ConfigError(f"--grid {item!r} is not NAME=v1,v2", field="grid",
                                  hint="Write it like --grid lr=1e-4,3e-4, with {lr} in the command.")
            listed = tuple(v.strip() for v in values.split(","))
        else:
            name, raw = item
            listed = tuple(str(v).strip() for v in (raw.split(",") if isinstance(raw, str) else raw))
        name = name.strip()
        if not re.fullmatch(NAME, name) or name in PLACEHOLDERS:
            raise ConfigError(f"--grid {name}: a name the command writes {{{name}}}, not one of the sweep's own",
                              field="grid", hint=f"Use a new name; the sweep fills {_known()} itself.")
        if not listed or "" in listed or len(set(listed)) < len(listed):
            raise ConfigError(f"--grid {name} needs its values, each once: {','.join(listed) or 'none'}", field="grid",
                              hint=f"Write them with commas: --grid {name}=a,b.")
        if any(name == seen for seen, _ in items):
            raise ConfigError(f"--grid {name} is given twice", field="grid", hint="Give its values once, with commas.")
        items.append((name, listed))
    return tuple(items)


def _known(extra: Sequence[str] = ()) -> str:
    return ", ".join("{" + name + "}" for name in (*PLACEHOLDERS, *extra))


def check_sweep_template(command: Sequence[str], grid: Sequence[str] = ()) -> tuple[str, ...]:
    """The command, refused with a placeholder a sweep does not fill (its own, and the names `grid` adds),
    with none at all, or without a {NAME} that `grid` adds."""
    known = _known(grid)
    if not command:
        raise ConfigError("no command to sweep", hint="Put it after --: mbtune sweep -- torchrun --nproc-per-node "
                          "{stages} train.py --micro-batches {micro_batches} --schedule {schedule}")
    used = placeholders_in(command)
    unknown = sorted(used - set(PLACEHOLDERS) - set(grid))
    if unknown:
        raise ConfigError(f"the command has the placeholder {{{unknown[0]}}}, which a sweep does not fill",
                          hint=f"A sweep fills {known}; add yours with --grid {unknown[0]}=v1,v2.")
    unused = [name for name in grid if name not in used]
    if unused:
        raise ConfigError(f"--grid {unused[0]} has no {{{unused[0]}}} in the command to fill",
                          field="grid", hint=f"Write {{{unused[0]}}} where the command takes it.")
    if not used:
        raise ConfigError("the command has no placeholder: every point of the sweep would run the same command",
                          hint=f"Write what the sweep varies where the command takes it: {known}.")
    return tuple(command)


def command_for(command: Sequence[str], point: SweepPoint) -> list[str]:
    """The command with the point's values in its placeholders (the sweep's own, and its --grid ones)."""
    own = dict(point.grid)

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        return own[name] if name in own else str(PLACEHOLDERS[name](point))

    return [ANY_PLACEHOLDER.sub(value, arg) for arg in command]


# Schedules by the micro-batches they keep in flight, most first: GPipe holds every one, the interleaved and
# zero-bubble ones more than 1F1B's (at most the stages).
HUNGRIEST_SCHEDULES = ("gpipe", "interleaved-1f1b", "zero-bubble", "1f1b")


def hungriest_point(config: SweepConfig) -> SweepPoint:
    """The point of the grid whose ranks hold the most, where `tune -- COMMAND` probes the command: the schedule
    that keeps the most micro-batches in flight, the most micro-batches, accumulation steps and replicas, no
    recompute, and the last value of each --grid setting (list a setting's values in the order of the memory
    they take). Its micro-batch size is the probe's to find."""
    from mbtune.pipeline.point import SweepPoint
    from mbtune.pipeline.theory import stages_per_rank_of

    schedule = min(config.schedules, key=lambda s: HUNGRIEST_SCHEDULES.index(s) if s in HUNGRIEST_SCHEDULES else 0)
    return SweepPoint(schedule=schedule, num_ranks=config.num_ranks, num_micro_batches=max(config.micro_batch_counts),
                      grad_accum_steps=max(config.grad_accum_steps), micro_batch_size=1,
                      stages_per_rank=stages_per_rank_of(schedule, config.stages_per_rank),
                      data_parallel_size=max(config.data_parallel_size), recompute="none",
                      grid=tuple((name, values[-1]) for name, values in config.grid))


def probe_command(config: SweepConfig) -> tuple[tuple[str, ...], int]:
    """What `tune -- COMMAND` probes: the command at the grid's hungriest point (hungriest_point) with its batch
    placeholder left for the probe to step, {micro_batch_size} where it has one, else {batch} (micro-batch size
    x micro-batches); and how many micro-batches the probed size spans (1, or the point's micro-batches), so
    the probed safe size over it is the largest micro-batch size every point of the grid fits."""
    from mbtune.probing.command import PLACEHOLDER

    used = placeholders_in(config.command)
    stepped = next((name for name in ("micro_batch_size", "batch") if name in used), None)
    if stepped is None:
        raise ConfigError("tune -- COMMAND probes the command's batch, and it has neither {micro_batch_size} nor "
                          "{batch}", hint="Write {micro_batch_size} where the command takes its micro-batch size.")
    if stepped == "micro_batch_size" and "batch" in used:
        raise ConfigError("the command has both {micro_batch_size} and {batch}: a tune probes one of them",
                          hint="Write the micro-batch size and the micro-batches ({micro_batches}) instead of {batch}.")
    point = hungriest_point(config)
    own = dict(point.grid)

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        return PLACEHOLDER if name == stepped else own[name] if name in own else str(PLACEHOLDERS[name](point))

    spans = 1 if stepped == "micro_batch_size" else point.num_micro_batches
    return tuple(ANY_PLACEHOLDER.sub(value, arg) for arg in config.command), spans


def run_command_point(point: SweepPoint, config: SweepConfig, device: str) -> PointResult:
    """One repeat of the point: the command run once, its steps after warm-up measured; where it ran
    torch.distributed.pipelining's schedules, its bubble, idle shares and timeline from the actions the cap
    timed, summarised as a workload's point is (sweeping/measured.py)."""
    from dataclasses import replace

    from mbtune.device.nvml import NvmlSampler
    from mbtune.pipeline.theory import theoretical_bubble
    from mbtune.pipeline.timeline import PipelineOutcome
    from mbtune.probing.command import classify, run_steps
    from mbtune.settings import MAX_BUDGET_BYTES
    from mbtune.sweeping.measured import summarize_point
    from mbtune.sweeping.records import PointResult

    warmup = max(1, config.warmup_steps)  # the first step holds the command's start-up
    steps = warmup + config.measured_steps
    command = command_for(config.command, point)
    # Its processes pick their own GPUs: every GPU is sampled, and those the processes used are kept.
    with NvmlSampler(cuda_indices=() if device == "cpu" else None) as sampler:
        capped = run_steps(command, config.memory_budget_bytes or MAX_BUDGET_BYTES,
                           "cpu" if device == "cpu" else "cuda", config.point_timeout_s, steps,
                           config.steps_from_output)
    trial = classify(capped, point.global_batch, steps, printed=bool(config.steps_from_output))
    ran_as = f"your command: {len(capped.reported)} process(es)"
    if trial.status != OK:
        theory = theoretical_bubble(point.schedule, num_ranks=point.num_ranks,
                                    num_micro_batches=point.num_micro_batches, stages_per_rank=point.stages_per_rank)
        return PointResult(point=point, status=trial.status, error=trial.error, bubble_theoretical=theory,
                           wall_s=capped.wall_s, error_kind=trial.error_kind, error_tail=trial.error_tail,
                           peak_memory_bytes=_peaks_by_rank(capped.reported, point.num_ranks), ran_as=ran_as)
    measured = tuple(trial.step_times_s[warmup:])
    reports = stage_reports(capped.reported, warmup, measured, device)
    unmeasured = "" if reports else NO_SCHEDULE
    if not reports:  # no schedule ran: each rank's memory, the command's steps, no timeline
        reports = tuple(_untimed(rank, peak, measured, device)
                        for rank, peak in enumerate(_peaks_by_rank(capped.reported, point.num_ranks)))
    outcome = PipelineOutcome(status=OK, reports=reports, wall_s=capped.wall_s)
    result = summarize_point(point, outcome, tokens_per_sample=None, flops_per_sample=None, peak_flops_total=None)
    return replace(result, ran_as=ran_as, bubble_unmeasured=unmeasured, stage_blocks=(),  # its blocks: unknown
                   nvml=command_nvml(sampler, capped.reported, warmup) if device != "cpu" else None)


def command_nvml(sampler: NvmlSampler, reported: Sequence[dict], warmup: int) -> NvmlSummary:
    """What NVML sampled of the GPUs the command's processes used (each names its own; else those NVML saw
    its processes compute on), over its measured steps (from the end of each process's warm-up to the last
    step's end)."""
    window = measured_window(reported, warmup)
    uuids = sorted({uuid for r in reported for uuid in r.get("device_uuids") or ()})
    if not uuids:
        uuids = sampler.gpus_running([r["pid"] for r in reported if "pid" in r], window)
    if not uuids:
        from mbtune.records import NvmlSummary

        return NvmlSummary(available=False, reason="NVML saw none of the command's processes on a GPU")
    return sampler.summary(uuids, window)


def measured_window(reported: Sequence[dict], warmup: int) -> tuple[float, float] | None:
    """time.time() from the first process's end of its warm-up steps to the last one's last step; None where
    no process stepped past its warm-up."""
    ends = [r["step_ends_unix_s"] for r in reported if len(r.get("step_ends_unix_s") or ()) > warmup]
    if not ends:
        return None
    return min(e[warmup - 1] if warmup else e[0] for e in ends), max(e[-1] for e in ends)


NO_SCHEDULE = "not measured (no torch.distributed.pipelining schedule ran)"


def stage_reports(reported: Sequence[dict], warmup: int, step_times_s: Sequence[float],
                  device: str) -> tuple[StageReport, ...]:
    """The command's processes that ran torch.distributed.pipelining's schedules as mbtune's ranks report
    (pipeline/timeline.py), from what the cap timed (probing/cap): per optimizer step after `warmup`, the
    schedule steps' span from the first one's start (the pipeline time) and their actions from there. A
    process is the pipeline rank of the stages it ran; a second process with the same stages is another
    data-parallel replica. `step_times_s`: the command's measured optimizer steps (the slowest process's).
    Empty where no process ran a schedule past its warm-up."""
    from mbtune.pipeline.timeline import ActionRecord, StageReport

    piped = [r for r in reported if r.get("pipeline") and r["pipeline"].get("stages")]
    if not piped:
        return ()
    printed = not any(r.get("step_times_s") for r in piped)  # no optimizer step: a schedule step is a step
    holdings = sorted({tuple(r["pipeline"]["stages"]) for r in piped})
    seen: dict[tuple[int, ...], int] = {}
    reports = []
    for report in sorted(piped, key=lambda r: (r.get("rank") if isinstance(r.get("rank"), int) else 0,
                                               r.get("started", 0))):
        pipe = report["pipeline"]
        stages = tuple(pipe["stages"])
        by_step: dict[int, list[list]] = {}
        for index, schedule_step in enumerate(pipe["steps"]):
            optimizer_step, start, end, actions = schedule_step
            key = index if printed else optimizer_step
            if key >= warmup and end is not None:
                by_step.setdefault(key - warmup, []).append([start, end, actions])
        count = min(len(step_times_s), len(by_step))
        if not count:
            return ()
        records, walls = [], []
        for step in range(count):
            spans = by_step.get(step, [])
            origin = spans[0][0] if spans else 0.0
            walls.append(max((end for _, end, _ in spans), default=origin) - origin)
            for accum, (_, _, actions) in enumerate(spans):
                records += [ActionRecord(step=step, accum=accum, stage=stage, kind=kind, microbatch=microbatch,
                                         start_s=begun - origin, end_s=ended - origin)
                            for stage, kind, microbatch, begun, ended in actions
                            if stage is not None and begun is not None and ended is not None]
        replica = seen.get(stages, 0)
        seen[stages] = replica + 1
        reports.append(StageReport(
            rank=holdings.index(stages), num_ranks=len(holdings), device=device, stage_indices=stages,
            block_indices=tuple(() for _ in stages), num_parameters=0, step_times_s=tuple(step_times_s[:count]),
            pipeline_times_s=tuple(walls), actions=tuple(records), peak_memory_bytes=report.get("peak_bytes"),
            replica=replica))
    count = min(len(r.step_times_s) for r in reports)
    return tuple(dataclasses.replace(r, step_times_s=r.step_times_s[:count],
                                     pipeline_times_s=r.pipeline_times_s[:count],
                                     actions=tuple(a for a in r.actions if a.step < count)) for r in reports)


def _untimed(rank: int, peak: int | None, step_times_s: tuple[float, ...], device: str) -> StageReport:
    from mbtune.pipeline.timeline import StageReport

    return StageReport(rank=rank, num_ranks=1, device=device, stage_indices=(rank,), block_indices=((),),
                       num_parameters=0, step_times_s=step_times_s, pipeline_times_s=(), peak_memory_bytes=peak)


def _peaks_by_rank(reported: list[dict], num_ranks: int) -> tuple[int | None, ...]:
    """What each pipeline rank held: the processes a launcher gave a rank (torchrun's RANK), else those that
    stepped an optimizer, in start order; a replica's rank r + k x ranks folds onto rank r (the highest)."""
    ranked = [r for r in reported if isinstance(r.get("rank"), int)]
    if ranked:
        order = sorted(ranked, key=lambda r: r["rank"])
    else:
        order = sorted((r for r in reported if r.get("step_times_s")) or reported, key=lambda r: r.get("started", 0))
    peaks: list[int | None] = [None] * num_ranks
    for index, report in enumerate(order):
        slot = (report["rank"] if ranked else index) % num_ranks
        if report.get("peak_bytes") is not None:
            peaks[slot] = max(peaks[slot] or 0, report["peak_bytes"])
    return tuple(peaks)
