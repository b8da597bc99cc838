"""What the load generator knows of one load's requests (filled by its reader thread) and the figures taken
over them: a window's, the p99's interval so far, and the load's summary."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from mbtune.serving import traffic as gen
from mbtune.serving.records import BatchConfig, LoadResult


@dataclass
class Requests:
    """What the generator knows of the requests of one load, filled by the reader thread."""

    due: dict[int, float] = field(default_factory=dict)  # id -> when it was due
    unsent: int = 0  # of those, due but never sent (the sender fell behind): lost
    answered: dict[int, tuple[float, float, float, float, int]] = field(default_factory=dict)
    rejected: dict[int, float] = field(default_factory=dict)  # id -> when the rejection came back
    lock: threading.Lock = field(default_factory=threading.Lock)
    settled: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.settled = threading.Condition(self.lock)

    @property
    def outstanding(self) -> int:
        return len(self.due) - len(self.answered) - len(self.rejected)


def p99_half(requests: Requests, begin: float, end: float, window_s: float) -> float:
    """The p99's 95% half interval (share of it) over the requests answered or rejected in [begin, end),
    taken over its windows of `window_s` (load.sectioned_half)."""
    with requests.lock:
        settled = [(answer[0], answer[0] - requests.due[i]) for i, answer in requests.answered.items()
                   if begin <= answer[0] < end]
        rejected = [when for when in requests.rejected.values() if begin <= when < end]
    return gen.sectioned_half(sections(settled, rejected, begin, end, window_s), 0.99)


def sections(settled: list[tuple[float, float]], rejected: list[float], begin: float, end: float,
             window_s: float) -> list[tuple[list[float], int]]:
    """(latencies, rejected) per window of `window_s` from `begin` to `end`: each request placed by its
    time (when it settled, or when it was due)."""
    count = max(1, round((end - begin) / window_s))
    values: list[list[float]] = [[] for _ in range(count)]
    lost = [0] * count

    def slot(when: float) -> int:
        return min(count - 1, max(0, int((when - begin) / window_s)))

    for when, latency in settled:
        values[slot(when)].append(latency)
    for when in rejected:
        lost[slot(when)] += 1
    return list(zip(values, lost, strict=True))


def window(requests: Requests, begin: float, end: float, open_loop: bool) -> gen.Window:
    with requests.lock:
        latencies = [answer[0] - requests.due[i] for i, answer in requests.answered.items() if begin <= answer[0] < end]
        offered = sum(1 for due in requests.due.values() if begin <= due < end) if open_loop else 0
    return gen.window_of(latencies, end - begin, offered=offered)


def summary(requests: Requests, rules: BatchConfig, span: tuple[float, float], window_s: float) -> LoadResult:
    """The figures over the requests due within `span` (latency) and answered within it (throughput); the
    p99's interval over its windows of `window_s`."""
    begin, end = span
    with requests.lock:
        due = {i: t for i, t in requests.due.items() if begin <= t < end}
        answered = {i: requests.answered[i] for i in due if i in requests.answered}
        rejected = sum(1 for i in due if i in requests.rejected)
        lost_due = [t for i, t in due.items() if i not in answered]  # rejected, timed out or never sent
        throughput = sum(1 for a in requests.answered.values() if begin <= a[0] < end) / (end - begin)
        sent = len(requests.due) - requests.unsent
        completed, lost_all = len(requests.answered), len(requests.rejected)
        unsent = requests.unsent
    timed_out = len(due) - len(answered) - rejected  # within the span: unanswered, never sent included
    timed = [(due[i], answer[0] - due[i]) for i, answer in answered.items()]  # (when due, latency)
    latencies = [latency for _, latency in timed]
    lost = rejected + timed_out
    by_window = sections(timed, lost_due, begin, end, window_s)
    queued = [answer[2] - answer[1] for answer in answered.values()]
    served = [answer[3] - answer[2] for answer in answered.values()]
    mean = sum(latencies) / len(latencies) if latencies else None
    return LoadResult(
        config=rules, sent=sent, completed=completed, rejected=lost_all, timed_out=max(0, sent - completed - lost_all),
        not_sent=unsent,
        duration_s=end - begin, throughput_per_s=throughput,
        p50_s=finite(gen.percentile(latencies, 0.50, rejected=lost)),
        p90_s=finite(gen.percentile(latencies, 0.90, rejected=lost)),
        p99_s=finite(gen.percentile(latencies, 0.99, rejected=lost)),
        p99_ci_half_pct=finite(100 * gen.sectioned_half(by_window, 0.99)),
        mean_latency_s=mean,
        mean_batch_size=sum(a[4] for a in answered.values()) / len(answered) if answered else 0.0,
        queue_share=(sum(queued) / len(queued)) / mean if queued and mean else 0.0,
        mean_service_s=sum(served) / len(served) if served else None)


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
