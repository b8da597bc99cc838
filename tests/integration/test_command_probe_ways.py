"""`mbtune probe -- COMMAND` on every way users train, each script as its library's docs write it (small
models, random data, no downloads): the probe's safe batch fits the script 3 of 3 under `mbtune confirm`, and
one granule above the ceiling does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mbtune.probing.command import CommandTrial, check_template, search_command
from mbtune.probing.confirm import FITS, OUT_OF_MEMORY, ConfirmConfig, confirm_command

pytestmark = pytest.mark.integration


SCRIPTS = Path(__file__).parents[1] / "fixtures" / "train_scripts"
# Each way users train, as its library's docs write it, the probe's command and what bounds a confirm run.
WAYS = {
    "transformers Trainer": ([sys.executable, str(SCRIPTS / "hf_trainer.py"), "--batch-size", "{batch}",
                              "--output-dir", "{out}"], ["--max-steps", "6"], 16),
    "Lightning Trainer": ([sys.executable, str(SCRIPTS / "lightning_module.py"), "--batch-size", "{batch}"],
                          ["--max-steps", "6"], 512),
    "Accelerate loop": ([sys.executable, str(SCRIPTS / "accelerate_loop.py"), "--batch-size", "{batch}"],
                        ["--epochs", "1"], 512),
    "torchrun DDP over 2 processes": ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                       str(SCRIPTS / "ddp_loop.py"), "--batch-size", "{batch}"], ["--steps", "6"], 512),
}


@pytest.mark.slow
@pytest.mark.parametrize("way", list(WAYS))
def test_the_safe_batch_holds_in_every_way_users_train(way: str, tmp_path: Path) -> None:
    if way == "Lightning Trainer":
        pytest.importorskip("pytorch_lightning")
    if way == "Accelerate loop":
        pytest.importorskip("accelerate")
    if way == "transformers Trainer":
        pytest.importorskip("transformers")
    template, bounded, granularity = WAYS[way]
    template = [arg.replace("{out}", str(tmp_path / "out")) for arg in template]
    budget = 64 * 2**20
    found = search_command(CommandTrial(command=check_template(template), memory_budget_bytes=budget, steps=3,
                                        timeout_s=300), granularity=granularity, resolution=granularity)
    assert found.ceiling and found.safe_batch and found.first_failing == found.ceiling + granularity

    def at(size: int) -> list[str]:
        return [arg.replace("{batch}", str(size)) for arg in template] + bounded

    fits = confirm_command(ConfirmConfig(command=at(found.safe_batch), memory_budget_bytes=budget, runs=3))
    assert [run.outcome for run in fits.runs] == [FITS] * 3, fits.runs[-1].cause
    above = confirm_command(ConfirmConfig(command=at(found.first_failing), memory_budget_bytes=budget, runs=1))
    assert above.runs[0].outcome == OUT_OF_MEMORY
