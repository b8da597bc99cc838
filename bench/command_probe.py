"""Benchmark: `mbtune probe -- COMMAND` on each way users train, beside Lightning's own batch-size finder.

For each training script in tests/fixtures/train_scripts (a plain loop, the transformers Trainer, a Lightning
Trainer, an Accelerate loop, torchrun with DDP over 2 processes), under one CPU budget: the probe's trials,
its wall time, the ceiling, first failing size and safe batch, the median trial (start-up included), and
the safe batch held to the script under `mbtune confirm` (3 runs). Then Lightning's BatchSizeFinder
(binsearch, in one process, as its docs run it) on the Lightning script under the same cap, and its answer
held to the same script under confirm.

Run: .venv/bin/python bench/command_probe.py [--budget 64MiB] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mbtune.probing.command import CommandTrial, check_template, command_at, search_command
from mbtune.probing.confirm import ConfirmConfig, confirm_command, run_capped
from mbtune.units import parse_bytes

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "fixtures" / "train_scripts"
PY = sys.executable
# name: (command with {batch}, what bounds a confirm run, granularity); a way whose steps are lines it prints
# names them in PRINTED.
PRINTED = {"update by hand, steps from its output": r"^step \d+ loss"}
WAYS = {
    "plain loop": ([PY, str(SCRIPTS / "plain_loop.py"), "--batch-size", "{batch}", "--width", "256"],
                   ["--epochs", "1"], 32),
    "transformers Trainer": ([PY, str(SCRIPTS / "hf_trainer.py"), "--batch-size", "{batch}", "--output-dir",
                              "/tmp/mbtune-bench-trainer"], ["--max-steps", "6"], 16),
    "Lightning Trainer": ([PY, str(SCRIPTS / "lightning_module.py"), "--batch-size", "{batch}"],
                          ["--max-steps", "6"], 32),
    "Accelerate loop": ([PY, str(SCRIPTS / "accelerate_loop.py"), "--batch-size", "{batch}"], ["--epochs", "1"], 32),
    "torchrun DDP x2": ([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPTS / "ddp_loop.py"),
                         "--batch-size", "{batch}"], ["--steps", "6"], 32),
    "update by hand, steps from its output": ([PY, str(SCRIPTS / "manual_sgd.py"), "--batch-size", "{batch}"],
                                              ["--steps", "6"], 32),
}
# Lightning's finder as its docs run it: Tuner(trainer).scale_batch_size on a module holding `batch_size`.
FINDER = """
import json, sys, torch, pytorch_lightning as pl
from pytorch_lightning.tuner import Tuner
sys.path.insert(0, {scripts!r})
from lightning_module import Classifier

class Tuned(Classifier):
    def __init__(self):
        super().__init__(256)
        self.batch_size = 2
        self.data = torch.utils.data.TensorDataset(torch.randn(8192, 256), torch.randint(0, 10, (8192,)))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

torch.set_num_threads(1)
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
found = Tuner(trainer).scale_batch_size(Tuned(), mode="binsearch", max_trials=25)
print("FOUND", json.dumps(found))
"""


def probe(name: str, budget: int) -> dict:
    template, bounded, granularity = WAYS[name]
    trials: list = []
    started = time.perf_counter()
    found = search_command(CommandTrial(command=check_template(template), memory_budget_bytes=budget, steps=3,
                                        timeout_s=600, steps_from_output=PRINTED.get(name)),
                           granularity=granularity, resolution=granularity,
                           on_trial=trials.append)
    wall_s = time.perf_counter() - started
    held = confirm_command(ConfirmConfig(command=command_at(template, found.safe_batch) + bounded,
                                         memory_budget_bytes=budget, runs=3))
    return {"way": name, "trials": len(trials), "wall_s": round(wall_s, 1),
            "median_trial_s": round(statistics.median(t.wall_s for t in trials), 2),
            "median_startup_s": round(statistics.median(t.startup_s for t in trials if t.startup_s is not None), 2),
            "median_step_s": round(statistics.median(t.step_time_s for t in trials if t.step_time_s), 4),
            "ceiling": found.ceiling, "first_failing": found.first_failing, "safe_batch": found.safe_batch,
            "safe_batch_under_confirm": [run.outcome for run in held.runs]}


def lightning_finder(budget: int) -> dict:
    started = time.perf_counter()
    capped = run_capped([PY, "-c", FINDER.format(scripts=str(SCRIPTS))], budget, "cpu", 900)
    wall_s = time.perf_counter() - started
    line = next((line for line in capped.output.splitlines() if line.startswith("FOUND ")), "")
    found = json.loads(line.split(" ", 1)[1]) if line else None
    row: dict = {"way": "Lightning BatchSizeFinder (binsearch, one process)", "wall_s": round(wall_s, 1),
                 "found": found, "exit_code": capped.exit_code}
    if found:
        template, bounded, _ = WAYS["Lightning Trainer"]
        held = confirm_command(ConfirmConfig(command=command_at(template, found) + bounded,
                                             memory_budget_bytes=budget, runs=3))
        row["found_under_confirm"] = [run.outcome for run in held.runs]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="64MiB")
    parser.add_argument("--only", default="", help="run only the ways whose name contains this text")
    args = parser.parse_args()
    budget = parse_bytes(args.budget, name="--budget")
    rows = [probe(name, budget) for name in WAYS if args.only.lower() in name.lower()]
    if args.only.lower() in "lightning batchsizefinder":
        rows.append(lightning_finder(budget))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
