"""PNG pictures of sweeps and plans, drawn with matplotlib's Agg canvas (no display, no pyplot state).

matplotlib is imported only when a picture is asked for; without it, a ConfigError says how to get it.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mbtune.actions import ALLREDUCE, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, LOSS
from mbtune.errors import ConfigError
from mbtune.planning.records import PlanReport, Prediction
from mbtune.records import TimelineAction
from mbtune.sweeping.records import SweepReport

COLOURS = {FORWARD: "tab:green", BACKWARD: "tab:blue", BACKWARD_INPUT: "tab:cyan",
           BACKWARD_WEIGHT: "tab:purple", LOSS: "tab:olive", ALLREDUCE: "tab:red", "idle": "0.88"}
DPI = 110


def new_figure(width_in: float = 9.0, height_in: float = 4.5) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError("pictures need matplotlib, which is not installed",
                          hint="pip install matplotlib, or leave out --plot.") from exc
    figure = Figure(figsize=(width_in, height_in), dpi=DPI)
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


def rank_idle_spans(actions: Sequence[TimelineAction]) -> dict[int, list[tuple[float, float]]]:
    """Per rank, the (start_s, end_s) stretches inside the step where it computed nothing."""
    end_s = max(a.end_s for a in actions)
    idle: dict[int, list[tuple[float, float]]] = {}
    for rank in sorted({a.rank for a in actions}):
        cursor, gaps = 0.0, []
        for a in sorted((a for a in actions if a.rank == rank), key=lambda a: a.start_s):
            if a.start_s > cursor:
                gaps.append((cursor, a.start_s))
            cursor = max(cursor, a.end_s)
        if cursor < end_s:
            gaps.append((cursor, end_s))
        idle[rank] = gaps
    return idle


def draw_timeline(ax: Any, actions: Sequence[TimelineAction], *, title: str) -> None:
    """One row per stage, each kind in its colour; grey where the stage's rank is idle (white where the rank
    is busy with another of its stages); time in ms."""
    from matplotlib.patches import Patch

    end_ms = max(a.end_s for a in actions) * 1e3
    stages = sorted({a.stage for a in actions})
    ranks = {a.stage: a.rank for a in actions}
    idle = rank_idle_spans(actions)
    by_kind: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for a in actions:
        by_kind[(a.stage, a.kind)].append((a.start_s * 1e3, max(1e-6, (a.end_s - a.start_s) * 1e3)))
    for row, stage in enumerate(stages):
        gaps = [(start * 1e3, (end - start) * 1e3) for start, end in idle[ranks[stage]]]
        ax.broken_barh(gaps, (row - 0.4, 0.8), facecolors=COLOURS["idle"])
        for (s, kind), spans in by_kind.items():
            if s == stage:
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLOURS.get(kind, "black"), edgecolor="white",
                               linewidth=0.3)
    ax.set_yticks(range(len(stages)), [f"stage {s} (rank {ranks[s]})" for s in stages])
    ax.invert_yaxis()
    ax.set_xlim(0, end_ms)
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(title, loc="left", fontsize="medium")
    kinds = [k for k in COLOURS if k == "idle" or any(a.kind == k for a in actions)]
    ax.legend(handles=[Patch(color=COLOURS[k], label=k.replace("_", " ") + (" (rank)" if k == "idle" else ""))
                       for k in kinds], loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize="small")


def write_plots(report: SweepReport, directory: str | os.PathLike[str], *,
                ceiling_bytes: float | None = None) -> list[Path]:
    """Write the sweep's pictures into `directory` and return their paths: the best point's measured
    timeline per stage, throughput against micro-batches per schedule, measured against theoretical
    bubble, and the best point's peak memory per stage against the ceiling (the probe's peak at its
    ceiling unless `ceiling_bytes` is given)."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    best = report.best
    if best is not None and best.timeline:
        figure = new_figure(10.0, 1.6 + 0.6 * len({a.stage for a in best.timeline}))
        draw_timeline(figure.subplots(), best.timeline, title=f"Measured timeline: {best.point.label}")
        written.append(save_figure(figure, target / "timeline.png"))
    ok = [r for r in report.results if r.ok and r.samples_per_s]
    if ok:
        written.append(_throughput_plot(ok, target / "throughput.png", title=f"Throughput: {report.workload}"))
        written.append(_bubble_plot(ok, target / "bubble.png"))
    limit = ceiling_bytes if ceiling_bytes is not None else report.ceiling_peak_memory_bytes
    if best is not None and any(b is not None for b in best.peak_memory_bytes):
        peaks = [float(b or 0) for b in best.peak_memory_bytes]
        written.append(_memory_plot(peaks, limit, target / "memory.png",
                                    title=f"Peak memory per stage: {best.point.label}", label="measured peak"))
    return written


