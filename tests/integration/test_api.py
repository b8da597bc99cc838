"""The public Python API, run as a user's script runs it: in its own interpreter, under a main guard."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from mbtune.errors import ConfigError
from tests.unit.test_cli import ROOT

pytestmark = pytest.mark.integration


def run_script(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_probe_and_sweep_from_python_return_records_and_save_where_asked(tmp_path):
    result = run_script(tmp_path, f"""
        import json, mbtune
        if __name__ == "__main__":
            probe = mbtune.probe(workload="mlp", options={{"layers": 2, "width": 32}}, device="cpu",
                                 memory_budget="256MiB", max_batch=64, trial_timeout=120, save_to={str(tmp_path)!r})
            sweep = mbtune.sweep(workload="mlp", options={{"layers": 2, "width": 32}}, device="cpu", stages=2,
                                 schedules=["gpipe"], micro_batches=[2], accum=[1], micro_batch_size=2, steps=1,
                                 lr=0.01, reference_batch=2, seed=3)
            print(json.dumps({{"probe": type(probe).__name__, "safe": probe.safe_batch, "ceiling": probe.ceiling,
                              "sweep": type(sweep).__name__, "statuses": [r.status for r in sweep.results],
                              "repr": repr(probe), "advice": [a.to_dict() for a in sweep.lr_advice]}}))
    """)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["probe"] == "ProbeResult" and found["sweep"] == "SweepReport"
    assert found["safe"] <= found["ceiling"] <= 64 and found["statuses"] == ["ok"]
    # global batch 2 x 2 = 4 against the recipe's 2 with AdamW: the square-root rule, 0.01 x sqrt(2)
    [advice] = found["advice"]
    assert (advice["global_batch"], advice["reference_batch"], advice["rule"]) == (4, 2, "square-root")
    assert advice["lr"] == pytest.approx(0.01 * 2**0.5)
    [profile] = tmp_path.glob("cpu-*/mlp.json")
    assert json.loads(profile.read_text())["probe"]["ceiling"] == found["ceiling"]


def test_unknown_settings_are_refused_by_name():
    import mbtune

    with pytest.raises(ConfigError, match="unknown setting 'margn'"):
        mbtune.probe(workload="mlp", device="cpu", margn=0.1)
    with pytest.raises(ConfigError, match="unknown setting 'stagez'"):
        mbtune.tune(workload="mlp", device="cpu", stagez=2)


def test_the_readme_python_example_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    api_section = readme[readme.index("## Python API"):]
    example = re.findall(r"```python\n(.*?)```", api_section, flags=re.S)[0]
    result = run_script(tmp_path, example)
    assert result.returncode == 0, result.stderr
    assert "safe batch" in result.stdout


def test_plan_from_python_takes_flag_names():
    import mbtune
    from tests.unit.test_plan_api import profile

    report = mbtune.plan(profile(), stages=2, micro_batches=[4], schedules=["gpipe"], accum=2, validation=None)
    assert report.best is not None and report.best.point.grad_accum_steps == 2
    with pytest.raises(ConfigError, match="unknown setting 'stagez'"):
        mbtune.plan(profile(), stagez=2)


def test_the_api_runs_from_a_script_read_from_standard_input(tmp_path):
    """`python - <<EOF`: no main file for the worker processes to import, and no main guard needed."""
    script = textwrap.dedent("""
        import mbtune
        probe = mbtune.probe(workload="mlp", options={"layers": 1, "width": 16}, device="cpu",
                             memory_budget="256MiB", max_batch=8, trial_timeout=120)
        print("ceiling", probe.ceiling, "safe", probe.safe_batch)
    """)
    result = subprocess.run([sys.executable, "-"], input=script, cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    ceiling, safe = map(int, re.fullmatch(r"ceiling (\d+) safe (\d+)", result.stdout.strip().splitlines()[-1]).groups())
    assert 1 <= safe <= ceiling <= 8
