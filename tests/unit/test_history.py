"""Qualification over time: change points against known steps and scipy's own t-test, the history file
(numbering, locking, refusals, schema), the machine's state (a fake NVML, fake /proc and /sys) and how a
verdict names a step and a state."""

from __future__ import annotations

import json
import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from mbtune.device.machine_state import StateSampler, steal_pct, steal_ticks, throttle_names
from mbtune.errors import ProfileError
from mbtune.qualifying.changes import change_points
from mbtune.qualifying.history import add_run, history_path, latest_changes, read_histories, read_history
from mbtune.qualifying.records import FAIL, INCONCLUSIVE, PASS, Check, Verdict
from mbtune.qualifying.run import with_history
from mbtune.qualifying.state import state_check, throttle_check
from mbtune.records import GpuState, MachineState
from tests.unit.test_cli import mbtune_here as mbtune

BEST = "best throughput (samples/s)"


def noisy(n: int, sd: float, seed: int, level: float = 100.0) -> np.ndarray:
    return level * np.exp(np.random.default_rng(seed).normal(0.0, sd, n))


# Change points


def test_no_step_is_found_in_noise_alone():
    found = [change_points(noisy(100, 0.03, seed)) for seed in range(20)]
    assert sum(bool(f) for f in found) <= 1  # p 0.001 per test; a few tests per series


def test_an_8_percent_step_is_found_where_it_is_with_its_size():
    series = noisy(60, 0.02, 7)
    series[40:] *= 0.92
    [shift] = change_points(series)
    assert abs(shift.index - 40) <= 2
    assert shift.change == pytest.approx(-0.08, abs=0.02)
    assert shift.p_value < 0.001


def test_the_size_and_interval_are_scipys_t_test_between_the_two_sides():
    series = np.array([100.0, 101, 99, 100.5, 99.5, 100, 90, 91, 89, 90.5, 89.5, 90])
    [shift] = change_points(series)
    assert shift.index == 6
    before, after = np.log(series[:6]), np.log(series[6:])
    result = stats.ttest_ind(after, before)
    low, high = result.confidence_interval(0.95)
    diff = after.mean() - before.mean()
    assert shift.change == pytest.approx(math.expm1(diff))
    assert shift.half == pytest.approx(math.exp(diff) * math.expm1((high - low) / 2))
    assert shift.p_value == pytest.approx(result.pvalue)


def test_a_step_between_two_constant_levels_is_exact():
    [shift] = change_points([58] * 6 + [57] * 4)
    assert shift.index == 6 and shift.p_value == 0.0 and shift.half == 0.0
    assert change_points([58] * 10) == []


def test_too_short_a_series_names_nothing():
    assert change_points([100, 100, 100, 90, 90]) == []


# The history file


def verdict(best: float, *, started: str = "2026-12-07T02:00:00", state: MachineState | None = None) -> Verdict:
    return Verdict(checks=(Check(name="probe ran", status=PASS),
                           Check(name=BEST, status=PASS, measured=best, spread_pct=1.5),
                           Check(name="throughput p1", status=PASS, measured=best, gating=False)),
                   started_at=started, state=state)


def test_runs_are_numbered_and_kept_with_their_checks(tmp_path):
    path = tmp_path / "history" / "host" / "b.json"
    for i in range(3):
        history = add_run(path, verdict(100.0 + i), against="b.json", host="host")
    assert [r.run for r in history.runs] == [1, 2, 3]
    kept = read_history(path)
    assert kept == history
    assert kept.runs[2].checks[1].measured == 102.0 and kept.runs[2].checks[2].gating is False


def test_two_writers_at_once_lose_no_run(tmp_path):
    path = tmp_path / "h.json"

    def write() -> None:
        for _ in range(15):
            add_run(path, verdict(100.0), against="b", host="host")

    threads = [threading.Thread(target=write) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.run for r in read_history(path).runs] == list(range(1, 31))