def _series_key(point: Any) -> str:
    return f"{point.schedule} mbs={point.micro_batch_size} accum={point.grad_accum_steps}"


def _throughput_plot(items: Sequence[Any], path: Path, *, title: str, predicted: bool = False) -> Path:
    figure = new_figure()
    ax = figure.subplots()
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for item in items:
        series[_series_key(item.point)].append((item.point.num_micro_batches, item.samples_per_s))
    for key, values in sorted(series.items()):
        values.sort()
        ax.plot([m for m, _ in values], [r for _, r in values], marker="o", label=key)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per pipeline step")
    ax.set_ylabel("samples/s" + (" (predicted)" if predicted else ""))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return save_figure(figure, path)


def _bubble_plot(results: Sequence[Any], path: Path) -> Path:
    rows = [(_series_key(r.point), r.point.num_micro_batches, r.bubble_measured, r.bubble_theoretical)
            for r in results if r.bubble_measured is not None and r.bubble_theoretical is not None]
    return _bubble_lines(rows, path, kind="measured", ylabel="bubble (% of stage-time idle)",
                         title="Bubble: measured (solid) against theoretical (dashed)")


def _bubble_lines(rows: Sequence[tuple[str, int, float, float]], path: Path, *, kind: str, ylabel: str,
                  title: str) -> Path:
    """One solid line (measured or simulated) and one dashed (theory) per schedule, against micro-batches."""
    figure = new_figure()
    ax = figure.subplots()
    series: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for key, m, value, theory in rows:
        series[key].append((m, value, theory))
    for index, (key, values) in enumerate(sorted(series.items())):
        values.sort()
        colour = f"C{index % 10}"
        ms = [v[0] for v in values]
        ax.plot(ms, [100 * v[1] for v in values], marker="o", color=colour, label=f"{key} {kind}")
        ax.plot(ms, [100 * v[2] for v in values], linestyle="--", color=colour, label=f"{key} theory")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per pipeline step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)
    return save_figure(figure, path)


def _memory_plot(per_stage: Sequence[float], limit: float | None, path: Path, *, title: str, label: str) -> Path:
    figure = new_figure(max(6.0, 0.25 * len(per_stage) + 3), 4.0)
    ax = figure.subplots()
    mib = [b / 2**20 for b in per_stage]
    colours = ["tab:red" if limit is not None and b > limit else "tab:blue" for b in per_stage]
    ax.bar(range(len(mib)), mib, color=colours, label=label)
    if limit is not None:
        ax.axhline(limit / 2**20, color="tab:red", linestyle="--", label="ceiling")
    ax.set_xlabel("stage (rank)")
    ax.set_ylabel("MiB")
    ax.set_title(title + ("" if limit is not None else " (no probed ceiling)"))
    ax.legend(fontsize="small")
    return save_figure(figure, path)


