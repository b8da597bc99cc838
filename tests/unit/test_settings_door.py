"""The one door to every config (settings.build): one name per setting from flag to field, values coerced by
the field, errors in the caller's words, and the command line, the Python API, settings files and re-runs
all building the same config from the same settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mbtune.checking.config import CheckConfig
from mbtune.cli.app import app
from mbtune.errors import ConfigError
from mbtune.planning.config import PlanConfig
from mbtune.planning.memory_plan import MemoryPlanConfig
from mbtune.probing.config import ProbeConfig
from mbtune.probing.confirm import ConfirmConfig
from mbtune.serving.config import ServeConfig
from mbtune.settings import build, field_for, flag_for, param_for, setting_names, settings_of
from mbtune.sweeping.config import SweepConfig
from mbtune.sweeping.tune import tune_configs

# Each config and the command whose options set it.
COMMANDS = {ProbeConfig: ("probe",), SweepConfig: ("sweep",), CheckConfig: ("check",), ServeConfig: ("serve",),
            PlanConfig: ("plan",), MemoryPlanConfig: ("plan",), ConfirmConfig: ("confirm",)}
# Fields that no flag sets: what mbtune decides itself (a trial's mode, the limits a saved probe gives, the
# plan's timeline kept for pictures) or that only the Python API and settings files reach.
NOT_ON_THE_COMMAND_LINE = {
    ProbeConfig: {"mode", "command"}, SweepConfig: {"command", "safe_batch", "recompute_safe_batch", "ceiling", "ceiling_peak_memory_bytes",
                  "memory_budget_bytes"},
    ServeConfig: {"granularity", "recheck", "resolution"}, PlanConfig: {"keep_timeline"},
    MemoryPlanConfig: {"timeout_s", "workers"}, CheckConfig: set(), ConfirmConfig: {"command"}}


def _flags(command: str) -> set[str]:
    import typer.main

    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {name for param in click_command.params for name in param.opts}


@pytest.mark.parametrize("config", list(COMMANDS), ids=lambda c: c.__name__)
def test_every_setting_is_its_flag_with_underscores(config: type) -> None:
    flags = set().union(*(_flags(command) for command in COMMANDS[config]))
    fields = set(setting_names(config).values()) - NOT_ON_THE_COMMAND_LINE[config]
    missing = {field: flag_for(field) for field in fields if flag_for(field) not in flags}
    assert missing == {}
    for field in fields:
        assert field_for(param_for(field), fields) == field  # the setting's name leads back to its field


def test_the_flag_rule_drops_units_and_counts() -> None:
    assert flag_for("trial_timeout_s") == "--trial-timeout"
    assert flag_for("memory_budget_bytes") == "--memory-budget"
    assert flag_for("link_bandwidth_bytes_per_s") == "--link-bandwidth"
    assert flag_for("num_gpus") == "--gpus"
    assert flag_for("grad_accum_steps") == "--accum"  # a shorter word, declared
    assert param_for("workload_options") == "options" and param_for("max_time_per_point_s") == "max_time_per_point"


def test_values_are_coerced_by_their_field() -> None:
    config = build(SweepConfig, {"accum": "1,2,4", "micro_batches": [2, 4], "data-parallel": "1",
                                 "options": {"layers": 2}, "point_timeout": "90s", "max_time_per_point": 30,
                                 "schedules": "gpipe,1f1b"})
    assert config.grad_accum_steps == (1, 2, 4) and config.micro_batches == (2, 4)
    assert config.data_parallel_size == (1,) and config.workload_options == (("layers", 2),)
    assert config.point_timeout_s == 90.0 and config.schedules == ("gpipe", "1f1b")
    probe = build(ProbeConfig, {"memory_budget": "256MiB", "option": ["layers=2", "width=8"]})
    assert probe.memory_budget_bytes == 256 * 2**20 and probe.workload_options == (("layers", 2), ("width", 8))
    serve = build(ServeConfig, {"p99": "50ms", "queue_delays": ["0", "2ms"], "window": 1})
    assert serve.p99_budget_s == pytest.approx(0.05) and serve.queue_delays_s == (0.0, 0.002)
    plan = build(PlanConfig, {"link_bandwidth": "50GB/s", "link_latency": "5us", "validation": "none"})
    assert plan.link_bandwidth_bytes_per_s == 50e9 and plan.link_latency_s == pytest.approx(5e-6)
    assert plan.validation_method is None


def test_none_is_a_setting_not_given() -> None:
    assert build(SweepConfig, {"schedules": None, "stages": None}) == SweepConfig()


def test_an_unknown_or_doubled_setting_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown setting 'grad_accum_steps' for sweep") as info:
        build(SweepConfig, {"grad_accum_steps": (1,)}, what="sweep")  # the field's name is not the setting's
    assert "accum" in (info.value.hint or "")
    with pytest.raises(ConfigError, match="given twice"):
        build(ProbeConfig, {"trial_timeout": 5, "trial-timeout": 6})


def test_an_error_names_the_setting_as_the_caller_does() -> None:
    with pytest.raises(ConfigError, match=r"^trial_timeout=0 is out of range") as by_name:
        build(ProbeConfig, {"trial_timeout": 0})
    with pytest.raises(ConfigError, match=r"^--trial-timeout 0 is out of range") as by_flag:
        build(ProbeConfig, {"trial_timeout": 0}, spelled=flag_for)
    assert by_name.value.field == by_flag.value.field == "trial_timeout_s"
    with pytest.raises(ConfigError, match=r"--memory-budget 'lots' is not a size"):
        build(ProbeConfig, {"memory_budget": "lots"}, spelled=flag_for)


def test_a_config_rebuilt_from_its_own_settings_is_the_same() -> None:
    for config in (ProbeConfig(granularity=4, memory_budget_bytes=2**30, recompute=("none", "full")),
                   SweepConfig(grad_accum_steps=(1, 4), schedules=("1f1b",), point_timeout_s=30.0),
                   ServeConfig(p99_budget_s=0.05, queue_delays_s=(0.0, 0.01)), PlanConfig(num_ranks=4),
                   CheckConfig(num_ranks=2, num_micro_batches=4)):
        assert build(type(config), settings_of(type(config), config)) == config


def test_tune_hands_each_setting_to_the_config_that_has_it() -> None:
    probe, sweep = tune_configs({"workload": "mlp", "steps": 3, "probe_steps": 4, "memory_budget": "1GiB",
                                 "accum": "2", "seed": 7})
    assert (probe.workload, sweep.workload, probe.seed, sweep.seed) == ("mlp", "mlp", 7, 7)
    assert probe.steps == 4 and sweep.measured_steps == 3
    assert probe.memory_budget_bytes == 2**30 and sweep.grad_accum_steps == (2,)
    with pytest.raises(ConfigError, match="--probe-steps 1 is out of range"):
        tune_configs({"probe_steps": 1}, spelled=flag_for)
    with pytest.raises(ConfigError, match="unknown setting 'nope' for tune"):
        tune_configs({"nope": 1})


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The configs a command hands its run, which then stops."""
    import mbtune.saving.session as session

    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def keep(name: str):  # type: ignore[no-untyped-def]
        def run(*configs: object, **_: object) -> None:
            seen[name] = [c for c in configs if dataclasses.is_dataclass(c)]
            raise Stop

        return run

    for name in ("run_probe", "run_sweep", "run_tune"):
        monkeypatch.setattr(session, name, keep(name))
    seen["Stop"] = Stop
    return seen


