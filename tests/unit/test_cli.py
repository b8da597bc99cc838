"""The CLI: help everywhere, README coverage, bad input exits 2 with one line and no traceback."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mbtune.cli import app, main

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = sorted(c.name or c.callback.__name__ for c in app.registered_commands)


# Commands run from a scratch folder, so their default profiles/ never lands in the checkout; the
# checkout stays importable (mbtune itself and the tests' fixture workloads) through PYTHONPATH.
SCRATCH = Path(tempfile.mkdtemp(prefix="mbtune-cli-"))


def mbtune(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m mbtune args` in a fresh interpreter: main()'s real exit path, signals and trial processes."""
    full_env = {**os.environ, "COLUMNS": "120", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "mbtune", *args], capture_output=True, text=True, env=full_env,
                          cwd=SCRATCH, timeout=300)


@dataclass(frozen=True)
class Ran:
    """What a run of main() in this process gave: its exit code and what it wrote to stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


def mbtune_here(*args: str, env: dict[str, str | None] | None = None, cwd: Path = SCRATCH) -> Ran:
    """`mbtune args` through main() in this process, from `cwd`, with `env` over os.environ (None unsets):
    the same exit code and streams as `mbtune` above without an interpreter and torch start-up per call.
    MBTUNE_DEBUG is unset unless `env` sets it. What a run changes in this process (the working folder, the
    environment, signal handlers, the 'mbtune' logger that -v adds to) is put back afterwards."""
    logger = logging.getLogger("mbtune")
    logged = logger.handlers[:], logger.level
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    folder = os.getcwd()
    code: int | str | None = 0
    try:
        os.chdir(cwd)
        with CliRunner().isolation(env={"COLUMNS": "120", "MBTUNE_DEBUG": None, **(env or {})}) as (out, err, _):
            try:
                main(list(args))
            except SystemExit as exc:
                code = exc.code
            if isinstance(code, str):  # as the interpreter does with sys.exit("message")
                sys.stderr.write(code + "\n")
            sys.stdout.flush()
            sys.stderr.flush()
            stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    finally:
        os.chdir(folder)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        logger.handlers[:] = logged[0]
        logger.setLevel(logged[1])
    return Ran(returncode=code if isinstance(code, int) else 0 if code is None else 1, stdout=stdout, stderr=stderr)


def test_version():
    result = mbtune("--version")
    assert result.returncode == 0 and result.stdout.startswith("mbtune ")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_and_option_has_help(command):
    from typer.main import get_command

    click_command = get_command(app).commands[command]  # type: ignore[attr-defined]
    assert click_command.help, f"{command} has no help text"
    for param in click_command.params:
        if param.param_type_name == "option":
            assert getattr(param, "help", None), f"{command} {param.opts} has no help"
        else:
            assert getattr(param, "help", None), f"{command} argument {param.name} has no help"
    assert mbtune_here(command, "--help").returncode == 0


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_is_in_the_readme(command):
    assert f"mbtune {command}" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["probe", "-w", "bert", "-d", "cpu"], "unknown workload 'bert'"),
    (["probe", "-w", "mlp", "-d", "gpu0"], "device 'gpu0' is not recognised"),
    (["probe", "-w", "mlp", "--margin", "0.7"], "--margin 0.7 is out of range"),
    (["probe", "-w", "mlp", "--granularity", "0"], "--granularity 0 is out of range"),
    (["probe", "-w", "mlp", "--max-batch", "-3"], "--max-batch -3 is out of range"),
    (["probe", "-w", "mlp", "--memory-budget", "lots"], "--memory-budget 'lots' is not a size"),
    (["probe", "-w", "mlp", "-O", "depth=3"], "has no option depth"),
    (["probe", "-w", "mlp", "--format", "xml"], "--format 'xml' is not one of"),
    (["show", "/nonexistent/profile.json"], "does not exist"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    result = mbtune_here(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not list(SCRATCH.glob("profiles/**/*.journal.jsonl*"))  # nothing measured, nothing left behind


def test_missing_cuda_device_is_bad_input():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    result = mbtune_here("probe", "-w", "mlp", "-d", "cuda:0")
    assert result.returncode == 2
    assert "no CUDA device is visible" in result.stderr and "Traceback" not in result.stderr


def test_bad_input_through_the_console_entry_is_one_line_exit_2():
    result = mbtune("show", "/nonexistent/profile.json")
    assert result.returncode == 2, result.stderr
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_debug_shows_the_traceback_and_keeps_the_exit_code():
    result = mbtune("probe", "-w", "bert", "-d", "cpu", env={"MBTUNE_DEBUG": "1"})
    assert result.returncode == 2 and "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: unknown workload 'bert'")
