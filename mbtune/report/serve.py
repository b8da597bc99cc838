"""`mbtune serve` results for people (rich), machines (JSON, CSV), servers (the files serving/export.py
writes for Triton and TorchServe) and pictures (the throughput-latency curve)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from mbtune.report import document_stream, fmt_rate, fmt_seconds, key_value_grid, print_json, print_warnings
from mbtune.serving.export import (
    model_name,
    torchserve_model_config,
    torchserve_properties,
    torchserve_settings,
    triton_config,
)
from mbtune.serving.records import ConfigAnswer, LoadResult, ServeReport


def print_serve(console: Console, report: ServeReport, fmt: str, *, saved_to: str | None = None,
                exported: dict[str, Path] | None = None) -> None:
    if fmt == "json":
        print_json(serve_document(report, exported))
        return
    if fmt == "csv":
        report.to_frame().to_csv(document_stream(), index=False)
        return
    console.print(curve_table(report))
    console.print(loads_table(report))
    console.print(answers_table(report))
    console.print(summary_panel(report))
    winner = report.winner
    if winner is not None and exported:
        console.print("serving files for the chosen configuration (take these):")
        for label, path in exported.items():
            console.print(f"  {label}: {path}")
    elif winner is not None:
        settings = torchserve_settings(winner.config)
        console.print(f"TorchServe: batchSize={settings['batchSize']} maxBatchDelay={settings['maxBatchDelay']} (ms; "
                      "no preferred sizes). --export DIR writes Triton's whole config.pbtxt and TorchServe's "
                      "model-config.yaml and config.properties.")
    for reason in report.skipped:
        console.print(f"[dim]skipped: {reason}[/]")
    print_warnings(console, report.warnings)
    if report.interrupted:
        console.print("[yellow]interrupted: the figures above are what finished[/]")
    if saved_to:
        console.print(f"profile saved to {saved_to}")


def serve_document(report: ServeReport, exported: dict[str, Path] | None = None) -> dict[str, Any]:
    """The JSON output: the report as saved, with the winner's server settings and files beside it."""
    winner = report.winner
    name = model_name(report.workload)
    return {"serve": report.to_dict(),
            "winner": None if winner is None else {
                "config": winner.config.to_dict(), "max_rate_per_s": winner.max_rate_per_s,
                "triton_config_pbtxt": triton_config(report, winner.config, name),
                "torchserve": torchserve_settings(winner.config),
                "torchserve_model_config_yaml": torchserve_model_config(winner.config),
                "torchserve_config_properties": torchserve_properties(winner.config, name),
                "files": {label: str(path) for label, path in (exported or {}).items()}}}


def curve_table(report: ServeReport) -> Table:
    table = Table(title=f"Service time of one batch ({report.precision}, {report.threads} thread(s), warm)",
                  title_justify="left")
    for name in ("batch", "median", "min-max", "passes", "samples/s"):
        table.add_column(name, justify="right")
    for time in report.curve.times:
        table.add_row(str(time.batch_size), fmt_seconds(time.median_s),
                      f"{fmt_seconds(time.min_s)}-{fmt_seconds(time.max_s)}", str(len(time.times_s)),
                      fmt_rate(time.batch_size / time.median_s))
    return table


def loads_table(report: ServeReport) -> Table:
    """The throughput-latency curve: every configuration under every load it ran."""
    budget = report.p99_budget_s
    table = Table(title=f"Measured under load (p99 budget {fmt_seconds(budget)})", title_justify="left")
    for name in ("configuration", "load", "throughput/s", "p50", "p90", "p99", "predicted p99", "mean batch",
                 "queued", "lost", "windows"):
        table.add_column(name, justify="left" if name in ("configuration", "load") else "right")
    for run in report.runs:
        if run.error:
            table.add_row(run.config.label, "[red]failed[/]", run.error, *[""] * 8)
        seen: set[str] = set()
        for load in run.loads:
            style = "green" if load.meets(budget) else "red"
            again = " (again)" if load.label in seen else ""  # the second look at a deciding load
            seen.add(load.label)
            table.add_row(run.config.label, load.label + again, fmt_rate(load.throughput_per_s), _latency(load.p50_s),
                          _latency(load.p90_s), f"[{style}]{_latency(load.p99_s)}[/]{_interval(load)}", _latency(load.predicted_p99_s),
                          f"{load.mean_batch_size:.1f}", f"{load.queue_share:.0%}", str(load.lost),
                          f"{load.windows}{'' if load.stable else ' unstable'}")
    return table


def _interval(load: LoadResult) -> str:
    """The p99's 95% interval over the load's windows, as +- a share of it (where it is finite)."""
    half = load.p99_ci_half_pct
    return f" ±{half:.0f}%" if load.p99_s is not None and half is not None else ""


def _latency(value: float | None) -> str:
    return "lost >1%" if value is None else fmt_seconds(value)


