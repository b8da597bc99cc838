#!/usr/bin/env bash
# The one prepared check to run on a GPU machine (one GPU, at most 8 minutes), from a plain checkout on a
# machine that already has torch, typer, rich, pandas, nvidia-ml-py and pytest. It installs nothing: mbtune
# runs from the checkout (PYTHONPATH), so the machine's torch is the one measured.
#
# Steps, each under its own timeout; a failed step is recorded and the next one still runs:
#   pytest          python -m pytest -q tests/gpu
#   probe-device    bf16 probe of a GPT of realistic size (~400M parameters, seq_len 1024), whole device
#   probe-budget    the same under --memory-budget 16GiB
#   sweep           a one-GPU sweep (gpipe and 1f1b, one stage) with NVML sampling, and the machine state it
#                   ran in (SM and memory clocks, clock-event reasons, temperature, power and limit, ECC, PCIe)
#   warm-ranks      bench/warm_ranks.py: a repeat's overhead on rank processes kept between points (their CUDA
#                   context and NCCL group made once) against fresh ones, and the two modes' throughput and
#                   peak memory side by side
#   confirm-memory  `confirm --duration` of a plain loop whose evaluation pass (every few steps, at its own larger
#                   batch) raises the high-water mark: the peak over time, the rise named, and on CUDA the
#                   caching allocator's retries and fragmentation (reserved but unallocated, inactive split)
#   plan-memory     `plan` of an 8B-parameter Llama on 8 stages of 141 GB, no profile: every stage's peak on
#                   fake tensors, timed on this machine's cores (the built-in GPT at the same sizes where
#                   transformers is missing or torch is older than 2.13)
#   summary         one JSON of every figure: ceiling, safe batch, the ceiling predicted on fake tensors before
#                   any trial, throughput, MFU, NVML kernel-active share, peak memory, CUDA-event against
#                   wall-clock step time
# tests/gpu holds the CUDA checks of memory (kept rank processes included: tests/gpu/test_cuda_warm_ranks.py): a trial's predicted peak against its allocated peak,
# the machine state sampled through NVML as qualify records and judges it (tests/gpu/test_cuda_state.py),
# `mbtune confirm` holding a CUDA script to the per-process memory fraction (and its allocator's retries and
# fragmentation over a run: tests/gpu/test_cuda_confirm_memory.py), and `mbtune probe -- COMMAND`
# probing a CUDA training script under it (tests/gpu/test_cuda_command_probe.py); an hf: trial's peak against
# the plain transformers loop's, and `mbtune sweep -- COMMAND` of a pipelined script on NCCL
# (tests/gpu/test_cuda_whole_model.py).
# Every output is a JSON file in $OUT (./gpu-check-out when OUT is unset); the summary is printed last.
# The exit status is nonzero when any step failed.
#
# Usage: bench/gpu_check.sh [--cpu-dry-run]
#   --cpu-dry-run  the same steps on a tiny GPT on the CPU (also what happens when no CUDA device is
#                  visible); the summary then says device cpu.
#   PYTHON=...     the interpreter to use (default: the first of python3, python, .venv/bin/python that
#                  imports torch, preferring one that sees a CUDA device).

set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
OUT_DIR=${OUT:-./gpu-check-out}
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

MODE=auto
for arg in "$@"; do
  case "$arg" in
    --cpu-dry-run) MODE=cpu ;;
    -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done

has_torch() { "$1" -c "import torch" >/dev/null 2>&1; }
has_cuda() { "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }

pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  local first="" candidate
  for candidate in python3 python "$ROOT/.venv/bin/python"; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    has_torch "$candidate" || continue
    [ -n "$first" ] || first=$candidate
    if [ "$MODE" != cpu ] && has_cuda "$candidate"; then echo "$candidate"; return; fi
  done
  echo "${first:-python3}"
}

PY=$(pick_python)
if ! "$PY" -c "import mbtune.cli" 2>"$OUT_DIR/setup.stderr.txt"; then
  echo "cannot import mbtune with $PY (see $OUT_DIR/setup.stderr.txt): it needs torch, typer, rich, pandas" >&2
  exit 2
