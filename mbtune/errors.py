"""The error tree and the one table of exit codes and hints that cli.main maps them through."""

from __future__ import annotations

# Exit codes, documented in the README.
EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_COULD_NOT_RUN = 3
EXIT_INCONCLUSIVE = 4  # qualify: the verdict could not be decided within the measured noise
EXIT_INTERRUPTED = 130  # SIGINT; SIGTERM and SIGHUP exit 128 + their number (143, 129), as shells report them
ONE_LINE_CHARS = 160


class Reported(BaseException):
    """What cli.main needs of anything it reports as one line: an exit code, a hint and the detail.

    str() of one is its message and its hint, so a script that lets one escape shows what to do about it;
    `message` is the message alone."""

    exit_code = EXIT_COULD_NOT_RUN
    hint = ""

    def __init__(self, message: str, *, hint: str | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.message = message
        if hint is not None:
            self.hint = hint
        self.detail = detail  # e.g. a trial's full error text; shown with MBTUNE_DEBUG=1

    def __str__(self) -> str:
        message = self.message.rstrip()
        if not self.hint or self.hint in message:
            return message
        return f"{message.rstrip('.')}. {self.hint}"

    def one_line(self) -> str:
        """The message plus what to do about it, on one line. The message is never cut inside a line: its
        cause (a user's exception text, a torch error, a module name) comes through whole; only what the
        user typed is shortened, where the message is built. A message of many lines longer than
        ONE_LINE_CHARS keeps its first and last lines (what failed, and why) and says where the rest is."""
        lines = [line.strip() for line in self.message.splitlines() if line.strip()]
        hint = self.hint
        if len(lines) > 2 and len(" | ".join(lines)) > ONE_LINE_CHARS:
            lines = [lines[0], "...", lines[-1]]
            if WHOLE_TEXT not in hint:
                hint = f"{hint} {WHOLE_TEXT[0].upper()}{WHOLE_TEXT[1:]}.".strip()
        text = " | ".join(lines).rstrip(".")
        return f"{text}. {hint}" if hint else f"{text}."


WHOLE_TEXT = "run with MBTUNE_DEBUG=1 for the whole text"


class MbtuneError(Reported, Exception):
    """Base of every error mbtune reports to the user as one line."""


class ConfigError(MbtuneError, ValueError):
    """A setting is out of range or malformed (bad input). `field` names the config field when one is at
    fault, so the CLI can name its flag instead."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, hint: str | None = None, detail: str = "", field: str | None = None,
                 given: str = "", expected: str = "") -> None:
        super().__init__(message, hint=hint, detail=detail)
        self.field, self.given, self.expected = field, given, expected


class WorkloadError(MbtuneError, ValueError):
    """A workload name cannot be resolved or its factory breaks the contract (bad input)."""

    exit_code = EXIT_BAD_INPUT
    hint = "Built-in workloads: gpt, mlp; or pass package.module:factory."


class DeviceError(MbtuneError):
    """The requested device is malformed (bad input) or not present on this machine."""

    exit_code = EXIT_BAD_INPUT
    hint = "Use --device auto, cpu, cuda or cuda:N with N below the number of visible GPUs."


class BudgetTooSmallError(MbtuneError):
    """Even the smallest batch runs out of memory under the budget."""

    exit_code = EXIT_BAD_INPUT
    hint = "Raise --memory-budget or choose a smaller workload."


class WorkloadBrokenError(MbtuneError):
    """The workload fails at the smallest batch for a reason other than memory (bad input)."""

    exit_code = EXIT_BAD_INPUT
    hint = "Fix the workload; MBTUNE_DEBUG=1 shows the traceback."


class WorkloadLoadError(MbtuneError):
    """Loading the workload (importing its module, calling its factory) hung, exited or crashed its process."""

    exit_code = EXIT_COULD_NOT_RUN
    hint = "Rerun with MBTUNE_DEBUG=1 to see the loading process's traceback."


class NothingMeasuredError(MbtuneError):
    """A run ended without one usable result (every point failed or was skipped); what it did is saved."""

    exit_code = EXIT_COULD_NOT_RUN
    hint = "See the table for each point's cause; MBTUNE_DEBUG=1 shows the whole error text."


class TrialFailedError(MbtuneError):
    """A trial failed for a reason other than memory, so the run cannot complete."""

    exit_code = EXIT_COULD_NOT_RUN
    hint = "Rerun with MBTUNE_DEBUG=1 to see the trial's traceback."


class UnsafeBatchError(MbtuneError):
    """No batch size above one granule passed its verification runs: memory near this budget is unstable."""

    exit_code = EXIT_COULD_NOT_RUN
    hint = "Raise --memory-budget or widen --margin; memory near this budget varies from run to run."


class ProfileError(MbtuneError):
    """A profile file is missing, corrupt, of an unknown schema, or cannot be written."""

    exit_code = EXIT_BAD_INPUT


class Interrupted(Reported, BaseException):
    """The user pressed Ctrl-C (SIGINT); what finished is kept. Like KeyboardInterrupt it is no Exception, so
    the handler raising it wherever the main thread happens to be (say, in NVML's probe for a driver, which
    turns any Exception into "NVML unavailable") cannot have it swallowed on the way up."""

    exit_code = EXIT_INTERRUPTED
    hint = "Finished trials are journaled: rerun the same command with --resume to continue."

    def __init__(self, message: str = "interrupted", *, exit_code: int = EXIT_INTERRUPTED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class HarnessError(MbtuneError):
    """mbtune could not run a trial at all: its worker process died before the trial began. The workload was
    never reached, so nothing is known about it."""

    exit_code = EXIT_COULD_NOT_RUN
    hint = "MBTUNE_DEBUG=1 shows the worker's last output."


class NonFiniteLossError(ArithmeticError):
    """A training step's loss is NaN or infinite. Raised inside a trial or rank process, which ends with the
    nonfinite status; it never reaches the command line."""

    def __init__(self, loss: float, step: int) -> None:
        super().__init__(f"the loss is {loss} at step {step}: training diverged, or the workload computes a "
                         "non-finite loss (check its loss function, data and learning rate)")
        self.loss, self.step = loss, step


class RunLockedError(MbtuneError):
    """Another mbtune run holds the profile this run would write."""

    hint = "Wait for it to finish, or write elsewhere with --profiles-dir."