def test_the_command_line_the_api_and_a_settings_file_build_the_same_config(
        captured: dict[str, object], tmp_path: Path) -> None:
    import mbtune

    flags = ["-w", "mlp", "-d", "cpu", "--memory-budget", "256MiB", "--granularity", "4", "--trial-timeout", "50",
             "-O", "layers=2", "--recompute", "none,full"]
    CliRunner().invoke(app, ["-q", "probe", *flags, "--no-save"])
    (from_flags,) = captured.pop("run_probe")  # type: ignore[misc]
    with pytest.raises(captured["Stop"]):  # type: ignore[call-overload]
        mbtune.probe(workload="mlp", device="cpu", memory_budget="256MiB", granularity=4, trial_timeout=50,
                     options={"layers": 2}, recompute=("none", "full"))
    (from_api,) = captured.pop("run_probe")  # type: ignore[misc]
    spec = tmp_path / "settings.toml"
    spec.write_text('workload = "mlp"\ndevice = "cpu"\nmemory_budget = "256MiB"\n[options]\nlayers = 2\n'
                    '[probe]\ngranularity = 4\ntrial_timeout = 50\nrecompute = ["none", "full"]\n')
    CliRunner().invoke(app, ["-q", "probe", "--config", str(spec), "--no-save"])
    (from_file,) = captured.pop("run_probe")  # type: ignore[misc]
    same = [dataclasses.replace(c, command_line="") for c in (from_flags, from_api, from_file)]  # type: ignore[type-var]
    assert same[0] == same[1] == same[2]
    assert same[0].memory_budget_bytes == 256 * 2**20 and same[0].trial_timeout_s == 50.0


