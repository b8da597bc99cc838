"""How busy the machine was with work other than a point's own while the point ran.

Three figures, each None (or empty) where the machine cannot tell: the 1-minute load average at the end;
the CPU time other processes took, as a share of all CPUs over the point's wall time (system-wide busy
time from /proc/stat, less the CPU time of this process, of its living descendants such as the
forkserver, and of the point's ranks, which report their own); and, on CUDA, the processes NVML saw on the
point's GPUs that are not the point's ranks. Linux only; elsewhere the CPU figures are None.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mbtune.records import MachineLoad

BUSY_CPU_SHARE = 0.25  # other processes taking more than this share of all CPUs make the machine busy
PROC = "/proc"


@dataclass(frozen=True, kw_only=True)
class CpuTicks:
    """The aggregate `cpu` line of /proc/stat, in clock ticks since boot."""

    busy: int  # user + nice + system + irq + softirq + steal (steal: a neighbouring VM had our CPU)
    total: int  # busy + idle + iowait
    num_cpus: int  # the cpuN lines


def parse_proc_stat(text: str) -> CpuTicks | None:
    """The CPU tick counters of a /proc/stat text, or None when it has no `cpu` line.

    guest and guest_nice are left out: the kernel already counts them in user and nice."""
    busy = total = None
    num_cpus = 0
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if fields[0] == "cpu":
            values = [int(v) for v in fields[1:9]] + [0] * (8 - len(fields[1:9]))
            user, nice, system, idle, iowait, irq, softirq, steal = values
            busy = user + nice + system + irq + softirq + steal
            total = busy + idle + iowait
        elif fields[0].startswith("cpu") and fields[0][3:].isdigit():
            num_cpus += 1
    if busy is None or total is None:
        return None
    return CpuTicks(busy=busy, total=total, num_cpus=num_cpus)


def parse_pid_stat(text: str) -> tuple[int, int, int] | None:
    """(pid, parent pid, user + system CPU ticks) of a /proc/<pid>/stat text; None when malformed.

    The command name sits in parentheses and may itself hold spaces and parentheses, so the fields are
    read after its last ')'."""
    head, _, tail = text.rpartition(")")
    fields = tail.split()
    try:
        pid = int(head.split("(", 1)[0])
        return pid, int(fields[1]), int(fields[11]) + int(fields[12])
    except (ValueError, IndexError):
        return None


def descendant_cpu_ticks(root_pid: int, proc: str = PROC) -> dict[int, int]:
    """CPU ticks of every living descendant of root_pid (not root_pid itself); {} without /proc."""
    stats: dict[int, tuple[int, int]] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                parsed = parse_pid_stat(f.read())
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if parsed is not None:
            stats[parsed[0]] = (parsed[1], parsed[2])
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, int] = {}
    todo = list(children.get(root_pid, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = stats[pid][1]
            todo.extend(children.get(pid, []))
    return found


def other_cpu_share(*, busy_s: float, own_cpu_s: float, total_s: float) -> float | None:
    """(system-wide busy time - our own CPU time) / (all CPUs x wall time), clamped to [0, 1]."""
    if total_s <= 0:
        return None
    return min(1.0, max(0.0, (busy_s - own_cpu_s) / total_s))


def other_gpu_processes(seen_pids: Iterable[int] | None, our_pids: Iterable[int], num_ranks: int) -> tuple[str, ...]:
    """The processes NVML saw on the point's GPUs that are not ours, in words; () where NVML could not say.

    In a container NVML may report pids of another namespace, so none of ours match: then only a count
    beyond the point's own ranks can be told."""
    if seen_pids is None:
        return ()
    seen, ours = set(seen_pids), set(our_pids)
    if seen and not seen & ours and num_ranks:
        extra = len(seen) - num_ranks
        if extra <= 0:
            return ()
        return (f"{extra} process(es) besides the point's {num_ranks} rank(s) (NVML pids "
                f"{', '.join(map(str, sorted(seen)))} are from another pid namespace)",)
    return tuple(f"pid {pid}" for pid in sorted(seen - ours))


def busy_verdict(share: float | None, num_cpus: int, gpu_processes: Sequence[str]) -> tuple[bool, str]:
    """(busy, why in words): other processes took over BUSY_CPU_SHARE of the CPUs, or shared a GPU."""
    reasons = []
    if share is not None and share > BUSY_CPU_SHARE:
        reasons.append(f"other processes took {share:.0%} of the {num_cpus} CPUs")
    if gpu_processes:
        reasons.append(f"other processes on the point's GPUs: {', '.join(gpu_processes)}")
    return bool(reasons), "; ".join(reasons)


def busy_warning(label: str, load: MachineLoad | None) -> str | None:
    """The warning a result carries when the machine was busy while it ran, else None."""
    if load is None or not load.busy:
        return None
    return f"the machine was busy while {label} ran ({load.reason}): its figures are less certain"


@dataclass(frozen=True, kw_only=True)
class _Snapshot:
    ticks: CpuTicks | None
    own_cpu_s: float  # this process, every thread (the NVML sampler's included)
    descendants: dict[int, int]  # pid -> CPU ticks


class LoadMeter:
    """Context manager around a point's run; `load(...)` afterwards says how busy the machine was."""

    def __init__(self, *, proc: str = PROC) -> None:
        self._proc = proc
        self._start: _Snapshot | None = None
        self._end: _Snapshot | None = None

    def _snapshot(self) -> _Snapshot:
        try:
            with open(os.path.join(self._proc, "stat")) as f:
                ticks = parse_proc_stat(f.read())
        except OSError:
            ticks = None
        return _Snapshot(ticks=ticks, own_cpu_s=time.process_time(),
                         descendants=descendant_cpu_ticks(os.getpid(), self._proc) if ticks else {})

    def __enter__(self) -> LoadMeter:
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = self._snapshot()

    def load(self, *, rank_cpu_s: float | None, our_pids: Iterable[int] = (), gpu_pids: Iterable[int] | None = None,
             num_ranks: int = 0) -> MachineLoad:
        """MachineLoad over the run. rank_cpu_s: the ranks' own CPU time (None when a rank did not report
        it, which leaves the CPU share unknown); gpu_pids: what NVML saw on the point's GPUs (None: n/a)."""
        assert self._start is not None and self._end is not None, "use LoadMeter as a context manager"
        start, end = self._start, self._end
        share, num_cpus = None, os.cpu_count() or 1
        if start.ticks and end.ticks and rank_cpu_s is not None:
            tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
            num_cpus = end.ticks.num_cpus or num_cpus
            tree_ticks = sum(t - start.descendants.get(pid, 0) for pid, t in end.descendants.items())
            own_s = rank_cpu_s + (end.own_cpu_s - start.own_cpu_s) + max(0, tree_ticks) * tick_s
            share = other_cpu_share(busy_s=(end.ticks.busy - start.ticks.busy) * tick_s, own_cpu_s=own_s,
                                    total_s=(end.ticks.total - start.ticks.total) * tick_s)
        gpu_others = other_gpu_processes(gpu_pids, our_pids, num_ranks)
        busy, reason = busy_verdict(share, num_cpus, gpu_others)
        return MachineLoad(load_avg_1m=_load_avg_1m(), other_cpu_share=share, num_cpus=num_cpus,
                           other_gpu_processes=gpu_others, busy=busy, reason=reason)


def _load_avg_1m() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
