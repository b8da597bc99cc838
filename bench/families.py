"""Benchmark: every transformers family of the usual shape as an hf: workload, tuned on two pipeline stages
and its best row checked against the plain model, as a user runs it (`mbtune tune`, one process per
family). Prints, per family: the probed ceiling and safe batch, the best configuration with its throughput,
the check's verdict and the wall time.

Run: .venv/bin/python bench/families.py [--families gpt2,llama] [--budget 1GiB]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--budget", default="1GiB")
    args = parser.parse_args()
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
    return (f"{point['schedule']} m={point['num_microbatches']} accum={point['grad_accum_steps']} "
            f"mbs={point['micro_batch_size']}")


if __name__ == "__main__":
    main()
