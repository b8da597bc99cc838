"""A probe of the user's own training command, as it is: each trial runs the command, its `{batch}` placeholder
filled in, in fresh processes under exactly the cap a probe trial runs under (probing/cap: every Python process
it starts, every thread's tensors on the CPU; the per-process memory fraction on CUDA), and ends it cleanly
after `steps` optimizer steps, counted and timed by a global hook on torch's optimizer step installed before
the script's first line. The search is the probe's own (probing/search.py) over these trials.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mbtune.device.oom_figures import oom_fields
from mbtune.errors import ConfigError
from mbtune.probing.confirm import Capped, run_capped
from mbtune.probing.records import TrialOutcome
from mbtune.records import ERROR, OK, OOM, TIMEOUT, WORKLOAD_FAULT

if TYPE_CHECKING:
    from mbtune.probing.search import SearchResult

PLACEHOLDER = "{batch}"
NAME = r"[A-Za-z_][A-Za-z0-9_]*"  # what a placeholder's name may be: {NAME}
ANY_PLACEHOLDER = re.compile(r"\{(" + NAME + r")\}")


def placeholders_in(command: Sequence[str]) -> set[str]:
    """The names of the {NAME} placeholders the command holds."""
    return {m.group(1) for arg in command for m in ANY_PLACEHOLDER.finditer(arg)}


def check_template(command: Sequence[str]) -> tuple[str, ...]:
    """The command, refused without a `{batch}` or with a placeholder a probe does not fill."""
    if not command:
        raise ConfigError("no command to probe", hint="Put it after --: mbtune probe --memory-budget 8GiB -- "
                          "python train.py --batch-size {batch}")
    unknown = sorted(placeholders_in(command) - {"batch"})
    if unknown:
        raise ConfigError(f"the command has the placeholder {{{unknown[0]}}}, which a probe does not fill",
                          hint="A probe fills {batch}, the batch size of each process.")
    if not any(PLACEHOLDER in arg for arg in command):
        raise ConfigError("the command has no {batch} placeholder for the probe to fill",
                          hint="Write {batch} where the batch size goes: ... --batch-size {batch}")
    return tuple(command)


def command_name(command: Sequence[str]) -> str:
    """What a command is called in its profile's name: its script's name (train.py -> train, also under a
    launcher: python -m torch.distributed.run ... train.py), else the module of `python -m`, else the
    program's name."""
    from pathlib import Path

    args = list(command)
    script = next((a for a in args if a.endswith(".py")), None)
    if script:
        return Path(script).stem
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1]
    return Path(args[0]).name


def command_at(command: Sequence[str], batch_size: int) -> list[str]:
    """The command with its `{batch}` filled in."""
    return [arg.replace(PLACEHOLDER, str(batch_size)) for arg in command]


@dataclass(frozen=True, kw_only=True)
class CommandTrial:
    """How one trial of a command runs: under this budget, on this device, for this many optimizer steps."""

    command: tuple[str, ...]
    memory_budget_bytes: int
    device: str = "cpu"  # "cpu" or "cuda"
    steps: int = 3
    timeout_s: float = 600.0
    # A line the command prints once a step (a regular expression): its steps are counted and timed from its
    # output instead of torch's optimizer step, for a script that steps no torch optimizer.
    steps_from_output: str | None = None


def run_command_trial(trial: CommandTrial, batch_size: int,
                      run: Callable[..., Capped] = run_capped) -> TrialOutcome:
    """One trial of the command at `batch_size`: OOM when any of its processes went past the budget (even
    where the script caught the error and exited 0), ok when every process that stepped an optimizer
    reached the steps, an error otherwise (the command's last line), timeout when it ran past its time."""
    capped = run_steps(command_at(trial.command, batch_size), trial.memory_budget_bytes, trial.device,
                       trial.timeout_s, trial.steps, trial.steps_from_output, run)
    return classify(capped, batch_size, trial.steps, printed=bool(trial.steps_from_output))


def run_steps(command: list[str], memory_budget_bytes: int, device: str, timeout_s: float, steps: int,
              steps_from_output: str | None, run: Callable[..., Capped] = run_capped) -> Capped:
    """The command run once under the cap and ended after `steps` steps: its processes' optimizer steps
    (the cap's step hook), or the lines it prints that match `steps_from_output`."""
    if steps_from_output:
        return run(command, memory_budget_bytes, device, timeout_s, steps_from=(step_line(steps_from_output), steps))
    return run(command, memory_budget_bytes, device, timeout_s, {"MBTUNE_CAP_STEPS": str(steps)})


