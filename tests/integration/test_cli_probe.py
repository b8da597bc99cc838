"""`mbtune probe` and `mbtune show` end to end, as a user runs them."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_cli import mbtune

pytestmark = pytest.mark.integration

QUICK = ["-w", "mlp", "-O", "layers=1", "-O", "width=64", "-d", "cpu", "--threads", "1", "--max-batch", "64"]


def test_probe_json_parses_and_profile_is_shown(tmp_path):
    result = mbtune("probe", *QUICK, "--format", "json", "--profiles-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ceiling"] == 64 and data["first_failing"] is None
    assert data["safe_batch"] == 54 and data["safe_batch_verified"] is True
    assert all(t["status"] == "ok" for t in data["trials"])
    [saved] = list(tmp_path.glob("cpu-*/mlp.json"))
    shown = mbtune("show", str(saved), "--format", "json")
    assert json.loads(shown.stdout)["probe"]["ceiling"] == 64
    table = mbtune("show", str(saved))
    assert table.returncode == 0 and "safe batch" in table.stdout and "54" in table.stdout


def test_probe_table_lists_every_trial(tmp_path):
    result = mbtune("probe", *QUICK, "--no-save", "--profiles-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "Trials" in result.stdout and "Probe result" in result.stdout and "ceiling" in result.stdout
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("options", "budget"), [([], "1MiB"), (["-O", "layers=2", "-O", "width=64"], "16KiB")])
def test_budget_too_small_for_batch_1_is_bad_input(options, budget):
    # The budget counts live tensor bytes: the narrow mlp's weights and AdamW's state alone are 100 KiB.
    result = mbtune("probe", "-w", "mlp", *options, "-d", "cpu", "--memory-budget", budget, "--no-save")
    assert result.returncode == 2
    assert "batch 1 runs out of memory already" in result.stderr and "--memory-budget" in result.stderr
    assert "Traceback" not in result.stderr


def test_workload_failing_for_another_reason_is_bad_input_not_oom():
    result = mbtune("probe", "-w", "tests.fixtures.workloads:broken", "-d", "cpu", "--no-save")
    assert result.returncode == 2
    assert "not for lack of memory" in result.stderr and "shape mismatch" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_readme_workload_example_runs_from_the_current_folder(tmp_path):
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "mbtune"
    if not script.exists():
        pytest.skip("the mbtune console script is not installed next to this interpreter")
    # The README's workload example lives in the guide the README links to.
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "own-models-and-hf.md").read_text()
    example = re.search(r"```python\n(# mypkg/workloads.py.*?)```", guide, re.S).group(1)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "workloads.py").write_text(example)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(script), "probe", "--workload", "mypkg.workloads:tiny", "-O", "width=128",
                             "-d", "cpu", "--max-batch", "16", "--no-save", "--format", "json"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ceiling"] == 16


def test_a_settings_file_sets_the_probe_and_flags_win_over_it(tmp_path):
    settings = tmp_path / "run.toml"
    settings.write_text('workload = "mlp"\ndevice = "cpu"\n[options]\nlayers = 1\nwidth = 64\n'
                        "[probe]\nmargin = 0.2\nthreads = 1\nmax_batch = 64\n")
    out = tmp_path / "probe.json"  # the name picks the format
    result = mbtune("probe", "--config", str(settings), "--max-batch", "32", "--no-save", "-o", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["workload"] == "mlp" and dict(data["workload_options"]) == {"layers": 1, "width": 64}
    assert data["ceiling"] == 32  # the flag's max batch, not the file's
    assert data["margin"] == 0.2 and data["safe_batch"] == 25  # the file's margin: floor(32 x 0.8)