def write_plan_plots(report: PlanReport, directory: str | os.PathLike[str], *,
                     recommended: Prediction | None = None) -> list[Path]:
    """Write a plan's pictures (a PlanReport): predicted throughput against micro-batches per schedule,
    predicted against theoretical bubble, the recommended configuration's memory per rank against the
    ceiling and its simulated timeline (when `recommended` carries one), and predicted against measured
    step time for the points the sweep ran."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    if report.num_gpus is not None and report.predictions:
        written.append(_depth_plot(report, target / "plan_depth.png"))
    elif report.predictions:
        written.append(_throughput_plot(report.predictions, target / "plan_throughput.png", predicted=True,
                                        title=f"Predicted throughput: {report.workload}, "
                                              f"{report.predictions[0].point.num_ranks} ranks"))
        written.append(_plan_bubble_plot(report.predictions, target / "plan_bubble.png"))
    best = report.best
    if best is not None:
        written.append(_memory_plot(best.memory_bytes, report.memory_limit_bytes, target / "plan_memory.png",
                                    title=f"Predicted memory per rank: {best.point.label}", label="predicted"))
    if recommended is not None and recommended.timeline:
        stages = len({a.stage for a in recommended.timeline})
        figure = new_figure(10.0, min(24.0, 1.6 + 0.3 * stages))
        draw_timeline(figure.subplots(), recommended.timeline, title=f"Simulated timeline: {recommended.point.label}")
        written.append(save_figure(figure, target / "plan_timeline.png"))
    if report.validation is not None and report.validation.rows:
        written.append(_validation_plot(report.validation, target / "validation.png"))
    return written


def _depth_plot(report: PlanReport, path: Path) -> Path:
    """A cluster plan's predicted throughput against pipeline depth: the best of every depth simulated."""
    best: dict[int, Prediction] = {}
    for p in report.predictions:
        if p.fits is not False and (p.point.num_ranks not in best or p.samples_per_s > best[p.point.num_ranks].samples_per_s):
            best[p.point.num_ranks] = p
    depths = sorted(best)
    figure = new_figure(8.0, 4.5)
    ax = figure.subplots()
    ax.plot(depths, [best[d].samples_per_s for d in depths], marker="o")
    for d in depths:
        ax.annotate(f"{best[d].point.schedule}\nm={best[d].point.num_micro_batches} dp={best[d].point.data_parallel_size}",
                    (d, best[d].samples_per_s), fontsize="x-small", textcoords="offset points", xytext=(4, 4))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pipeline depth (ranks); replicas = GPUs / depth")
    ax.set_ylabel("samples/s (predicted)")
    ax.set_title(f"Best predicted throughput per depth: {report.workload} on {report.num_gpus} GPUs")
    ax.grid(True, alpha=0.3)
    return save_figure(figure, path)


def _plan_bubble_plot(predictions: Sequence[Any], path: Path) -> Path:
    rows = [(_series_key(p.point), p.point.num_micro_batches, p.bubble, p.bubble_theoretical) for p in predictions]
    return _bubble_lines(rows, path, kind="simulated", ylabel="bubble (%)",
                         title="Bubble: simulated with calibrated costs (solid) against theoretical (dashed)")


def _validation_plot(validation: Any, path: Path) -> Path:
    figure = new_figure(6.0, 5.0)
    ax = figure.subplots()
    measured = [r.measured_step_s * 1e3 for r in validation.rows]
    predicted = [r.predicted_step_s * 1e3 for r in validation.rows]
    ax.scatter(measured, predicted, color="tab:blue")
    top = max(measured + predicted) * 1.05
    ax.plot([0, top], [0, top], color="0.5", linestyle="--", label="predicted = measured")
    ax.plot([0, top], [0, top * 1.1], color="0.8", linestyle=":", label="±10%")
    ax.plot([0, top], [0, top * 0.9], color="0.8", linestyle=":")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"Simulator vs measured ({validation.method}): median error "
                 f"{100 * (validation.median_step_error or 0):.1f}%, worst {100 * (validation.worst_step_error or 0):.1f}%",
                 fontsize="small")
    ax.legend(fontsize="small")
    return save_figure(figure, path)
