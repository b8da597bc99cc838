"""The tables under a sweep's best configuration: the best row's trade-off in micro-batch size, and what full
recompute cost and saved point by point."""

from __future__ import annotations

from rich import box
from rich.table import Table

from mbtune.report import fmt_bytes, fmt_pct, fmt_rate, fmt_seconds
from mbtune.sweeping.records import SweepReport


def tradeoff_table(report: SweepReport) -> Table:
    """The best row beside its neighbours in micro-batch size (same schedule and global batch): why a bigger
    micro-batch won or lost. Under it, where more micro-batches with fewer accumulation steps won at the
    same micro-batch size, the figures that say so."""
    best = report.results[report.ranking[0]]
    table = Table(title=f"The trade-off at global batch {best.point.global_batch} ({best.point.schedule}): bigger "
                        "micro-batches compute a sample faster, more of them leave a smaller bubble",
                  title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    rows = list(report.tradeoff) + [i for i in report.padding if i not in report.tradeoff]
    replicas = any(report.results[i].point.data_parallel_size > 1 for i in rows)
    for header in ("mbs", "m x acc x dp" if replicas else "m x acc", "samples/s", "bubble", "compute/sample",
                   "peak mem", ""):
        table.add_column(header, justify="left" if header == "" else "right", no_wrap=True)
    for index in rows:
        r = report.results[index]
        split = f"{r.point.num_micro_batches} x {r.point.grad_accum_steps}"
        table.add_row(str(r.point.micro_batch_size), split + (f" x {r.point.data_parallel_size}" if replicas else ""),
                      fmt_rate(r.samples_per_s), fmt_pct(r.bubble_measured), _per_sample(r.compute_per_sample_s),
                      fmt_bytes(r.max_peak_memory_bytes), "best" if index == report.ranking[0] else "",
                      style="bold green" if index == report.ranking[0] else "")
    if report.padding:
        won, lost = (report.results[i] for i in report.padding)
        table.caption = (f"m={won.point.num_micro_batches} x accum={won.point.grad_accum_steps} beats "
                         f"m={lost.point.num_micro_batches} x accum={lost.point.grad_accum_steps} at the same "
                         f"micro-batch size: one pipeline step of more micro-batches fills the drain that the next "
                         f"accumulation step's would leave idle (bubble {fmt_pct(won.bubble_measured)} against "
                         f"{fmt_pct(lost.bubble_measured)}, {fmt_rate(won.samples_per_s)} against "
                         f"{fmt_rate(lost.samples_per_s)} samples/s, peak memory {fmt_bytes(won.max_peak_memory_bytes)} "
                         f"against {fmt_bytes(lost.max_peak_memory_bytes)})")
    return table


def recompute_table(report: SweepReport) -> Table:
    """Per point that ran with and without full recompute: what recompute cost in throughput and saved in
    peak memory (the busiest stage's)."""
    table = Table(title="Recompute: what full recompute costs and saves, point by point", title_justify="left",
                  box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for header in ("point", "samples/s none -> full", "change", "peak mem none -> full", "change"):
        table.add_column(header, justify="left" if header == "point" else "right", no_wrap=True)
    for plain_index, full_index in report.recompute_pairs:
        plain, full = report.results[plain_index], report.results[full_index]
        table.add_row(plain.point.label, f"{fmt_rate(plain.samples_per_s)} -> {fmt_rate(full.samples_per_s)}",
                      _change(plain.samples_per_s, full.samples_per_s),
                      f"{fmt_bytes(plain.max_peak_memory_bytes)} -> {fmt_bytes(full.max_peak_memory_bytes)}",
                      _change(plain.max_peak_memory_bytes, full.max_peak_memory_bytes))
    return table


def _change(before: float | None, after: float | None) -> str:
    return "n/a" if not before or after is None else f"{after / before - 1:+.0%}"


def _per_sample(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else fmt_seconds(seconds)