def test_tune_on_the_command_line_and_in_python_builds_the_same_pair(captured: dict[str, object]) -> None:
    import mbtune

    CliRunner().invoke(app, ["-q", "tune", "-w", "mlp", "-d", "cpu", "--probe-steps", "3", "--steps", "4",
                             "--accum", "1,2", "--stages", "2", "--no-save", "--no-check"])
    from_flags = captured.pop("run_tune")
    with pytest.raises(captured["Stop"]):  # type: ignore[call-overload]
        mbtune.tune(workload="mlp", device="cpu", probe_steps=3, steps=4, accum=(1, 2), stages=2, check=False)
    from_api = captured.pop("run_tune")
    strip = [[dataclasses.replace(c, command_line="") for c in pair] for pair in (from_flags, from_api)]  # type: ignore[attr-defined]
    assert strip[0] == strip[1] and strip[0][0].steps == 3 and strip[0][1].measured_steps == 4


def test_a_former_name_still_works_and_says_its_new_one(captured: dict[str, object], tmp_path: Path) -> None:
    import mbtune

    result = CliRunner().invoke(app, ["-q", "sweep", "-w", "mlp", "-d", "cpu", "--virtual-stages", "3", "--no-save"])
    (config,) = captured.pop("run_sweep")  # type: ignore[misc]
    assert config.stages_per_rank == 3
    assert "note: --virtual-stages is now --stages-per-rank" in result.stderr
    with pytest.warns(FutureWarning, match="virtual_stages is now stages_per_rank"), \
            pytest.raises(captured["Stop"]):  # type: ignore[call-overload]
        mbtune.sweep(workload="mlp", device="cpu", virtual_stages=4)
    (config,) = captured.pop("run_sweep")  # type: ignore[misc]
    assert config.stages_per_rank == 4
    missing = CliRunner().invoke(app, ["check", "-w", "mlp", "--from", str(tmp_path / "none.json")])
    assert isinstance(missing.exception, ConfigError) and "note: --from is now --from-profile" in missing.stderr
    assert str(missing.exception).startswith("--from-profile ") and "does not exist" in str(missing.exception)


def test_a_spec_file_takes_a_former_name_and_says_so(tmp_path: Path) -> None:
    from mbtune.qualifying.specfile import read_spec

    spec = tmp_path / "qualify.toml"
    spec.write_text('workload = "mlp"\ndevice = "cpu"\n[sweep]\nstages = 2\nvirtual_stages = 3\n')
    heard: list[str] = []
    loaded = read_spec(spec, said=heard.append)
    assert loaded.spec.sweep is not None and loaded.spec.sweep.stages_per_rank == 3
    assert heard == [f"spec {spec}: virtual_stages is now stages_per_rank; the former name goes in a later release"]
    spec.write_text('workload = "mlp"\n[sweep]\nstages_per_rank = 3\nvirtual_stages = 3\n')
    with pytest.raises(ConfigError, match="sets stages_per_rank twice"):
        read_spec(spec)
