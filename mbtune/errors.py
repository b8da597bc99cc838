"""The error tree and the one table of exit codes and hints that cli.main maps them through."""

from __future__ import annotations

# Exit codes, documented in the README.
EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_COULD_NOT_RUN = 3
EXIT_INTERRUPTED = 130


class Reported:
    """What cli.main needs of anything it reports as one line: an exit code, a hint and the detail."""

    exit_code = EXIT_COULD_NOT_RUN
    hint = ""

    def __init__(self, message: str, *, hint: str | None = None, detail: str = "") -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint
        self.detail = detail  # e.g. a trial's full error text; shown with MBTUNE_DEBUG=1

    def one_line(self) -> str:
        """The message plus what to do about it, on one line."""
        text = str(self).rstrip(".")
        return f"{text}. {self.hint}" if self.hint else f"{text}."


class MbtuneError(Reported, Exception):
    """Base of every error mbtune reports to the user as one line."""


class ConfigError(MbtuneError, ValueError):
    """A setting is out of range or malformed (bad input)."""

    exit_code = EXIT_BAD_INPUT


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
    hint = "Fix the workload; MBTUNE_DEBUG=1 shows the trial's traceback."


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
