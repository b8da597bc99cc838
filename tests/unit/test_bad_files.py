"""Every file mbtune reads is checked at the boundary: bad content is one ProfileError or ConfigError that
names the file and the field (trials[3].status), what it holds and what was expected; never a crash."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import mbtune.records as records
from mbtune.atomic import write_atomic
from mbtune.errors import ConfigError, ProfileError
from mbtune.probing.records import TrialOutcome
from mbtune.qualifying.specfile import read_spec
from mbtune.records import DeviceInfo
from mbtune.saving.profiles import SCHEMA_VERSION, Metadata, Profile, load_profile, write_profile
from mbtune.saving.store import JOURNAL_RECORDS, RunStore
from tests.unit.test_cli import Ran, mbtune_here
from tests.unit.test_records import sample_probe
from tests.unit.test_report import sweep_report

DELETE = object()  # set_at(..., DELETE) removes the key
HUGE = "x" * 100_000


def sample_profile() -> Profile:
    meta = Metadata(mbtune_version="0.1.0", torch_version="2.13.0", python_version="3.11", host="h", platform="p",
                    command_line="mbtune tune", created_at="now", allocator_settings={"MALLOC_ARENA_MAX": "2"})
    return Profile(schema_version=SCHEMA_VERSION, metadata=meta, probe=sample_probe(), sweep=sweep_report())


def set_at(data: Any, path: str, value: Any) -> Any:
    """Set (or with DELETE remove) the value at a dotted, indexed path such as probe.trials[1].status."""
    steps = [int(s) if s.isdigit() else s for s in re.findall(r"[^.\[\]]+", path)]
    target = data
    for step in steps[:-1]:
        target = target[step]
    if value is DELETE:
        del target[steps[-1]]
    else:
        target[steps[-1]] = value
    return data


def nested(depth: int, leaf: Any = 1) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def assert_one_short_line(message: str) -> None:
    assert "\n" not in message and len(message) < 800  # causes and lists of known keys whole; values echoed shortened, message


# --- profiles: a valid profile with one field made wrong ------------------------------------------------

PROFILE_FIELDS = [
    ("probe.ceiling", "lots", "expected an integer"),
    ("probe.ceiling", 3.5, "expected an integer"),
    ("probe.ceiling", True, "expected an integer"),
    ("probe.ceiling", None, "expected an integer"),
    ("probe.ceiling", [4], "expected an integer"),
    ("probe.ceiling", DELETE, "is missing"),
    ("probe.ceiling", HUGE, "expected an integer"),
    ("probe.margin", "15%", "expected a finite number"),
    ("probe.margin", float("nan"), "finite"),
    ("probe.margin", float("inf"), "finite"),
    ("probe.margin", float("-inf"), "finite"),
    ("probe.safe_batch_verified", "yes", "true or false"),
    ("probe.safe_batch_verified", 1, "true or false"),
    ("probe.workload", 7, "expected a string"),
    ("probe.workload_options", [], "expected an object"),
    ("probe.workload_options.layers", float("nan"), "finite"),
    ("probe.warnings", "w", "expected a list"),
    ("probe.warnings[0]", 1, "expected a string"),
    ("probe.device", DELETE, "is missing"),
    ("probe.device", "cpu", "expected an object"),
    ("probe.device.total_memory_bytes", "16GB", "expected an integer"),
    ("probe.memory_model", [], "expected an object"),
    ("probe.memory_model.fixed_bytes", "big", "expected a finite number"),
    ("probe.memory_model.resolved", "true", "true or false"),
    ("probe.trials", "x", "expected a list"),
    ("probe.trials", {"0": {}}, "expected a list"),
    ("probe.trials[0]", 5, "expected an object"),
    ("probe.trials[1].status", "exploded", "expected one of ok, oom"),
    ("probe.trials[1].status", "OK", "expected one of"),
    ("probe.trials[0].status", 3, "expected a string"),
    ("probe.trials[0].batch_size", "8", "expected an integer"),
    ("probe.trials[0].batch_size", DELETE, "is missing"),
    ("probe.trials[0].step_times_s", 0.1, "expected a list"),
    ("probe.trials[0].step_times_s[1]", "fast", "expected a finite number"),
    ("probe.trials[0].step_times_s[2]", float("nan"), "finite"),
    ("probe.trials[0].loss", float("inf"), "finite"),
    ("probe.trials[0].device", "cpu", "expected an object"),
    ("probe.trials[0].device.backend", None, "expected a string"),
    ("metadata", DELETE, "is missing"),
    ("metadata", "x", "expected an object"),
    ("metadata.host", 5, "expected a string"),
    ("metadata.allocator_settings.MALLOC_ARENA_MAX", 2, "expected a string"),
    ("sweep", 7, "expected an object"),
    ("sweep.results[0].status", "exploded", "expected one of ok, oom"),
    ("sweep.results[0].point", None, "expected an object"),
    ("sweep.results[0].point.num_ranks", "two", "expected an integer"),
    ("sweep.results[1].peak_memory_bytes[0]", "x", "an integer or null"),
    ("sweep.results[0].samples_per_s", "fast", "expected a finite number or null"),
    ("sweep.results[0].timeline", [{"rank": 0}], "timeline[0].stage is missing"),
    ("sweep.ranking[0]", "0", "expected an integer"),
    ("sweep.skipped[0].reason", 5, "expected a string"),
    ("sweep.skipped[0].point.schedule", ["gpipe"], "expected a string"),
]


@pytest.fixture
def profile_data(tmp_path) -> tuple[Path, dict]:
    path = tmp_path / "gpt.json"
    write_profile(path, sample_profile())
    return path, json.loads(path.read_text())


@pytest.mark.parametrize(("field", "value", "expected"), PROFILE_FIELDS,
                         ids=[f"{f}={str(v)[:12]}" for f, v, _ in PROFILE_FIELDS])
def test_a_wrong_field_names_the_file_the_field_and_what_was_expected(profile_data, field, value, expected):
    path, data = profile_data
    path.write_text(json.dumps(set_at(data, field, value)))  # json writes NaN as NaN, as a foreign writer might
    with pytest.raises(ProfileError) as caught:
        load_profile(path)
    message = str(caught.value)
    assert str(path) in message and field in message and expected in message
    assert_one_short_line(message)  # a 100 KB value is echoed shortened, not whole
    assert_one_short_line(caught.value.one_line())


# --- profiles: documents that are not a profile at all ------------------------------------------------

def _deep_inside(depth: int) -> str:
    return '{"schema_version": 1, "metadata": ' + "[" * depth + "]" * depth + "}"


PROFILE_DOCUMENTS = [
    ("truncated", b'{"schema_version": 1, "meta', "not readable JSON"),
    ("empty", b"", "not readable JSON"),
    ("not utf-8", b'{"schema_version": 1, "host": "\xff\xfe"}', "not readable JSON"),
    ("not json", b"schema_version = 1\n", "not readable JSON"),
    ("a list", b"[1, 2]", "not an mbtune profile"),
    ("a string", b'"profile"', "not an mbtune profile"),
    ("null", b"null", "not an mbtune profile"),
    ("no schema_version", b'{"metadata": {}}', "no schema_version"),
    ("schema_version text", b'{"schema_version": "1"}', "schema_version is \"1\", expected an integer"),
    ("schema_version true", b'{"schema_version": true}', "schema_version is true, expected an integer"),
    ("schema_version float", b'{"schema_version": 1.0}', "schema_version is 1.0, expected an integer"),
    ("schema_version huge", b'{"schema_version": 1' + b"0" * 400 + b"}", "newer than this mbtune reads"),
    ("absurd nesting", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("absurd nesting inside", _deep_inside(100_000).encode(), "nested too deeply"),
    ("deep nesting in a field", _deep_inside(200).encode(), "metadata is"),
    ("a number past int's digits", b'{"schema_version": ' + b"1" * 5000 + b"}", "not readable JSON"),
]


@pytest.mark.parametrize(("content", "message"), [(c, m) for _, c, m in PROFILE_DOCUMENTS],
                         ids=[name for name, _, _ in PROFILE_DOCUMENTS])
def test_a_document_that_is_no_profile_is_one_line(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ProfileError, match=re.escape(message)) as caught:
        load_profile(path)
    assert str(path) in str(caught.value)
    assert_one_short_line(caught.value.one_line())


def test_deep_nesting_in_free_form_content_is_refused_by_depth(profile_data):
    path, data = profile_data
    path.write_text(json.dumps(set_at(data, "probe.workload_options.layers", nested(200))))
    with pytest.raises(ProfileError, match=f"nested more than {records.MAX_DEPTH} levels deep") as caught:
        load_profile(path)
    assert "probe.workload_options.layers[0]" in str(caught.value)


def test_a_huge_value_is_echoed_shortened(profile_data):
    path, data = profile_data
    path.write_text(json.dumps(set_at(data, "probe.trials[1].status", HUGE)))
    with pytest.raises(ProfileError) as caught:
        load_profile(path)
    assert "probe.trials[1].status" in str(caught.value) and "..." in str(caught.value)
    assert len(str(caught.value)) < len(str(path)) + 250


def test_valid_profiles_round_trip_and_unknown_keys_are_ignored(profile_data):
    path, data = profile_data
    assert load_profile(path) == sample_profile()
    data["probe"]["added_by_a_newer_mbtune"] = [1, 2]
    path.write_text(json.dumps(data))
    assert load_profile(path) == sample_profile()


def test_a_diverged_loss_is_saved_as_unknown_so_the_profile_stays_readable(tmp_path):
    profile = sample_profile()
    trial = TrialOutcome(status="ok", batch_size=2, step_times_s=(0.1, 0.1), loss=float("nan"))
    diverged = Profile(schema_version=SCHEMA_VERSION, metadata=profile.metadata,
                       probe=replace(profile.probe, trials=(trial,)))
    path = tmp_path / "nan.json"
    write_profile(path, diverged)
    assert "NaN" not in path.read_text()
    assert load_profile(path).probe.trials[0].loss is None


def test_statuses_are_read_when_a_file_is_loaded_not_at_import(profile_data, monkeypatch):
    path, data = profile_data
    path.write_text(json.dumps(set_at(data, "probe.trials[1].status", "preempted")))
    with pytest.raises(ProfileError, match="status"):
        load_profile(path)
    monkeypatch.setattr(records, "STATUSES", (*records.STATUSES, "preempted"))
    assert load_profile(path).probe.trials[1].status == "preempted"


# --- journals --------------------------------------------------------------------------------------------

DEVICE = DeviceInfo(backend="cpu", name="Test CPU")
CONFIG = {"probe": {"workload": "mlp", "granularity": 1}}


def journal(tmp_path: Path, records_: list[dict]) -> Path:
    """A journal of a killed probe run holding these probe_trial records."""
    with RunStore(tmp_path, DEVICE, "mlp", kind="probe", config=CONFIG, resume=False) as store:
        for record in records_:
            store.record("probe_trial", record)
    assert store.journal_path.exists()
    return store.journal_path


def resume(tmp_path: Path) -> RunStore:
    with RunStore(tmp_path, DEVICE, "mlp", kind="probe", config=CONFIG, resume=True) as store:
        return store


def trial(**changes: Any) -> dict:
    return {**TrialOutcome(status="ok", batch_size=4, step_times_s=(0.2, 0.1)).to_dict(), **changes}


JOURNAL_LINES = [  # (line number to replace, its new content, what the message must say)
    (2, b"{not json", "line 2 is not JSON"),
    (2, b'{"kind": "probe_trial", "rec', "line 2 is not JSON"),
    (2, b"\xff\xfe{}", "line 2 is not JSON"),
    (2, b"[" * 100_000 + b"]" * 100_000, "line 2 is not JSON (nested too deeply"),
    (2, b"[1]", "line 2 is [1], expected an object"),
    (2, b'{"kind": "probe_trial"}', "line 2: record is null, expected an object"),
    (2, b'{"kind": "sweep_pointer", "record": {}}', "line 2: kind is \"sweep_pointer\", expected one of"),
    (2, b'{"kind": 3, "record": {}}', "line 2: kind is 3"),
    (2, json.dumps({"kind": "probe_trial", "record": trial(status="exploded")}).encode(), "line 2: record.status"),
    (2, json.dumps({"kind": "probe_trial", "record": trial(batch_size="4")}).encode(), "line 2: record.batch_size"),
    (2, json.dumps({"kind": "probe_trial", "record": trial(step_times_s=[float("nan")])}).encode(),
     "line 2: record.step_times_s[0]"),
    (2, json.dumps({"kind": "sweep_point", "record": {"point": {"schedule": 5}, "status": "ok"}}).encode(),
     "line 2: record.point.schedule"),
    (3, b'{"kind": "probe_trial", "record": {"status": "ok"}}', "line 3: record.batch_size is missing"),
    (1, b'{"journal": 2, "kind": "probe", "config": [1]}', "line 1: config is [1], expected an object"),
    (1, b'{"journal": 1, "kind": "probe", "con', "is damaged: its first line is not an mbtune journal's header"),
    (1, b'{"journal": 1, "kind": "probe", "config": {}}', "was written by an older mbtune (journal format 1; this"),
    (1, b'{"journal": 99, "mbtune": "9.0", "kind": "probe", "config": {}}',
     "was written by mbtune 9.0 (journal format 99; this mbtune"),
]


@pytest.mark.parametrize(("number", "content", "message"), JOURNAL_LINES)
def test_a_corrupt_journal_line_is_reported_with_its_number_and_field(tmp_path, number, content, message):
    path = journal(tmp_path, [trial(), trial(batch_size=8), trial(batch_size=16)])
    lines = path.read_bytes().split(b"\n")
    lines[number - 1] = content
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ProfileError, match=re.escape(message)) as caught:
        resume(tmp_path)
    assert str(path) in str(caught.value)
    assert_one_short_line(caught.value.one_line())
    resume_again = RunStore(tmp_path, DEVICE, "mlp", kind="probe", config=CONFIG, resume=False)
    with resume_again:  # the failed resume released its lock: a fresh run can start
        pass


def test_a_torn_last_line_is_ignored_and_the_rest_replayed(tmp_path):
    path = journal(tmp_path, [trial(), trial(batch_size=8)])
    path.write_bytes(path.read_bytes() + b'{"kind": "probe_trial", "record": {"status": "o')
    store = resume(tmp_path)
    assert [r["batch_size"] for r in store.replayed("probe_trial")] == [4, 8]


def test_a_complete_but_wrong_last_line_is_not_taken_for_a_torn_one(tmp_path):
    path = journal(tmp_path, [trial()])
    path.write_bytes(path.read_bytes() + json.dumps({"kind": "probe_trial", "record": trial(status="?")}).encode())
    with pytest.raises(ProfileError, match="line 3: record.status"):
        resume(tmp_path)


def test_journal_kinds_are_the_ones_the_runs_write():
    from mbtune.probing import run as probing
    from mbtune.serving import run as serving
    from mbtune.sweeping import run as sweeping

    assert set(JOURNAL_RECORDS) == {probing.PROBE_TRIAL, sweeping.SWEEP_POINT, sweeping.BALANCE, serving.SERVICE_CURVE,
                                    serving.SERVE_CONFIG}


# --- spec files ------------------------------------------------------------------------------------------

W = 'workload = "mlp"\ndevice = "cpu"\n'
SPECS = [
    (W + '[thresholds]\nmin_ceiling = "100"\n', '[thresholds] min_ceiling is "100", expected a finite number'),
    (W + "[thresholds]\nmax_best_bubble = nan\n", "[thresholds] max_best_bubble is NaN, expected a finite"),
    (W + "[thresholds]\nmin_ceiling = inf\n", "[thresholds] min_ceiling is Infinity"),
    (W + "[thresholds]\nmin_ceiling = true\n", "[thresholds] min_ceiling is true"),
    (W + f'[thresholds]\nmin_ceiling = "{HUGE}"\n', "[thresholds] min_ceiling is"),
    (W + "[thresholds]\nmin_speed = 1\n", "[thresholds] in the spec"),
    (W + "thresholds = 5\n", "thresholds is 5, expected a table"),
    (W + 'thresholds = "min_ceiling=5"\n', "thresholds is"),
    (W + '[sweep]\nschedules = "gpipe"\n', '[sweep] schedules is "gpipe", expected a list of strings'),
    (W + '[sweep]\nmicro_batches = [2, "4"]\n', '[sweep] micro_batches[1] is "4", expected an integer'),
    (W + "[sweep]\naccum = 1\n", "[sweep] accum is 1, expected a list of integers"),
    (W + '[sweep]\nstages = "2"\n', "[sweep] stages is \"2\", expected an integer"),
    (W + "[sweep]\nstages = true\n", "[sweep] stages is true"),
    (W + "[sweep]\nstages = 2.5\n", "[sweep] stages is 2.5"),
    (W + "[sweep]\nsteps = [3]\n", "[sweep] steps is [3]"),
    (W + f'[sweep]\nschedules = ["{HUGE}"]\n', "[sweep] schedules[0] is"),
    (W + "[probe]\ntrial_timeout = 5\ntrial-timeout = 6\n", "sets trial_timeout twice"),
    (W + "[sweep]\nnum_ranks = 2\n", "unknown key(s) num_ranks"),
    (W + "[sweep]\nstage = 2\n", "[sweep] in the spec"),
    (W + "sweep = [1]\n", "sweep is [1], expected a table"),
    (W + '[probe]\nmargin = "lots"\n', '[probe] margin is "lots", expected a finite number'),
    (W + "[probe]\nmargin = nan\n", "[probe] margin is NaN"),
    (W + "[probe]\ngranularity = 8.0\n", "[probe] granularity is 8.0, expected an integer"),
    (W + "[probe]\nmax_batch = [64]\n", "[probe] max_batch is [64]"),
    (W + '[probe]\nworkload = "gpt"\n', "[probe] in the spec"),
    (W + "probe = 3\n", "probe is 3, expected a table"),
    (W + "[options]\nlayers = [1]\n", "[options] layers is [1]"),
    (W + "[options.layers]\ndepth = 1\n", "[options] layers is {\"depth\": 1}"),
    (W + 'options = "layers=2"\n', "options is"),
    ("workload = 5\n", "workload is 5, expected a string"),
    ("[workload]\nname = 'mlp'\n", "workload is {\"name\": \"mlp\"}, expected a string"),
    (W.replace('"cpu"', '["cpu"]'), 'device is ["cpu"], expected a string'),
    (W.replace('"cpu"', f'"{HUGE}"'), "device is"),
    (W + "memory_budget = true\n", "memory_budget is true"),
    (W + "memory_budget = 0\n", "memory_budget=0 is out of range: expected a size above zero"),
    (W + "tolerance = [0.1]\n", "tolerance is [0.1]"),
    (W + "tolerance = nan\n", "tolerance=nan is out of range"),
    (W + 'repeats = "3"\n', "repeats is \"3\", expected an integer"),
    ("baseline = 7\n", "baseline is 7, expected a path"),
    (W + "speed = 3\n", "has unknown key(s) speed"),
    (W + "[probe]\nmargin = 0.7\n", "margin=0.7 is out of range"),
]


@pytest.mark.parametrize(("text", "message"), SPECS, ids=[m[:40] for _, m in SPECS])
def test_a_bad_spec_value_names_the_file_and_the_field(tmp_path, text, message):
    path = tmp_path / "qualify.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        read_spec(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    assert len(str(caught.value)) < 800  # a 100 KB value is echoed shortened, not whole (the known keys listed)
    assert_one_short_line(caught.value.one_line())


SPEC_DOCUMENTS = [
    (b'workload = "ml\xffp"\n', "is not UTF-8 text (byte 0xff at offset 14)"),
    (b"\xef\xbb\xbf\xff", "is not UTF-8 text"),
    (b"workload = [", "is not valid TOML"),
    (b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n", "is not valid TOML: nested too deeply"),
]


@pytest.mark.parametrize(("content", "message"), SPEC_DOCUMENTS)
def test_a_spec_that_is_no_toml_text_is_one_line(tmp_path, content, message):
    path = tmp_path / "qualify.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_spec(path)


def test_a_valid_spec_still_loads_with_lists_as_tuples(tmp_path):
    path = tmp_path / "qualify.toml"
    path.write_text(W + 'memory_budget = "512MiB"\n[options]\nlayers = 2\nact = "gelu"\n[probe]\nmargin = 0\n'
                    '[sweep]\nstages = 2\nschedules = ["gpipe"]\nmicro_batches = [2, 4]\naccum = [1]\n'
                    "[thresholds]\nmin_ceiling = 100\nmax_best_bubble = 0.5\n")
    spec = read_spec(path).spec
    assert spec.probe.margin == 0.0 and isinstance(spec.probe.margin, float)
    assert spec.probe.workload_options == (("act", "gelu"), ("layers", 2))
    assert spec.sweep.schedules == ("gpipe",) and spec.sweep.micro_batches == (2, 4)
    assert spec.thresholds == (("max_best_bubble", 0.5), ("min_ceiling", 100.0))


# --- the CLI: one line on stderr, exit 2, no traceback -----------------------------------------------------

def mbtune(cwd: Path, *args: str) -> Ran:
    return mbtune_here(*args, cwd=cwd)  # in this process; MBTUNE_DEBUG unset


CLI_PROFILES = [
    ("probe.trials[1].status", "exploded"),
    ("probe.ceiling", "lots"),
    ("probe.workload_options.layers", nested(500)),
]


@pytest.mark.parametrize(("field", "value"), CLI_PROFILES, ids=[f for f, _ in CLI_PROFILES])
def test_show_of_a_bad_profile_exits_2_with_one_line(profile_data, field, value):
    path, data = profile_data
    path.write_text(json.dumps(set_at(data, field, value)))
    result = mbtune(path.parent, "show", path.name)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert f"{path.name}: {field}" in result.stderr


def test_show_of_absurdly_nested_json_exits_2_with_one_line(tmp_path):
    (tmp_path / "deep.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    result = mbtune(tmp_path, "show", "deep.json")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "nested too deeply" in result.stderr


def test_qualify_with_a_bad_spec_exits_2_with_one_line(tmp_path):
    (tmp_path / "q.toml").write_text(W + '[sweep]\nschedules = "gpipe"\n')
    result = mbtune(tmp_path, "qualify", "--spec", "q.toml")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "[sweep] schedules" in result.stderr


# --- the one atomic writer -------------------------------------------------------------------------------

@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664), (0o027, 0o640)])
def test_the_written_file_mode_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "sub" / "file.json", "{}\n")
        write_atomic(tmp_path / "bytes.bin", b"\x00\x01")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "sub" / "file.json").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "bytes.bin").stat().st_mode) == mode
    assert (tmp_path / "bytes.bin").read_bytes() == b"\x00\x01"


def test_a_failed_replace_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "inside").write_text("a folder with a file cannot be replaced by a file")
    with pytest.raises(OSError):
        write_atomic(target, "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import mbtune.atomic as atomic

    target = tmp_path / "profile.json"
    write_atomic(target, "old")

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


def test_a_profile_write_failure_is_a_profile_error_and_leaves_nothing(tmp_path, monkeypatch):
    import mbtune.atomic as atomic

    def refuse(source: str, target: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(atomic.os, "replace", refuse)
    with pytest.raises(ProfileError, match="cannot write profile .*Permission denied"):
        write_profile(tmp_path / "gpt.json", sample_profile())
    assert list(tmp_path.iterdir()) == []


class _FullDisk:
    """A journal file whose disk fills after `room` more bytes: writes past it fail as a full disk does."""

    def __init__(self, handle: Any, room: int) -> None:
        self.handle, self.room = handle, room

    def write(self, text: str) -> int:
        if len(text) > self.room:
            self.handle.write(text[:self.room])  # the part that fitted, as a real write would leave it
            self.handle.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(text)
        return self.handle.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


def test_a_full_disk_under_the_journal_ends_the_run_keeping_what_finished_for_resume(tmp_path):
    store = RunStore(tmp_path, DEVICE, "mlp", kind="probe", config=CONFIG, resume=False)
    with pytest.raises(ProfileError) as full, store:
        store.record("probe_trial", trial())
        store._journal = _FullDisk(store._journal, room=40)
        store.record("probe_trial", trial(batch_size=8))
    assert full.value.exit_code == 3 and "No space left on device" in full.value.message
    assert "--resume" in full.value.hint
    replayed = resume(tmp_path).replayed("probe_trial")  # the cut line dropped, the finished trial kept
    assert [t["batch_size"] for t in replayed] == [4]