@pytest.mark.parametrize("text, says", [
    ("{not json", "is not readable JSON"),
    ('{"runs": []}', "is not an mbtune qualification history"),
    ('{"history_version": 9, "machine": "m", "baseline": "b"}', "written by a newer mbtune"),
    ('{"history_version": 1, "machine": "m", "baseline": "b", "runs": [{"run": "x"}]}', "runs[0]"),
])
def test_a_damaged_or_newer_history_is_refused_and_left_as_it_is(tmp_path, text, says):
    path = tmp_path / "h.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=says.replace("[", r"\[").replace("]", r"\]")):
        add_run(path, verdict(100.0), against="b")
    assert path.read_text() == text


def test_a_history_follows_the_baseline_not_its_path(tmp_path):
    meta = SimpleNamespace(metadata=SimpleNamespace(created_at="2026-12-01T00:00:00", host="lab-1"))
    other = SimpleNamespace(metadata=SimpleNamespace(created_at="2026-12-02T00:00:00", host="lab-1"))
    here = history_path(tmp_path, meta, "/ci/ws-1/profiles/cpu/gpt.json", host="node 7")
    there = history_path(tmp_path, meta, "/ci/ws-2/profiles/cpu/gpt.json", host="node 7")
    assert here == there and here.parent.name == "node-7"
    assert history_path(tmp_path, other, "/ci/ws-1/profiles/cpu/gpt.json", host="node 7") != here


def test_the_history_file_matches_its_shipped_schema(tmp_path):
    import jsonschema

    from mbtune.qualifying.history import history_schema, shipped_history_schema

    assert shipped_history_schema() == history_schema()
    state = MachineState(num_samples=2, load_avg_1m_median=0.5, gpus=(GpuState(uuid="GPU-0", throttle_shares={"idle": 0.5}),),
                         versions={"torch": "2.13.0"})
    path = tmp_path / "h.json"
    add_run(path, verdict(100.0, state=state), against="b")
    jsonschema.Draft202012Validator(history_schema()).validate(json.loads(path.read_text()))


# A verdict with a history


def test_a_step_for_the_worse_is_named_in_the_verdict_and_does_not_gate(tmp_path):
    path = tmp_path / "h.json"
    figures = [100.0, 101, 99, 100.5, 99.5, 100, 100.2, 99.8, 92, 91.5, 92.5, 92]
    for i, best in enumerate(figures):
        shown = with_history(verdict(best, started=f"2026-12-{i + 1:02d}T02:00:00"), path, "b.json")
    assert shown.run == 12 and shown.history == str(path)
    [change] = shown.changes
    assert change.check == BEST and change.run == 9
    assert change.words.startswith(f"{BEST} changed at run 9 (2026-12-09): -8.")
    named = shown.checks[-1]
    assert named.name == f"history: {BEST}" and named.status == FAIL and not named.gating
    assert shown.status == PASS  # a step is named, never failed on, by the history alone


def test_no_step_in_a_steady_history(tmp_path):
    path = tmp_path / "h.json"
    for best in noisy(12, 0.01, 3):
        shown = with_history(verdict(float(best)), path, "b.json")
    assert shown.changes == () and latest_changes(read_history(path)) == ()


# The machine's state


class FakeNvml:
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 0, 1, 0
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 0, 1, 0

    def __init__(self) -> None:
        self.reads = 0

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlSystemGetDriverVersion(self): return b"550.54"
    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, index): return index
    def nvmlDeviceGetUUID(self, handle): return b"GPU-abc"
    def nvmlDeviceGetName(self, handle): return "Fake H100"
    def nvmlDeviceGetMaxClockInfo(self, handle, kind): return 1980
    def nvmlDeviceGetEnforcedPowerLimit(self, handle): return 700_000
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle): return 5
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle): return 16
    def nvmlDeviceGetClockInfo(self, handle, kind): return 1410 if kind == self.NVML_CLOCK_SM else 2619
    def nvmlDeviceGetTemperature(self, handle, kind): return 84
    def nvmlDeviceGetPowerUsage(self, handle): return 650_000
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle): return 4
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle): return 16

    def nvmlDeviceGetTotalEccErrors(self, handle, kind, counter):
        raise RuntimeError("Not Supported")  # a GPU without ECC: unknown, not an error

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        self.reads += 1
        return 0x20 | 0x4 if self.reads % 2 else 0x4  # thermal slowdown in every other sample, power cap always


