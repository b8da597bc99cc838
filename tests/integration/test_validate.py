"""`mbtune check --workload X` with no pipeline options: the workload validated block by block, in seconds,
before any pipeline runs."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_cli import mbtune

pytestmark = pytest.mark.integration

GPT = ["-O", "n_layer=2", "-O", "n_embd=32", "-O", "n_head=2", "-O", "block_size=16", "-O", "vocab_size=64"]


def test_a_model_as_written_validates_with_its_split_ties_and_own_loss():
    result = mbtune("check", "-w", "examples.nanogpt.workload:gpt", *GPT, "-d", "cpu", "-f", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["status"] == "PASS"
    assert [b["name"] for b in report["blocks"]] == ["before transformer.h.0", "transformer.h.0", "transformer.h.1",
                                                    "after transformer.h.1"]
    assert report["ties"] == [["0.transformer.wte.weight", "3.lm_head.weight"]]
    assert report["model_loss"] == pytest.approx(report["loss"], rel=1e-6)  # the blocks compute the model's loss
    assert all(b["gradient_back"] and b["ok"] for b in report["blocks"])
    assert report["blocks"][1]["flops_per_sample"] > 0


def test_a_block_that_breaks_the_graph_fails_by_name():
    result = mbtune("check", "-w", "tests.fixtures.workloads:detaching", "-d", "cpu")
    assert result.returncode == 1, result.stderr
    assert "block 1 (_Detaching): its input gets no gradient back" in " ".join(result.stdout.split())


def test_a_checkout_of_mbtune_in_the_users_folder_does_not_shadow_the_installed_one(tmp_path):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "mbtune"  # the console script, as a user runs it (not python -m)
    if not script.exists():
        pytest.skip("no mbtune console script beside this interpreter")
    (tmp_path / "mbtune").mkdir()
    (tmp_path / "mbtune" / "__init__.py").write_text("raise ImportError('a checkout, not the installed mbtune')\n")
    shutil.copy(Path(__file__).parents[1] / "fixtures" / "user_workload.py", tmp_path / "userwl.py")
    result = subprocess.run([str(script), "check", "-w", "userwl:workload", "-d", "cpu"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "check PASS" in result.stdout