def step_line(pattern: str) -> re.Pattern[str]:
    """--steps-from-output's regular expression, refused in one line where it does not compile."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"--steps-from-output {pattern!r} is not a regular expression: {exc}",
                          hint="Name a line the script prints once a step, e.g. --steps-from-output 'step \\d+'.",
                          field="steps_from_output") from exc


NO_STEP_HINT = ("if it trains without a torch optimizer, name a line it prints once a step: --steps-from-output "
                "REGEX")


def classify(capped: Capped, batch_size: int, steps: int, *, printed: bool = False) -> TrialOutcome:
    """A capped run of the command as a probe trial (see run_command_trial); `printed`: its steps are the
    lines it printed (capped.printed_steps_s), not its processes' optimizer steps."""
    if printed:
        at = capped.printed_steps_s
        stepping = [[b - a for a, b in zip((0.0, *at), at, strict=False)]] if at else []
    else:
        stepping = [r["step_times_s"] for r in capped.reported if r.get("step_times_s")]
    done = max((len(times) for times in stepping), default=0)
    what = "printed step line(s)" if printed else "optimizer step(s)"
    tail = capped.tail
    common: dict[str, Any] = {"batch_size": batch_size, "peak_memory_bytes": capped.peak_bytes,
                              "budget_used_bytes": capped.peak_bytes, "wall_s": capped.wall_s, **passes_reached(capped)}
    if capped.out_of_memory:
        return TrialOutcome(status=OOM, error=capped.out_of_memory, error_kind=WORKLOAD_FAULT, error_tail=tail,
                            **{**common, **oom_figures_of(capped)})
    if capped.exit_code is None:
        made = f"{done} {what} of the {steps} a trial runs"
        hint = f": {NO_STEP_HINT}" if not done and not printed else ""
        return TrialOutcome(status=TIMEOUT, error=f"still running after {capped.timeout_s:g} s (--trial-timeout), "
                            f"{made}{hint}", error_kind=WORKLOAD_FAULT, error_tail=tail, **common)
    if capped.exit_code != 0:
        return TrialOutcome(status=ERROR, error=f"exit code {capped.exit_code}: {capped.last_line}",
                            error_kind=WORKLOAD_FAULT, error_tail=tail, **common)
    if not stepping or any(len(times) < steps for times in stepping):
        must = ("print its step line at least that often" if printed else
                "train (a torch optimizer's step) at least that long" if done else NO_STEP_HINT)
        return TrialOutcome(status=ERROR, error=f"the command ended after {done} {what} of the {steps} a trial "
                            f"runs: {must}", error_kind=WORKLOAD_FAULT, error_tail=tail, **common)
    # The slowest process sets the pace of a step; each process's step times, in order.
    per_step = tuple(max(times[i] for times in stepping) for i in range(steps))
    return TrialOutcome(status=OK, step_times_s=per_step, startup_s=max(0.0, capped.wall_s - sum(per_step[1:])),
                        **common)


def passes_reached(capped: Capped) -> dict[str, int]:
    """The evaluation passes and checkpoints the run reached (the most of any of its processes), where its
    processes' memory watches reported them."""
    watched = [r["memory"] for r in capped.reported if isinstance(r.get("memory"), dict)]
    if not watched:
        return {}
    return {"num_evaluations": max(m.get("num_evaluations", 0) for m in watched),
            "num_checkpoints": max(m.get("num_checkpoints", 0) for m in watched)}


def oom_figures_of(capped: Capped) -> dict[str, int]:
    """What the run's out-of-memory errors say the budget had to hold (device/oom_figures.py): each process's
    figures as its cap counted them, else as its error worded them (CUDA's allocator), else as the command
    printed them; of several, the largest need (live + requested). Empty where none names them."""
    keys = ("oom_requested_bytes", "oom_live_bytes")
    found = [{k: int(r[k]) for k in keys} if all(r.get(k) is not None for k in keys)
             else oom_fields(r.get("exception") or "") for r in capped.reported]
    if not any(found):
        found = [oom_fields(line) for line in capped.lines if "out of memory" in line or "allocate memory" in line]
    return max(filter(None, found), key=lambda f: f["oom_requested_bytes"] + f["oom_live_bytes"], default={})


def search_command(trial: CommandTrial, *, granularity: int = 1, max_batch: int | None = None,
                   margin: float = 0.15, confirm: int = 1, resolution: int | None = None,
                   on_trial: Callable[[TrialOutcome], None] | None = None,
                   run: Callable[..., Capped] = run_capped) -> SearchResult:
    """The probe's search (ceiling, first failing size, margin, verified safe batch) over trials of the
    command; `on_trial` sees each outcome as it comes."""
    from mbtune.probing.search import search_ceiling

    def one(size: int) -> TrialOutcome:
        outcome = run_command_trial(trial, size, run)
        if on_trial is not None:
            on_trial(outcome)
        return outcome

    return search_ceiling(one, granularity=granularity, max_batch=max_batch,
                          memory_budget_bytes=trial.memory_budget_bytes, margin=margin, confirm=confirm,
                          resolution=resolution, command=trial.command)