def answers_table(report: ServeReport) -> Table:
    table = Table(title="Highest Poisson rate with p99 within the budget", title_justify="left",
                  caption="* best   = tied with the best (its highest rate could be the best one's: the brackets "
                          "overlap)", caption_justify="left")
    for name in ("", "configuration", "max rate/s", "p99 there", "throughput/s", "first over budget",
                 "highest rate lies in", "predicted max rate/s"):
        table.add_column(name, justify="left" if name in ("", "configuration") else "right")
    for index, answer in enumerate(report.answers):
        mark = "*" if index == report.best else "=" if index in report.ties else ""
        table.add_row(mark, answer.config.label, _rate(answer), fmt_seconds(answer.p99_at_max_s)
                      if answer.p99_at_max_s is not None else "", fmt_rate(answer.throughput_at_max_per_s)
                      if answer.throughput_at_max_per_s is not None else "",
                      f"{answer.first_failing_rate_per_s:g}" if answer.first_failing_rate_per_s else "",
                      _bracket(answer),
                      f"{answer.predicted_max_rate_per_s:g}" if answer.predicted_max_rate_per_s else "none")
    return table


def _bracket(answer: ConfigAnswer) -> str:
    if not answer.ran:
        return ""
    high = f"{answer.bracket_high_per_s:g})" if answer.bracket_high_per_s is not None else "above)"
    return f"[{answer.bracket_low_per_s:g}, {high}"


def _rate(answer: ConfigAnswer) -> str:
    if not answer.ran:
        return "not run"
    if answer.max_rate_per_s is None:
        return "none"
    return f"{answer.max_rate_per_s:g}" + ("" if answer.stable else " (unstable)")


def summary_panel(report: ServeReport) -> Panel:
    grid = key_value_grid()
    device, ceiling = report.device, report.ceiling
    grid.add_row("device", f"{device.label} {device.name}")
    options = ", ".join(f"{k}={v}" for k, v in report.workload_options.items())
    grid.add_row("workload", f"{report.workload}{f' ({options})' if options else ''}, {report.precision}, "
                             "eval mode under torch.inference_mode")
    bound = " (stopped at --max-batch)" if ceiling.stopped_at_max_batch else f", first failing {ceiling.first_failing}"
    grid.add_row("inference ceiling", f"{ceiling.ceiling}{bound}; safe batch {ceiling.safe_batch} "
                                      f"(margin {ceiling.margin:.0%}, {len(ceiling.trials)} trials)")
    grid.add_row("p99 budget", fmt_seconds(report.p99_budget_s))
    winner = report.winner
    grid.add_row("best", f"[bold green]{winner.config.label}[/]: {winner.max_rate_per_s:g} requests/s within the "
                         f"budget (p99 {fmt_seconds(winner.p99_at_max_s)})" if winner and winner.max_rate_per_s
                 else "[red]no configuration met the budget at any rate it ran[/]")
    decision = report.decision
    if decision is not None:
        size = f"{decision.size * 100:g}%"
        equal = ", ".join(report.answers[i].config.label for i in decision.group)
        still = ", ".join(report.answers[i].config.label for i in decision.open)
        grid.add_row("decision", {"decided": "decided: no other configuration is tied with it",
                                  "equivalent": f"equivalent: {equal}, highest rates within {size} of its own on the "
                                                "same arrivals (any of them is as good an answer)"}.get(
            decision.state, f"not decided: {still} tied with it, its highest rate more than {size} below"
                            + (f"; {equal} within {size}" if equal else "")))
    elif report.ties:
        tied = ", ".join(report.answers[i].config.label for i in report.ties)
        grid.add_row("tied with", f"{tied}: where each one's highest rate lies overlaps the best one's (a p99 near "
                                  "the budget counts either way), so a second run could name either")
    check = report.simulator
    if check is not None:
        error = (f"median {check.median_error_pct:.0f}%, worst {check.worst_error_pct:.0f}% over {check.points} "
                 "loads" if check.median_error_pct is not None else "no load to compare with")
        if check.misses:
            error += f"; {check.misses} load(s) where one side lost over 1% of requests and the other did not"
        noise = f"; a batch's passes spread {check.noise_pct:.0f}% (median max/min)" if check.noise_pct is not None else ""
        grid.add_row("simulator p99 error", f"{error} (each predicted from the others){noise}")
        grid.add_row("simulator calibration", f"a batch under load took x{check.service_scale:.2f} its time alone; "
                                              f"transport {fmt_seconds(check.overhead_s)} per request")
    again = sum(len(run.loads) - len({load.label for load in run.loads}) for run in report.runs)
    if again:
        grid.add_row("second look", f"{again} load(s) that decide the choice measured again in fresh servers; a rate "
                                    "counts as met only where every look met it")
    grid.add_row("strategy", report.strategy)
    return Panel(grid, title="Serving result", title_align="left", expand=False)


def write_serve_plot(report: ServeReport, directory: Path) -> Path:
    """serve_curve.png: p99 against throughput per configuration, the budget as a line."""
    from mbtune.report.plots import new_figure, save_figure

    directory.mkdir(parents=True, exist_ok=True)
    figure = new_figure(8.0, 5.0)
    ax = figure.subplots()
    for run in report.runs:
        points = [(load.throughput_per_s, load.p99_s * 1e3) for load in run.loads if load.p99_s is not None]
        if points:
            ax.plot(*zip(*sorted(points)), marker="o", label=run.config.label)
    ax.axhline(report.p99_budget_s * 1e3, color="tab:red", linestyle="--", label="p99 budget")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_title(f"Throughput against p99: {report.workload} on {report.device.label}", fontsize="small")
    ax.legend(fontsize="x-small")
    return save_figure(figure, directory / "serve_curve.png")