def fake_machine(tmp_path, steal: int) -> tuple[str, str]:
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    proc.mkdir()
    (proc / "stat").write_text(f"cpu  100 0 50 800 0 0 0 {steal} 0 0\ncpu0 1 0 0 0\ncpu1 1 0 0 0\n")
    freq = sys_root / "devices/system/cpu/cpu0/cpufreq"
    freq.mkdir(parents=True)
    (freq / "scaling_cur_freq").write_text("2450000\n")
    return str(proc), str(sys_root)


def test_the_sampler_reads_gpu_state_through_nvml_and_the_cpu_through_proc(tmp_path):
    proc, sys_root = fake_machine(tmp_path, steal=10)
    with StateSampler(gpus=True, nvml=FakeNvml(), interval_s=0.01, proc=proc, sys_root=sys_root,
                      versions={"torch": "2.13.0"}) as sampler:
        pass
    state = sampler.state()
    assert state.cpu_mhz_median == 2450.0 and state.versions == {"torch": "2.13.0", "driver": "550.54"}
    [gpu] = state.gpus
    assert (gpu.uuid, gpu.name, gpu.sm_clock_mhz_median, gpu.sm_clock_mhz_max) == ("GPU-abc", "Fake H100", 1410, 1980)
    assert (gpu.power_limit_w, gpu.temperature_c_max, gpu.pcie_generation, gpu.pcie_max_generation) == (700, 84, 4, 5)
    assert gpu.ecc_uncorrected is None
    assert gpu.throttle_shares["power cap"] == 1.0
    assert gpu.throttle_shares["software thermal slowdown"] == pytest.approx(0.5, abs=0.34)


def test_no_nvml_leaves_the_cpu_state(tmp_path):
    proc, sys_root = fake_machine(tmp_path, steal=0)

    class Absent:
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    with StateSampler(gpus=True, nvml=Absent(), interval_s=0.01, proc=proc, sys_root=sys_root) as sampler:
        pass
    state = sampler.state()
    assert state.gpus == () and state.cpu_mhz_median == 2450.0


def test_steal_and_throttle_words_from_known_values():
    text = "cpu  100 0 50 800 10 0 0 40 0 0\n"
    assert steal_ticks(text) == (40, 1000)
    assert steal_pct((40, 1000), (90, 2000)) == 5.0
    assert throttle_names(0x40 | 0x1 | 0x400) == ("idle", "hardware thermal slowdown", "reason 0x400")


def gpu(sm: float, shares: dict[str, float]) -> MachineState:
    return MachineState(gpus=(GpuState(uuid="GPU-a", name="H100", num_samples=40, sm_clock_mhz_median=sm,
                                       throttle_shares=shares),))


def test_a_throttling_gpu_fails_its_own_check_and_a_power_cap_does_not():
    hot = throttle_check(gpu(1410, {"software thermal slowdown": 0.4, "power cap": 0.9}))
    assert hot.status == FAIL and hot.gating
    assert hot.detail == "GPU 0 (H100): software thermal slowdown active in 40% of samples"
    assert throttle_check(gpu(1980, {"power cap": 0.9})).status == PASS
    assert throttle_check(MachineState()) is None  # no GPU: no such check


def test_what_differs_from_the_baseline_is_named():
    was = MachineState(gpus=(GpuState(uuid="GPU-a", name="H100", sm_clock_mhz_median=1980),),
                       versions={"driver": "535.104", "torch": "2.13.0"})
    now = MachineState(gpus=(GpuState(uuid="GPU-a", name="H100", sm_clock_mhz_median=1410,
                                      throttle_shares={"software thermal slowdown": 0.4}),),
                       versions={"driver": "550.54", "torch": "2.13.0"})
    check = state_check(was, now)
    assert check.status == INCONCLUSIVE and not check.gating
    assert check.detail == ("driver 550.54 vs 535.104; GPU 0 (H100): SM clock 1,410 vs 1,980 MHz; "
                            "GPU 0 (H100): software thermal slowdown active in 40% of samples (baseline 0%)")
    assert state_check(was, was).status == PASS


