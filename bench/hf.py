"""Benchmark: Hugging Face workloads (hf:NAME) against the transformers models they are built from.

Per family: the split, parameters (ties counted once) against the whole transformers model's, the blocks'
logits against the model's, FLOPs per sample counted by torch's FlopCounterMode against 6 x parameters x
tokens, the load time. For hf:gpt2 (or --family): mbtune's probe ceiling against the
largest batch the plain transformers model trains at in an ordinary loop (its own loss, AdamW, two steps)
in a fresh process under the same budget, capped the way an mbtune CPU trial is (CpuBackend.limit_memory,
after transformers is imported), found by bisection with one fresh process per size.

Run: .venv/bin/python bench/hf.py [--budget 1GiB] [--family gpt2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from mbtune.probing.config import ProbeConfig
from mbtune.probing.run import probe_workload
from mbtune.records import OK
from mbtune.units import parse_bytes
from mbtune.worker import run_isolated
from mbtune.workloads import load_workload
from mbtune.workloads.flops import count_flops_per_sample
from mbtune.workloads.hf import _builder, _kind, hf_config

# The families the hf: workload is held to (tests/integration/test_hf.py holds the same list).
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "granite", "gpt_neox",
            "opt", "bert", "roberta")


def facts_table() -> None:
    """Per family, at its small default: the split, the parameters against the transformers model's, the
    largest difference of the logits (blocks against the whole model, same weights), the FLOPs counted per
    sample against 6 x parameters x tokens, and what loading (building, tracing, splitting) costs."""
    import torch

    print("family     blocks ties  parameters (hf: / transformers)  max |logits diff|  GFLOP/sample (counted / 6NT)"
          "  load s")
    for family in FAMILIES:
        started = time.perf_counter()
        workload = load_workload(f"hf:{family}")
        load_s = time.perf_counter() - started
        config, _ = hf_config(family, {})
        torch.manual_seed(0)
        whole = _builder(config, _kind(family), family)()
        ids, _ = workload.make_batch(2, torch.Generator().manual_seed(0))
        with torch.no_grad():
            diff = (workload.build(seed=0)(ids) - whole(ids)).abs().max().item()
        params = sum(p.numel() for p in whole.parameters())
        counted = count_flops_per_sample(workload) or 0.0
        rule = 6.0 * params * (workload.tokens_per_sample or 1)
        print(f"{family:<10} {workload.num_blocks:>6} {len(workload.ties):>4}  {workload.num_parameters():>12,} / "
              f"{params:<12,} {diff:>17.1e}  {counted / 1e9:>12.4f} / {rule / 1e9:<12.4f} {load_s:>7.1f}")


def plain_step(family: str, batch_size: int, memory_budget_bytes: int, use_cache: bool | None = None) -> str:
    """In a fresh process: the plain transformers model, capped as a trial is, two AdamW steps; ok or oom.
    `use_cache` None leaves the config's (True for the decoders: the forward keeps every layer's keys and
    values in a cache, which a training step never reads)."""
    import torch
    import transformers

    from mbtune.device.cpu import CpuBackend
    from mbtune.workloads.hf import DEFAULT_SEQ_LEN

    config, _ = hf_config(family, {})
    kind = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    kind.from_config(config, attn_implementation="sdpa")  # its code imported before the cap, as a trial does
    CpuBackend().limit_memory(memory_budget_bytes)
    try:
        model = kind.from_config(config, attn_implementation="sdpa")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, config.vocab_size, (batch_size, DEFAULT_SEQ_LEN))
        for _ in range(2):
            extra = {} if use_cache is None else {"use_cache": use_cache}
            model(input_ids=ids, labels=ids, **extra).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    except (RuntimeError, MemoryError) as exc:
        if "alloc" in str(exc).lower() or isinstance(exc, MemoryError):
            return "oom"
        raise
    return "ok"


def plain_ceiling(family: str, memory_budget_bytes: int, upper: int, use_cache: bool | None = None) -> tuple[int, int]:
    """The largest batch the plain loop trains at (bisection over fresh processes) and the runs it took."""
    runs = 0

    def fits(size: int) -> bool:
        nonlocal runs
        runs += 1
        result = run_isolated(plain_step, family, size, memory_budget_bytes, use_cache, timeout_s=600)
        return result.status == OK and result.value == "ok"

    if not fits(1):
        return 0, runs
    low, high = 1, max(2, upper)
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, runs


def ceiling_table(family: str, budget: str, repeats: int) -> None:
    """Each side measured `repeats` times, alternating, so a drift of the machine falls on both."""
    memory_budget_bytes = parse_bytes(budget, name="--budget")
    sides = {"mbtune probe": [], "plain loop, as configured": [], "plain loop, use_cache=False": []}
    costs: dict[str, list[tuple[int, float]]] = {name: [] for name in sides}
    for _ in range(repeats):
        started = time.monotonic()
        probe = probe_workload(ProbeConfig(workload=f"hf:{family}", device="cpu", memory_budget_bytes=memory_budget_bytes,
                                           resolution=1))
        sides["mbtune probe"].append(probe.ceiling)
        costs["mbtune probe"].append((len(probe.trials), time.monotonic() - started))
        for use_cache, name in ((None, "plain loop, as configured"), (False, "plain loop, use_cache=False")):
            started = time.monotonic()
            plain, runs = plain_ceiling(family, memory_budget_bytes, probe.ceiling, use_cache)
            sides[name].append(plain)
            costs[name].append((runs, time.monotonic() - started))
    print(f"\nhf:{family} under {budget} on CPU, {repeats} run(s) each (ceiling: median [min-max])")
    mine = statistics.median(sides["mbtune probe"])
    for name, ceilings in sides.items():
        runs = statistics.median(r for r, _ in costs[name])
        wall = statistics.median(w for _, w in costs[name])
        ratio = "" if name == "mbtune probe" else (
            f"; mbtune / plain = {mine / statistics.median(ceilings):.3f} (per run "
            + ", ".join(f"{m / p:.3f}" if p else "n/a" for m, p in zip(sides["mbtune probe"], ceilings)) + ")")
        print(f"  {name:<28} {statistics.median(ceilings):>6g} [{min(ceilings)}-{max(ceilings)}]"
              f"  ({runs:g} fresh runs, {wall:.0f} s median){ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--family", default="gpt2", choices=FAMILIES)
    parser.add_argument("--repeats", type=int, default=3, help="ceiling measurements per side (median reported)")
    args = parser.parse_args()
    facts_table()
    ceiling_table(args.family, args.budget, args.repeats)


if __name__ == "__main__":
    main()
