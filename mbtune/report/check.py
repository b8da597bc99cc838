"""`mbtune check` for people (a per-block table and a verdict) and machines (JSON)."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from mbtune.checking.records import CheckResult, ValidationResult
from mbtune.report import print_json


def print_check(console: Console, result: CheckResult, fmt: str) -> None:
    """The verdict of one check, in the chosen format (table or json)."""
    if fmt == "json":
        print_json(result.to_dict())
        return
    table = Table(title=f"Check: {result.workload}, {result.point.label}, {result.precision}, against the plain "
                        f"model on the same {result.point.global_batch} samples", title_justify="left",
                  box=box.SIMPLE_HEAD)
    for name in ("block", "max |diff|", "max |diff| / max |plain|", "ok"):
        table.add_column(name, justify="left" if name == "ok" else "right")
    for block in result.blocks:
        table.add_row(str(block.block), f"{block.max_abs_diff:.3g}", f"{block.max_rel_diff:.3g}",
                      "[green]yes[/]" if block.ok else "[bold red]no[/]")
    table.caption = (f"a block passes when max |diff| <= {result.atol:g} + {result.rtol:g} x max |plain| "
                     f"(the tolerance of {result.precision})")
    console.print(table)
    worst = result.worst
    console.print(f"loss: pipeline {result.loss_pipeline:.6g}, plain {result.loss_plain:.6g} "
                  f"(relative difference {result.loss_rel_diff:.2g})"
                  + (f"; worst block {worst.block}: {worst.max_rel_diff:.2g} of its largest gradient" if worst else ""))
    if result.handovers_compared:
        console.print(f"hand-overs: {result.handovers_compared} tensors crossed a stage boundary (forward and "
                      "backward), " + (f"[bold red]{result.handover_difference}[/]" if result.handover_difference
                                       else "each as it was sent (dtype, shape and every byte)"))
    style = "bold green" if result.status == "PASS" else "bold red"
    console.print(f"[{style}]check {result.status}[/]" + (f": {result.cause}. {result.hint}" if result.cause else
                                                            ": the pipelined update is the plain model's"))


def print_validation(console: Console, result: ValidationResult, fmt: str) -> None:
    """The workload's validation, per block, in the chosen format (table or json)."""
    if fmt == "json":
        print_json(result.to_dict())
        return
    table = Table(title=f"Validation: {result.workload}, each block as a pipeline stage would run it, on "
                        f"{result.batch_size} samples", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("block", "runs", "parameters", "GFLOP/sample", "hands over", "crosses a stage", "gradient back",
                 "ok"):
        table.add_column(name, justify="right" if name in ("block", "parameters", "GFLOP/sample") else "left")
    for block in result.blocks:
        back = ("yes" if block.max_rel_diff <= 1e-3 else f"differs by {block.max_rel_diff:.2g}") \
            if block.gradient_back else "[bold red]none[/]"
        table.add_row(str(block.block), block.name, f"{block.parameters:,}", f"{block.flops_per_sample / 1e9:.4g}",
                      block.hands_over, block.crosses or "(to the loss)", back,
                      "[green]yes[/]" if block.ok else "[bold red]no[/]")
    console.print(table)
    if result.ties:
        console.print("tied (one tensor): " + "; ".join(" = ".join(tie) for tie in result.ties))
    if result.model_loss is not None:
        console.print(f"loss: blocks {result.loss:.6g}, the model as written {result.model_loss:.6g}")
    style = "bold green" if result.status == "PASS" else "bold red"
    console.print(f"[{style}]check {result.status}[/]" + (f": {result.cause}" if result.cause else
                  ": every block hands over both ways; pipeline options (--stages, --schedule, ...) check a real "
                  "pipeline's update"))
