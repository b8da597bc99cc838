"""Every case of the bad-input catalogue (tests/fixtures/bad_inputs.py): exit 2, one line on stderr naming
what is wrong, no traceback, nothing written."""

from __future__ import annotations

import signal

import pytest

from mbtune.cli import main
from tests.fixtures.bad_inputs import catalogue, make_files

CASES = catalogue()


def test_the_catalogue_is_large_and_covers_every_command():
    from tests.unit.test_cli import COMMANDS

    assert len(CASES) >= 150
    assert {args[0] for args, _ in CASES} >= set(COMMANDS) - {"version"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad-inputs")
    make_files(folder)
    return folder


@pytest.mark.parametrize("args, expect", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_exit_2_one_line_nothing_written(args, expect, inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MBTUNE_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    before = sorted(p.name for p in inputs.iterdir())
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with pytest.raises(SystemExit) as ended:
            main([a.replace("{dir}", str(inputs)) for a in args])
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert ended.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert expect.replace("{dir}", str(inputs)).lower() in lines[0].lower(), lines[0]
    # Every cause whole; what the user typed (here the test's folder, as long as pytest makes it) aside, short.
    assert len(lines[0].replace(str(inputs), "{dir}")) <= 240
    assert list(tmp_path.iterdir()) == []  # no profile, journal or lock
    assert sorted(p.name for p in inputs.iterdir()) == before
