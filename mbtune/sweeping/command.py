"""A sweep of the user's own training command, for a job that pipelines with its own code
(torch.distributed.pipelining or a framework's): each point is the command with its placeholders filled in
from the point, run in fresh processes under the cap `mbtune confirm` uses (here only to count what each
process held: the budget is the whole device), ended after warm-up + measured optimizer steps by the same
step hook a probe's trial uses (probing/command.py). The grid, the repeats until known, the round-robin,
the ranking, the ties and the profile are the workload sweep's (sweeping/run.py).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mbtune.errors import ConfigError
from mbtune.probing.command import ANY_PLACEHOLDER, NAME, placeholders_in
from mbtune.records import OK

if TYPE_CHECKING:
    from mbtune.pipeline.point import SweepPoint
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


def run_command_point(point: SweepPoint, config: SweepConfig, device: str) -> PointResult:
    """One repeat of the point: the command run once, its steps after warm-up measured."""
    from mbtune.pipeline.theory import theoretical_bubble
    from mbtune.probing.command import classify, run_steps
    from mbtune.settings import MAX_BUDGET_BYTES
    from mbtune.sweeping.records import PointResult

    warmup = max(1, config.warmup_steps)  # the first step holds the command's start-up
    steps = warmup + config.measured_steps
    command = command_for(config.command, point)
    capped = run_steps(command, MAX_BUDGET_BYTES, "cpu" if device == "cpu" else "cuda", config.point_timeout_s,
                       steps, config.steps_from_output)
    trial = classify(capped, point.global_batch, steps, printed=bool(config.steps_from_output))
    theory = theoretical_bubble(point.schedule, num_ranks=point.num_ranks, num_micro_batches=point.num_micro_batches,
                                stages_per_rank=point.stages_per_rank)
    peaks = _peaks_by_rank(capped.reported, point.num_ranks)
    ran_as = f"your command: {len(capped.reported)} process(es)"
    if trial.status != OK:
        return PointResult(point=point, status=trial.status, error=trial.error, bubble_theoretical=theory,
                           wall_s=capped.wall_s, error_kind=trial.error_kind, error_tail=trial.error_tail,
                           peak_memory_bytes=peaks, ran_as=ran_as)
    measured = trial.step_times_s[warmup:]
    median = statistics.median(measured)
    cv = 100.0 * statistics.pstdev(measured) / statistics.mean(measured) if len(measured) > 1 else 0.0
    rate = point.global_batch / median
    return PointResult(
        point=point, status=OK, step_times_s=measured, step_time_median_s=median, step_time_cv_pct=cv,
        samples_per_s=rate, repeat_step_time_medians_s=(median,),
        samples_per_s_min=point.global_batch / max(measured), samples_per_s_max=point.global_batch / min(measured),
        bubble_theoretical=theory, peak_memory_bytes=peaks, wall_s=capped.wall_s, ran_as=ran_as)


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
