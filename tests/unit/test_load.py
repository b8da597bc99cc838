"""Machine load over a point: /proc parsing, the other processes' CPU share, other GPU processes, the
verdict (pure logic), and the meter on this machine (it degrades to None, never raises)."""

from __future__ import annotations

import os

import pytest

from mbtune.device.machine_load import (
    CpuTicks,
    LoadMeter,
    busy_verdict,
    busy_warning,
    descendant_cpu_ticks,
    other_cpu_share,
    other_gpu_processes,
    parse_pid_stat,
    parse_proc_stat,
)
from mbtune.records import MachineLoad

PROC_STAT = """cpu  23014 10 2728 59702 169 3 133 39 7 2
cpu0 9227 0 1121 32394 64 0 57 18 0 0
cpu1 13787 10 1606 27307 105 3 76 21 7 2
intr 215383 0 0 0
ctxt 238274
btime 1700000000
"""


def test_proc_stat_busy_and_total_ticks():
    ticks = parse_proc_stat(PROC_STAT)
    busy = 23014 + 10 + 2728 + 3 + 133 + 39  # user nice system irq softirq steal; guest is inside user
    assert ticks == CpuTicks(busy=busy, total=busy + 59702 + 169, num_cpus=2)


def test_proc_stat_short_lines_and_missing_cpu_line():
    assert parse_proc_stat("cpu 10 0 5 100\n") == CpuTicks(busy=15, total=115, num_cpus=0)
    assert parse_proc_stat("intr 1 2 3\n") is None
    assert parse_proc_stat("") is None


def test_pid_stat_reads_past_a_command_name_with_spaces_and_parentheses():
    fields = " ".join(["S", "41"] + ["0"] * 9 + ["700", "300"] + ["0"] * 30)
    assert parse_pid_stat(f"4242 (python (rank 0)) {fields}") == (4242, 41, 1000)
    assert parse_pid_stat("garbage") is None


def test_descendants_are_found_through_parent_pids(tmp_path):
    def proc(pid: int, ppid: int, cpu: int) -> None:
        (tmp_path / str(pid)).mkdir()
        fields = " ".join(["S", str(ppid)] + ["0"] * 9 + [str(cpu), "0"] + ["0"] * 30)
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (p{pid}) {fields}")

    proc(10, 1, 5)  # us
    proc(11, 10, 7)  # the forkserver
    proc(12, 11, 9)  # a rank
    proc(13, 1, 100)  # someone else's
    (tmp_path / "self").mkdir()
    assert descendant_cpu_ticks(10, str(tmp_path)) == {11: 7, 12: 9}
    assert descendant_cpu_ticks(10, str(tmp_path / "missing")) == {}


def test_other_share_subtracts_our_own_cpu_time_and_clamps():
    assert other_cpu_share(busy_s=12.0, own_cpu_s=2.0, total_s=20.0) == pytest.approx(0.5)
    assert other_cpu_share(busy_s=2.0, own_cpu_s=3.0, total_s=20.0) == 0.0  # accounting jitter: not negative
    assert other_cpu_share(busy_s=1.0, own_cpu_s=0.0, total_s=0.0) is None


def test_other_gpu_processes_by_pid_and_across_pid_namespaces():
    assert other_gpu_processes({100, 555}, our_pids=[100], num_ranks=1) == ("pid 555",)
    assert other_gpu_processes({100}, our_pids=[100], num_ranks=1) == ()
    assert other_gpu_processes(None, our_pids=[100], num_ranks=1) == ()  # NVML could not say
    # NVML in a container reports the host's pids: none of ours match, so only a surplus can be told.
    assert other_gpu_processes({9001}, our_pids=[100], num_ranks=1) == ()
    [found] = other_gpu_processes({9001, 9002, 9003}, our_pids=[100], num_ranks=1)
    assert found.startswith("2 process(es) besides the point's 1 rank(s)")


def test_busy_verdict_and_warning():
    assert busy_verdict(0.48, 2, ()) == (True, "other processes took 48% of the 2 CPUs")
    assert busy_verdict(0.25, 2, ()) == (False, "")
    assert busy_verdict(None, 2, ()) == (False, "")
    busy, reason = busy_verdict(0.1, 8, ("pid 555",))
    assert busy and reason == "other processes on the point's GPUs: pid 555"
    load = MachineLoad(other_cpu_share=0.48, num_cpus=2, busy=True, reason="other processes took 48% of the 2 CPUs")
    assert busy_warning("gpipe p=2 m=4 accum=1 mbs=2", load) == (
        "the machine was busy while gpipe p=2 m=4 accum=1 mbs=2 ran (other processes took 48% of the 2 CPUs): "
        "its figures are less certain")
    assert busy_warning("x", MachineLoad()) is None and busy_warning("x", None) is None


def test_meter_on_this_machine_and_without_proc(tmp_path):
    with LoadMeter() as meter:
        sum(i * i for i in range(200_000))
    load = meter.load(rank_cpu_s=0.0, our_pids=[os.getpid()])
    assert load.num_cpus >= 1
    if os.path.exists("/proc/stat"):
        assert load.other_cpu_share is not None and 0.0 <= load.other_cpu_share <= 1.0
    assert meter.load(rank_cpu_s=None).other_cpu_share is None  # a rank that did not report: unknown
    with LoadMeter(proc=str(tmp_path / "no-proc")) as bare:
        pass
    missing = bare.load(rank_cpu_s=0.0)
    assert missing.other_cpu_share is None and not missing.busy
