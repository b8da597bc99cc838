"""Benchmark: every transformers family of the usual shape as an hf: workload, tuned on two pipeline stages
and its best row checked against the plain model, as a user runs it (`mbtune tune`, one process per
family). Prints, per family: the probed ceiling and safe batch, the best configuration with its throughput,
the check's verdict and the wall time.

Run: .venv/bin/python bench/families.py [--families gpt2,llama] [--budget 1GiB]
     .venv/bin/python bench/families.py --load-all    # every model type: does it split, exactly?
     .venv/bin/python bench/families.py --load-all --layers 8   # the same, 8 layers (alike ones traced by 3)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "granite", "gpt_neox",
            "opt", "bert", "roberta")


def tune(family: str, budget: str) -> tuple[dict, float, str]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "mbtune", "tune", "-w", f"hf:{family}", "--stages", "2",
                             "--memory-budget", budget, "--max-batch", "16", "--schedules", "1f1b,gpipe",
                             "--steps", "2", "--warmup", "1", "--repeats", "1", "--no-save", "-f", "json"],
                            capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - started
    if result.returncode != 0:
        return {}, wall, (result.stderr.strip().splitlines() or ["no output"])[-1]
    return json.loads(result.stdout), wall, ""


def load_all(layers: int | None) -> None:
    """Every model type of the installed transformers with a causal-LM or masked-LM model, at its small
    default (with `layers` layers where given): does it split, and do the blocks compute what the whole model
    computes (one forward, the same weights)? How many were traced by their first layers (workloads/identical_members.py),
    and the reasons of those that do not split, counted."""
    from collections import Counter

    import torch

    from mbtune.workloads import load_workload
    from mbtune.workloads.hf import _builder, _kind, families, hf_config

    exact, shortened, reasons = [], [], Counter()
    deeper = {"num_hidden_layers": layers} if layers else {}
    names = sorted(families())
    for family in names:
        try:
            workload = load_workload(f"hf:{family}", (("seq_len", 16), *deeper.items()))
            config, _ = hf_config(family, dict(deeper))
            torch.manual_seed(0)
            whole = _builder(config, _kind(family), family)()
            ids, _ = workload.make_batch(2, torch.Generator().manual_seed(0))
            with torch.no_grad():
                diff = (workload.build(seed=0)(ids) - whole(ids)).abs().max().item()
            if diff <= 1e-5:
                exact.append(family)
                if workload.traced.num_copied:
                    shortened.append(family)
            else:
                reasons[f"blocks differ from the model (max {diff:.1e})"] += 1
        except Exception as exc:  # noqa: BLE001 - the reason is the figure
            reasons[str(exc).split(": ", 2)[-1][:90]] += 1
    print(f"{len(exact)} of {len(names)} model types split into blocks that compute the whole model exactly; "
          f"{len(shortened)} of them traced by their first layers, the rest copied")
    for reason, count in reasons.most_common():
        print(f"  {count:>3}  {reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--load-all", action="store_true", help="load every model type instead (no tuning)")
    parser.add_argument("--layers", type=int, help="with --load-all: this many layers (default: each one's small default)")
    args = parser.parse_args()
    if args.load_all:
        load_all(args.layers)
        return
    print(f"{'family':<10} {'ceiling':>7} {'safe':>5}  {'best row (2 stages)':<34} {'samples/s':>9}  check  wall s")
    for family in args.families.split(","):
        report, wall, error = tune(family, args.budget)
        if error:
            print(f"{family:<10} failed: {error}")
            continue
        sweep, probe = report["sweep"], report["probe"]
        best = sweep["results"][sweep["ranking"][0]] if sweep["ranking"] else None
        label = _label(best["point"]) if best else "none"
        rate = f"{best['samples_per_s']:.1f}" if best else "-"
        check = (sweep.get("check") or {}).get("status", sweep.get("check_error") or "-")
        print(f"{family:<10} {probe['ceiling']!s:>7} {probe['safe_batch']!s:>5}  {label:<34} {rate:>9}  {check:<5}"
              f"  {wall:6.0f}", flush=True)


def _label(point: dict) -> str:
    return (f"{point['schedule']} m={point['num_micro_batches']} accum={point['grad_accum_steps']} "
            f"mbs={point['micro_batch_size']}")


if __name__ == "__main__":
    main()
