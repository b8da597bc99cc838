"""`--config FILE` for probe, sweep and tune: a spec-schema TOML file read as the command's option values."""

from __future__ import annotations

import pytest

from mbtune.errors import ConfigError
from mbtune.probing.config import ProbeConfig
from mbtune.qualifying.specfile import read_settings
from mbtune.settings import field_for, param_for
from mbtune.sweeping.config import SweepConfig

FILE = """
workload = "mlp"
device = "cpu"
memory_budget = "256MiB"
repeats = 2
tolerance = "10%"          # qualify's own: unused by probe, sweep and tune
[options]
layers = 2
[probe]
margin = 0.2
steps = 3
trial-timeout = 60         # a flag's name, with dashes or underscores
[sweep]
stages = 2
accum = [1, 4]
schedules = ["gpipe", "1f1b"]
steps = 2
"""


@pytest.fixture
def settings(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(FILE)
    return lambda command: read_settings(path, command)


def test_each_command_takes_its_own_tables_under_its_parameter_names(settings):
    top = {"workload": "mlp", "device": "cpu", "memory_budget": "256MiB", "option": ["layers=2"]}
    assert settings("probe") == {**top, "margin": 0.2, "steps": 3, "trial_timeout": 60.0}
    assert settings("sweep") == {**top, "repeats": 2, "stages": 2, "accum": "1,4", "schedules": "gpipe,1f1b",
                                 "steps": 2}
    tune = settings("tune")
    assert tune["probe_steps"] == 3 and tune["steps"] == 2  # the probe's steps are tune's --probe-steps


def test_a_setting_both_tables_give_differently_is_refused_for_tune(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[probe]\nprecision = "bf16"\n[sweep]\nprecision = "fp32"\n')
    with pytest.raises(ConfigError, match=r"\[probe\] and \[sweep\] set precision differently"):
        read_settings(path, "tune")
    assert read_settings(path, "probe") == {"precision": "bf16"}  # one table alone is fine


@pytest.mark.parametrize("body, message", [
    ('[probe]\nmargin = "x"\n', "margin is \"x\", expected a finite number"),
    ("[probe]\nmargn = 0.1\n", "unknown key(s) margn"),
    ("[probe]\nmargin = 0.9\n", "margin=0.9 is out of range"),
    ("[sweep]\naccum = 2\n", "accum is 2"),
])
def test_a_bad_value_names_the_file_and_the_key(tmp_path, body, message):
    path = tmp_path / "run.toml"
    path.write_text(body)
    with pytest.raises(ConfigError) as caught:
        read_settings(path, "tune")
    assert str(path) in str(caught.value) and message in str(caught.value)


def test_settings_are_named_by_field_or_by_flag():
    fields = {f for f in ProbeConfig.__dataclass_fields__}
    assert field_for("trial_timeout", fields) == field_for("trial-timeout", fields) == "trial_timeout_s"
    assert field_for("steps", SweepConfig.__dataclass_fields__) == "measured_steps"
    assert field_for("steps", fields) == "steps"
    assert field_for("nonsense", fields) == "nonsense"
    assert param_for("grad_accum_steps") == "accum" and param_for("margin") == "margin"


def test_a_spec_sets_replicas_recompute_and_balance_one_value_or_a_list(tmp_path):
    from pathlib import Path

    from mbtune.qualifying.specfile import read_spec

    path = Path(tmp_path / "qualify.toml")
    path.write_text('workload = "mlp"\ndevice = "cpu"\n[sweep]\nstages = 2\ndata_parallel = 2\nrecompute = "full"\n'
                    'balance = "time"\nmicro_batch_size = [2, 4]\n')
    sweep = read_spec(path).spec.sweep
    assert sweep is not None
    assert (sweep.data_parallel_size, sweep.recompute, sweep.balance, sweep.micro_batch_size) == ((2,), ("full",), "time",
                                                                                            (2, 4))