fi
if [ "$MODE" = auto ]; then
  if has_cuda "$PY"; then MODE=gpu; else MODE=cpu; echo "no CUDA device visible to $PY: CPU dry run" >&2; fi
fi

BUDGET=16GiB
if [ "$MODE" = gpu ]; then
  DEVICE=cuda
  MODEL=(-O layers=24 -O d_model=1024 -O heads=16 -O seq_len=1024 -O vocab=50304)
  PROBE_DEVICE=(--granularity 8 --max-batch 512)
  PROBE_BUDGET=(--granularity 2 --max-batch 128)  # ~7 samples fit in 16 GiB: a granule of 8 would say 0
  SWEEP=(--schedules gpipe,1f1b -m 4 --accum 1 --micro-batch-size 4 --warmup 2 --steps 10)
  LIMIT_PYTEST=180 LIMIT_DEVICE=130 LIMIT_BUDGET=70 LIMIT_SWEEP=70
  TRIAL_TIMEOUT=60 POINT_TIMEOUT=50
  WARM=(--device cuda --stages 1 --rounds 2) LIMIT_WARM=90
  CONFIRM=(--duration 20s) CONFIRM_SCRIPT=(--batch-size 64 --eval-batch-size 65536 --width 256 --eval-every 20) LIMIT_CONFIRM=60
else
  DEVICE=cpu
  MODEL=(-O layers=2 -O d_model=32 -O heads=2 -O seq_len=16 -O vocab=128)
  PROBE_DEVICE=(--granularity 4 --max-batch 8)
  PROBE_BUDGET=(--granularity 4 --max-batch 8)
  SWEEP=(--schedules gpipe -m 2 --accum 1 --micro-batch-size 2 --warmup 1 --steps 2 --threads 1)
  LIMIT_PYTEST=60 LIMIT_DEVICE=60 LIMIT_BUDGET=60 LIMIT_SWEEP=60
  TRIAL_TIMEOUT=60 POINT_TIMEOUT=50
  WARM=(--device cpu --stages 1 --rounds 1 --points 1 "${MODEL[@]}") LIMIT_WARM=60
  CONFIRM=(--duration 15s) CONFIRM_SCRIPT=(--batch-size 8 --eval-batch-size 2048 --width 64 --eval-every 3) LIMIT_CONFIRM=60
fi

STEPS_FILE="$OUT_DIR/steps.tsv"
printf 'step\trc\tseconds\n' >"$STEPS_FILE"
FAILED=()

# run_step NAME LIMIT_S STDOUT_FILE COMMAND...: stdout to the file, stderr beside it, rc and time recorded.
run_step() {
  local name=$1 limit=$2 stdout=$3 started rc
  shift 3
  echo "== $name (at most ${limit} s)" >&2
  started=$(date +%s%N)
  timeout -k 10 "$limit" "$@" >"$stdout" 2>"$OUT_DIR/$name.stderr.txt"
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( ($(date +%s%N) - started) / 1000000 ))e-3" >>"$STEPS_FILE"
  if [ "$rc" -ne 0 ]; then
    FAILED+=("$name")
    echo "   $name failed (rc $rc; 124: timed out); last lines of its stderr:" >&2
    tail -n 5 "$OUT_DIR/$name.stderr.txt" >&2
  fi
}

MBTUNE=("$PY" -m mbtune)
COMMON=(-w gpt "${MODEL[@]}" -d "$DEVICE" --precision bf16 --no-save -f json)

run_step pytest "$LIMIT_PYTEST" "$OUT_DIR/pytest.txt" \
  "$PY" -m pytest -q -p no:cacheprovider tests/gpu --junitxml "$OUT_DIR/pytest.xml"
run_step probe-device "$LIMIT_DEVICE" "$OUT_DIR/probe-device.json" \
  "${MBTUNE[@]}" probe "${COMMON[@]}" "${PROBE_DEVICE[@]}" --confirm 1 --trial-timeout "$TRIAL_TIMEOUT"
