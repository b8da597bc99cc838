"""The one validation helper, output-path checks and one-line error text."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest

from mbtune.cli.outputs import check_writable
from mbtune.errors import ONE_LINE_CHARS, ConfigError, MbtuneError
from mbtune.probing.config import ProbeConfig
from mbtune.sweeping.config import SweepConfig
from mbtune.validation import check_types, require_unique, short


@dataclass(frozen=True, kw_only=True)
class Sample:
    count: int = 1
    share: float = 0.5
    name: str = "x"
    flag: bool = False
    sizes: tuple[int, ...] = (1,)
    pair: tuple[str, float] = ("a", 1.0)
    maybe: int | None = None


@pytest.mark.parametrize("field, value, expected", [
    ("count", 2.5, "an integer"), ("count", True, "an integer"), ("count", "3", "an integer"),
    ("share", "0.1", "a finite number"), ("share", float("nan"), "a finite number"),
    ("share", float("inf"), "a finite number"), ("name", 3, "text"), ("flag", 1, "true or false"),
    ("sizes", [1, 2], "a list"), ("sizes", (1, "2"), "an integer"), ("pair", ("a",), "2 items"),
    ("pair", ("a", "b"), "a finite number"), ("maybe", 1.5, "an integer"),
])
def test_wrong_types_name_the_field_and_what_is_expected(field, value, expected):
    with pytest.raises(ConfigError) as caught:
        check_types(Sample(**{field: value}))
    assert caught.value.field == field and expected in str(caught.value)


def test_right_types_pass():
    check_types(Sample(count=3, share=1, maybe=None, sizes=(), pair=("b", 2)))


@pytest.mark.parametrize("kwargs, field", [
    ({"margin": "0.1"}, "margin"), ({"granularity": 2.5}, "granularity"), ({"trial_timeout_s": float("inf")},
                                                                          "trial_timeout_s"),
    ({"trial_timeout_s": 1e300}, "trial_timeout_s"), ({"load_timeout_s": 0}, "load_timeout_s"),
    ({"confirm": True}, "confirm"), ({"workload": 3}, "workload"),
])
def test_probe_config_type_and_bound_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as caught:
        ProbeConfig(**kwargs)
    assert caught.value.field == field
    assert "--" not in str(caught.value) and "Fix" not in caught.value.one_line()  # flags belong to the CLI


@pytest.mark.parametrize("kwargs, field", [
    ({"schedules": ("gpipe", "gpipe")}, "schedules"), ({"micro_batches": (2, 2)}, "micro_batches"),
    ({"grad_accum_steps": (1, 1)}, "grad_accum_steps"), ({"point_timeout_s": float("nan")}, "point_timeout_s"),
    ({"num_ranks": 0}, "num_ranks"), ({"stages_per_rank": 0}, "stages_per_rank"),
])
def test_sweep_config_refuses_duplicates_and_bad_values(kwargs, field):
    with pytest.raises(ConfigError) as caught:
        SweepConfig(**kwargs)
    assert caught.value.field == field


def test_unique_lists_pass_and_duplicates_name_the_entry():
    require_unique((1, 2, 4), "micro_batches")
    with pytest.raises(ConfigError, match="names 4 twice"):
        require_unique((4, 2, 4), "micro_batches")


def test_huge_values_are_not_echoed_whole():
    assert len(short("x" * 100_000)) <= 60
    with pytest.raises(ConfigError) as caught:
        ProbeConfig(workload_options=(("k", "v" * 100_000),), margin="x" * 100_000)
    assert len(caught.value.one_line()) <= ONE_LINE_CHARS + 10


def test_one_line_never_cuts_the_cause_and_keeps_the_hint():
    cause = "ModuleNotFoundError: No module named " + "'userpkg." + "n" * 200 + "'"
    line = MbtuneError(f"cannot import workload module: {cause}", hint="Do this.").one_line()
    assert "\n" not in line and cause in line and line.endswith("Do this.")


def test_one_line_of_many_lines_keeps_the_first_and_last_whole_and_says_where_the_rest_is():
    last = "RuntimeError: Expected 2D input but got input of size[1, 64, 64] " + "x" * 100
    error = MbtuneError("\n".join(["the trial at batch 4 failed", *("  frame" for _ in range(40)), last]),
                        hint="Do this.")
    line = error.one_line()
    assert "\n" not in line and line.startswith("the trial at batch 4 failed | ... | ") and last in line
    assert line.endswith("Do this. Run with MBTUNE_DEBUG=1 for the whole text.")
    assert len(line) < ONE_LINE_CHARS + len(last)


def test_str_of_an_error_holds_its_hint_once():
    error = MbtuneError("could not start a process to load workload 'w:f'", hint="Install the package.")
    assert str(error) == "could not start a process to load workload 'w:f'. Install the package."
    assert error.message == "could not start a process to load workload 'w:f'"
    assert error.one_line().count("Install the package.") == 1
    assert str(MbtuneError("no hint here")) == "no hint here"


def test_check_writable(tmp_path):
    check_writable(tmp_path / "new" / "deeper" / "out.json", flag="-o")  # missing folders are made later
    check_writable(tmp_path / "plots", flag="--plot", folder=True)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for bad, folder in ((afile, True), (tmp_path, False), (afile / "x.json", False)):
        with pytest.raises(ConfigError, match="^--junit: "):  # every error about a path names its flag
            check_writable(bad, flag="--junit", folder=folder)
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="not writable"):
            check_writable(locked / "out.json", flag="-o")


def test_environment_defaults_reach_the_options():
    from tests.unit.test_cli import mbtune_here

    device = mbtune_here("probe", "-w", "mlp", env={"MBTUNE_DEVICE": "tpu"})
    assert device.returncode == 2 and "device 'tpu'" in device.stderr
    folder = mbtune_here("probe", "-w", "mlp", "-d", "cpu", env={"MBTUNE_PROFILES_DIR": "/dev/null/nope"})
    assert folder.returncode == 2 and "/dev/null" in folder.stderr


def test_an_internal_error_is_one_line_with_the_saved_traceback(monkeypatch, capsys):
    import re
    import signal

    import mbtune.cli as cli
    import mbtune.cli.ci as commands

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in mbtune")

    monkeypatch.delenv("MBTUNE_DEBUG", raising=False)
    monkeypatch.setattr(commands, "check_format", broken)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with pytest.raises(SystemExit) as ended:
            cli.main(["show", "whatever.json"])
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    err = capsys.readouterr().err
    assert ended.value.code == 3 and len(err.strip().splitlines()) == 1
    [path] = re.findall(r"traceback is in (\S+);", err)
    text = open(path).read()
    os.unlink(path)
    assert "RuntimeError: a bug in mbtune" in text and "Traceback" in text


def test_quiet_verbose_and_output(tmp_path):
    from tests.unit.test_cli import mbtune_here

    target = tmp_path / "deeper" / "probe.json"
    args = ["probe", "-w", "mlp", "-O", "layers=1", "-O", "width=16", "-d", "cpu", "--max-batch", "8", "--no-save"]
    run = mbtune_here("-q", "-v", *args, "-f", "json", "-o", str(target))  # no progress lines, but the log
    assert run.returncode == 0 and "trial 1" not in run.stderr and run.stdout == ""
    assert "batch 8: ok" in run.stderr  # the log: the predicted ceiling (--max-batch) first
    assert json.loads(target.read_text())["ceiling"] == 8


@pytest.mark.parametrize(("make", "field"), [
    (lambda: ProbeConfig(granularity=2**63 - 1), "granularity"),
    (lambda: ProbeConfig(memory_budget_bytes=10**23 * 2**30), "memory_budget_bytes"),
    (lambda: ProbeConfig(max_batch=2**40 + 1), "max_batch"),
    (lambda: SweepConfig(micro_batch_size=(2, 2**41)), "micro_batch_size"),
    (lambda: SweepConfig(num_ranks=2**17), "num_ranks"),
    (lambda: SweepConfig(measured_steps=2**63 - 1), "measured_steps"),
])
def test_absurd_numbers_are_refused_naming_the_field(make, field):
    with pytest.raises(ConfigError) as caught:
        make()
    assert caught.value.field == field and "at most" in str(caught.value)


def test_sizes_take_exponents_and_refuse_more_than_a_pib():
    from mbtune.units import parse_bytes

    assert parse_bytes("2e9") == 2_000_000_000 and parse_bytes("1.5e3MiB") == 1500 * 2**20
    with pytest.raises(ConfigError, match="above 1 PiB"):
        parse_bytes("1e23GiB", name="--memory-budget", at_most=2**50)


def test_the_default_load_timeout_is_cut_to_a_shorter_trial_or_point_timeout():
    from mbtune.settings import DEFAULT_LOAD_TIMEOUT_S

    assert ProbeConfig().load_timeout_s == DEFAULT_LOAD_TIMEOUT_S
    assert ProbeConfig(trial_timeout_s=5).load_timeout_s == 5
    assert ProbeConfig(trial_timeout_s=5, load_timeout_s=30).load_timeout_s == 30  # as the user set it
    assert SweepConfig(point_timeout_s=4).load_timeout_s == 4


def test_a_budget_above_the_processs_address_space_limit_is_refused(monkeypatch):
    import resource

    from mbtune.device import cpu

    monkeypatch.setattr(resource, "getrlimit", lambda which: (10 * 2**30, resource.RLIM_INFINITY))
    monkeypatch.setattr(cpu, "read_status_bytes", lambda *keys: {"VmSize": 2 * 2**30})
    cpu.check_budget_fits_limit(8 * 2**30)  # fits exactly
    with pytest.raises(ConfigError) as caught:
        cpu.check_budget_fits_limit(9 * 2**30)
    assert caught.value.field == "memory_budget_bytes" and "ulimit -v" in str(caught.value)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    cpu.check_budget_fits_limit(2**49)  # no limit