# The command


def test_history_command_shows_the_series_and_its_step(tmp_path):
    path = tmp_path / "runs" / "history" / "host" / "gpt-1.json"
    for i, best in enumerate([100.0, 101, 99, 100.5, 99.5, 100, 92, 91.5, 92.5, 92]):
        add_run(path, verdict(best, started=f"2026-12-{i + 1:02d}T02:00:00"), against="gpt.json", host="host")
    table = mbtune("history", "--profiles-dir", str(tmp_path / "runs"), env={"COLUMNS": "160"})
    assert table.returncode == 0, table.stderr
    assert "> 92" in table.stdout and f"> {BEST} changed at run 7 (2026-12-07)" in table.stdout
    data = json.loads(mbtune("history", "--profiles-dir", str(tmp_path / "runs"), "-f", "json").stdout)
    [kept] = data["histories"]
    assert len(kept["runs"]) == 10 and [c["run"] for c in kept["changes"]] == [7]
    rows = mbtune("history", "--profiles-dir", str(tmp_path / "runs"), "-f", "csv").stdout.splitlines()
    assert len(rows) == 1 + 10 * 3  # a row per run and check
    [step] = [r for r in rows if "changed at run 7" in r]
    assert step.startswith(f"{path},host,gpt.json,7,2026-12-07T02:00:00,PASS,{BEST},True,PASS,92.0,")
    assert read_histories(tmp_path / "runs")[0].series() == [BEST]


def test_history_command_refuses_a_folder_without_one(tmp_path):
    result = mbtune("history", "--profiles-dir", str(tmp_path))
    assert result.returncode == 2 and "no qualification history under" in result.stderr
    assert "Traceback" not in result.stderr


# Until decided


def test_until_decided_measures_twice_as_precisely_until_the_verdict_is_decided(tmp_path, monkeypatch):
    from mbtune.qualifying import run as qualifying_run
    from mbtune.qualifying.specfile import load_spec

    spec_path = tmp_path / "q.toml"
    spec_path.write_text('workload = "mlp"\ndevice = "cpu"\nmemory_budget = "512MiB"\n'
                         '[sweep]\nstages = 2\nschedules = ["gpipe"]\nmicro_batches = [2]\naccum = [1]\n'
                         '[thresholds]\nmin_best_samples_per_s = 100\n')
    spec = load_spec(spec_path)
    monkeypatch.delenv("MBTUNE_REPEATS", raising=False)  # each point until known
    asked = []
    answers = iter([INCONCLUSIVE, INCONCLUSIVE, PASS])

    def measure(spec, baseline, configs, progress, **kwargs):
        asked.append((configs[1].target_ci, configs[1].repeats))
        status = next(answers)
        return Verdict(checks=(Check(name=BEST, status=status, measured=100.0, more_measurements=4.0),),
                       started_at="2026-12-07T02:00:00", wall_s=0.01)

    monkeypatch.setattr(qualifying_run, "_measure", measure)
    verdict = qualifying_run.run_qualify(spec, profiles_dir=None, until_decided_s=3600.0)
    assert verdict.status == PASS and verdict.rounds == 3
    # A quarter of the 10% tolerance, then half as wide each round.
    assert asked == [(0.025, None), (0.0125, None), (0.00625, None)]

    asked.clear()
    answers = iter([INCONCLUSIVE, PASS])
    assert qualifying_run.run_qualify(spec, profiles_dir=None, repeats=3, until_decided_s=3600.0).rounds == 2
    assert [repeats for _, repeats in asked] == [3, 6]  # fixed repeats: twice as many

    answers = iter([INCONCLUSIVE])
    once = qualifying_run.run_qualify(spec, profiles_dir=None)  # without --until-decided, one round
    assert once.rounds == 1 and once.status == INCONCLUSIVE
    assert once.checks[0].detail.endswith("more at this run's pace (qualify --until-decided --max-time)")