run_step probe-budget "$LIMIT_BUDGET" "$OUT_DIR/probe-budget.json" \
  "${MBTUNE[@]}" probe "${COMMON[@]}" "${PROBE_BUDGET[@]}" --memory-budget "$BUDGET" --confirm 1 \
  --trial-timeout "$TRIAL_TIMEOUT"
run_step sweep "$LIMIT_SWEEP" "$OUT_DIR/sweep.json" \
  "${MBTUNE[@]}" sweep "${COMMON[@]}" --stages 1 "${SWEEP[@]}" --point-timeout "$POINT_TIMEOUT"

run_step warm-ranks "$LIMIT_WARM" "$OUT_DIR/warm-ranks.txt" \
  "$PY" bench/warm_ranks.py "${WARM[@]}" --json "$OUT_DIR/warm-ranks.json"

run_step confirm-memory "$LIMIT_CONFIRM" "$OUT_DIR/confirm-memory.json" \
  "${MBTUNE[@]}" confirm --memory-budget 2GiB -d "$DEVICE" "${CONFIRM[@]}" -f json -- \
  "$PY" tests/fixtures/train_scripts/eval_loop.py "${CONFIRM_SCRIPT[@]}" --device "$DEVICE"

# The user's own pipelined command (torch.distributed.pipelining under torchrun, one stage: one GPU): its bubble
# timed by the cap, its GPU found and sampled by NVML.
if [ "$MODE" = gpu ]; then CMD_SWEEP=(--micro-batch-size 64 --steps 10) CMD_WIDTH=1024
else CMD_SWEEP=(--micro-batch-size 8 --steps 2) CMD_WIDTH=64; fi
run_step sweep-command "$LIMIT_SWEEP" "$OUT_DIR/sweep-command.json" \
  "${MBTUNE[@]}" sweep -d "$DEVICE" --stages 1 --schedules gpipe -m 4 --accum 1 "${CMD_SWEEP[@]}" --repeats 1 \
  --no-save -f json --point-timeout "$POINT_TIMEOUT" -- "$PY" -m torch.distributed.run --nproc-per-node 1 \
  tests/fixtures/train_scripts/pipe_mlp.py --micro-batch-size '{micro_batch_size}' \
  --micro-batches '{micro_batches}' --schedule '{schedule}' --width "$CMD_WIDTH" --device "$DEVICE"

# hf:llama where it pipelines (transformers installed; torch 2.13 or later, which hands its bool attention mask
# between stages), else the built-in GPT at the same sizes.
if "$PY" -c "import sys, torch, transformers; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 13))" \
    >/dev/null 2>&1; then
  if [ "$MODE" = gpu ]; then
    PLAN_MODEL=(-w hf:llama -O hidden_size=4096 -O intermediate_size=14336 -O num_hidden_layers=32
                -O num_attention_heads=32 -O num_key_value_heads=8 -O vocab_size=128256 -O max_position_embeddings=8192
                -O seq_len=4096)
  else
    PLAN_MODEL=(-w hf:llama -O hidden_size=64 -O intermediate_size=128 -O num_hidden_layers=8 -O num_attention_heads=4
                -O num_key_value_heads=2 -O vocab_size=256 -O seq_len=32)
  fi
elif [ "$MODE" = gpu ]; then
  PLAN_MODEL=(-w gpt -O layers=32 -O d_model=4096 -O heads=32 -O seq_len=4096 -O vocab=128256)
else
  PLAN_MODEL=(-w gpt -O layers=8 -O d_model=64 -O heads=4 -O seq_len=32 -O vocab=256)
fi
run_step plan-memory 120 "$OUT_DIR/plan-memory.json" \
  "${MBTUNE[@]}" plan "${PLAN_MODEL[@]}" --device-memory 141GB --stages 8 --schedules 1f1b -m 8 --precision bf16 -f json

export GPU_CHECK_OUT="$OUT_DIR" GPU_CHECK_MODE="$MODE" GPU_CHECK_BUDGET="$BUDGET"
run_step summary 30 "$OUT_DIR/summary.json" "$PY" - <<'PY'
"""Read the steps' outputs and print one JSON of the figures; a missing or broken output becomes an error."""
import json
import os
import statistics
import xml.etree.ElementTree as ElementTree

from mbtune.device.peak_flops import peak_flops
from mbtune.planning.memory_plan import MemoryPlan
from mbtune.probing.confirm import ConfirmResult
from mbtune.probing.records import ProbeResult
from mbtune.sweeping.records import SweepReport

out = os.environ["GPU_CHECK_OUT"]


def load(name, parse):
    try:
        with open(os.path.join(out, name)) as f:
            return parse(json.load(f)), None
    except Exception as exc:  # a step that failed leaves nothing, or half a file
        return None, f"{name}: {type(exc).__name__}: {exc}"


def median(values):
    return statistics.median(values) if values else None


def probe_figures(probe):
    at = {t.batch_size: t for t in probe.trials if t.ok}
    ceiling, safe = at.get(probe.ceiling), at.get(probe.safe_batch)
    rate = safe.samples_per_s if safe else None
    peak = peak_flops(probe.device.name, probe.precision)
    return {
        "ceiling": probe.ceiling, "first_failing": probe.first_failing, "safe_batch": probe.safe_batch,
        "safe_batch_verified": probe.safe_batch_verified, "num_trials": len(probe.trials),
        "memory_budget_bytes": probe.memory_budget_bytes, "num_parameters": probe.num_parameters,
        "peak_memory_bytes_at_ceiling": ceiling.peak_memory_bytes if ceiling else None,
        "peak_reserved_bytes_at_ceiling": ceiling.peak_reserved_bytes if ceiling else None,
        "samples_per_s_at_safe_batch": rate,
        "predicted_ceiling": probe.predicted.ceiling if probe.predicted else None,
        "predicted_peak_bytes": probe.predicted.peak_bytes if probe.predicted else None,
        "mfu_pct_at_safe_batch": 100.0 * probe.flops_per_sample * rate / peak
        if rate and peak and probe.flops_per_sample else None,
    }


def point_figures(r):
    wall, cuda = median(r.step_times_s), median(r.cuda_step_times_s)
    gpus = r.nvml.gpus if r.nvml and r.nvml.available else ()
    return {
        "point": r.point.label, "status": r.status, "error": r.error, "samples_per_s": r.samples_per_s,
        "tokens_per_s": r.tokens_per_s, "mfu_pct": r.mfu_pct, "step_time_median_s": wall,
        "cuda_step_time_median_s": cuda, "cuda_over_wall": cuda / wall if cuda and wall else None,
        "cuda_step_le_wall_every_step": all(c <= w + 1e-5 for c, w in zip(r.cuda_step_times_s, r.step_times_s))
        if r.cuda_step_times_s else None,
        "peak_memory_bytes": list(r.peak_memory_bytes), "bubble_measured": r.bubble_measured,
        "nvml": {"available": bool(gpus), "reason": r.nvml.reason if r.nvml else "",
                 "gpus": [{"uuid": g.uuid, "num_samples": g.num_samples,
                           "kernel_active_pct_median": g.kernel_active_pct_median,
                           "memory_used_bytes_max": g.memory_used_bytes_max, "power_w_median": g.power_w_median,
                           "sm_clock_mhz_median": g.sm_clock_mhz_median} for g in gpus]},
        "load": r.load.to_dict() if r.load else None, "warnings": list(r.warnings),
    }


def confirm_figures(result):
    """The confirm run's memory over time: its peak, the mark after its first steps, the rises named, the
    passes seen, and on CUDA the allocator's retries and fragmentation."""
    run = result.runs[0]
    memory = run.high_water
    figures = {"outcome": run.outcome, "stopped": run.stopped, "wall_s": run.wall_s, "peak_bytes": run.peak_bytes}
    if memory is None:
        return {**figures, "high_water": None}
    return {**figures, "settled_peak_bytes": memory.settled_peak_bytes, "rose": memory.rose,
            "rises": [r.to_dict() for r in memory.rises], "num_steps": memory.num_steps,
            "num_evaluations": memory.num_evaluations, "num_checkpoints": memory.num_checkpoints,
            "num_samples": len(memory.samples), "num_alloc_retries": memory.num_alloc_retries,
            "max_reserved_bytes": memory.max_reserved_bytes,
            "max_unallocated_reserved_bytes": memory.max_unallocated_reserved_bytes,
            "max_inactive_split_bytes": memory.max_inactive_split_bytes}


def pytest_counts():
    try:
        suite = ElementTree.parse(os.path.join(out, "pytest.xml")).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]}
    except Exception as exc:
        return {"error": f"pytest.xml: {type(exc).__name__}: {exc}"}


steps = {}
with open(os.path.join(out, "steps.tsv")) as f:
    for line in f.read().splitlines()[1:]:
        name, rc, seconds = line.split("\t")
        steps[name] = {"rc": int(rc), "seconds": float(seconds), "ok": rc == "0"}
errors, probes, devices = [], {}, []
for key, name in (("probe_whole_device", "probe-device.json"), ("probe_budget", "probe-budget.json")):
    probe, error = load(name, ProbeResult.from_dict)
    probes[key] = probe_figures(probe) if probe else None
    errors += [error] if error else []
    devices += [probe.device] if probe else []
plan = None
if os.path.exists(os.path.join(out, "plan-memory.json")):
    plan, error = load("plan-memory.json", MemoryPlan.from_dict)
    errors += [error] if error else []
sweep, error = load("sweep.json", SweepReport.from_dict)
errors += [error] if error else []
warm, error = load("warm-ranks.json", lambda figures: figures)
errors += [error] if error else []
confirm, error = load("confirm-memory.json", ConfirmResult.from_dict)
errors += [error] if error else []
command_sweep, error = load("sweep-command.json", SweepReport.from_dict)
errors += [error] if error else []
devices += [sweep.device] if sweep else []
device = devices[0] if devices else None
summary = {
    "mode": "gpu" if os.environ["GPU_CHECK_MODE"] == "gpu" else "cpu-dry-run",
    "device": device.backend if device else ("cuda" if os.environ["GPU_CHECK_MODE"] == "gpu" else "cpu"),
    "device_name": device.name if device else None,
    "torch_version": device.torch_version if device else None,
    "driver_version": device.driver_version if device else None,
    "memory_budget": os.environ["GPU_CHECK_BUDGET"],
    "steps": steps, "pytest": pytest_counts(), **probes,
    "sweep": {"points": [point_figures(r) for r in sweep.results],
              "best": sweep.best.point.label if sweep.best else None,
              "warnings": list(sweep.warnings),
              # The state the sweep ran in (NVML: clocks, clock-event reasons, temperature, power, ECC, PCIe).
              "machine_state": sweep.machine_state.to_dict() if sweep.machine_state else None} if sweep else None,
    "warm_ranks": warm,
    # The user's pipelined command: its bubble from the cap's timing, NVML on the GPU its processes used.
    "sweep_command": {"points": [{**point_figures(r), "bubble_theoretical": r.bubble_theoretical,
                                  "bubble_unmeasured": r.bubble_unmeasured} for r in command_sweep.results]}
    if command_sweep else None,
    "confirm_memory": confirm_figures(confirm) if confirm else None,
    "plan_memory": {"workload": plan.workload, "seconds": plan.seconds, "cpus": len(os.sched_getaffinity(0)),
                    "rows": [{"label": f"{r.schedule} m{r.num_micro_batches} {r.recompute}",
                              "micro_batch_size": r.micro_batch_size, "binding_rank": r.binding_rank,
                              "peak_gib": [round(b / 2**30, 1) for b in r.peak_bytes]} for r in plan.rows]}
    if plan else None,
    "errors": errors,
    "ok": all(s["ok"] for s in steps.values()) and not errors,
}
print(json.dumps(summary, indent=2))
PY

cat "$OUT_DIR/summary.json"
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "failed steps: ${FAILED[*]} (outputs in $OUT_DIR)" >&2
  exit 1
fi
echo "every step passed (outputs in $OUT_DIR)" >&2
