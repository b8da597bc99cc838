"""Serving results: the server settings printed for Triton and TorchServe, the report's tables and
machine formats, the profile's `serve` section (and the schema migration), the config's defaults and
qualify's serving threshold."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from mbtune.errors import ConfigError
from mbtune.qualifying.judge import serve_thresholds
from mbtune.qualifying.records import FAIL, INCONCLUSIVE, PASS
from mbtune.qualifying.spec import QualifySpec
from mbtune.records import DeviceInfo
from mbtune.report.serve import print_serve, serve_document
from mbtune.saving.profiles import SCHEMA_VERSION, Profile, collect_metadata, load_profile, save_results
from mbtune.serving.config import ServeConfig
from mbtune.serving.export import TORCHSERVE_KEYS, torchserve_settings
from mbtune.serving.records import (
    BatchConfig,
    ConfigAnswer,
    ConfigRun,
    LoadResult,
    ServeReport,
    ServiceCurve,
    ServiceTime,
    SimulatorCheck,
)
from tests.unit.test_records import sample_probe

WINNER = BatchConfig(max_batch_size=32, max_queue_delay_s=0.0025, preferred=(8, 16))


def test_torchserve_takes_the_max_batch_and_the_delay_in_whole_milliseconds_in_its_own_keys():
    assert torchserve_settings(WINNER) == {"batchSize": 32, "maxBatchDelay": 3}
    assert set(torchserve_settings(WINNER)) <= set(TORCHSERVE_KEYS)


def load(config, rate, p99, stable=True):
    return LoadResult(config=config, rate_per_s=rate, sent=100, completed=100, duration_s=3.0,
                      throughput_per_s=rate, p50_s=p99 / 2 if p99 else None, p90_s=p99, p99_s=p99,
                      mean_latency_s=p99 / 2 if p99 else None, mean_batch_size=4.0, queue_share=0.3, windows=3,
                      stable=stable, predicted_p99_s=p99)


def report() -> ServeReport:
    other = BatchConfig(max_batch_size=8)
    runs = (ConfigRun(config=WINNER, loads=(load(WINNER, 100.0, 0.020), load(WINNER, 200.0, 0.040),
                                            load(WINNER, 300.0, None))),
            ConfigRun(config=other, loads=(load(other, 100.0, 0.030), load(other, 200.0, 0.080))))
    answers = (ConfigAnswer(config=WINNER, max_rate_per_s=200.0, p99_at_max_s=0.040, throughput_at_max_per_s=200.0,
                            first_failing_rate_per_s=300.0, predicted_max_rate_per_s=200.0),
               ConfigAnswer(config=other, max_rate_per_s=100.0, p99_at_max_s=0.030, first_failing_rate_per_s=200.0))
    curve = ServiceCurve(times=(ServiceTime(batch_size=1, times_s=(0.002, 0.003, 0.0025)),
                                ServiceTime(batch_size=32, times_s=(0.020, 0.021, 0.022))), threads=1)
    return ServeReport(workload="mlp", device=DeviceInfo(backend="cpu", name="Test CPU"), p99_budget_s=0.05,
                       ceiling=sample_probe(), curve=curve, runs=runs, answers=answers, best=0,
                       simulator=SimulatorCheck(points=4, median_error_pct=10.0, worst_error_pct=40.0, overhead_s=0.001),
                       skipped=("max batch size 64: above the inference safe batch (40)",), threads=1)


def render(width=180, exported=None):
    console = Console(file=io.StringIO(), width=width, color_system=None)
    print_serve(console, report(), "table", saved_to="profiles/cpu-test-cpu/mlp.json", exported=exported)
    return console.file.getvalue()


def test_the_tables_show_the_curve_the_loads_the_answers_and_the_winner_as_server_settings():
    text = render()
    assert "max 32, delay 2.5 ms, preferred 8,16" in text
    assert "TorchServe: batchSize=32 maxBatchDelay=3" in text and "--export DIR writes" in text
    exported = render(exported={"triton": "out/triton/mlp/config.pbtxt"})
    assert "take these" in exported and "triton: out/triton/mlp/config.pbtxt" in exported
    assert "lost >1%" in text  # the load whose p99 fell among rejected requests
    assert "200 requests/s within the budget" in text
    assert "skipped: max batch size 64" in text and "profile saved to" in text


def test_json_holds_the_report_and_the_winner_settings_and_csv_a_row_per_load(capsys):
    document = serve_document(report())
    assert ServeReport.from_dict(document["serve"]) == report()
    assert document["winner"]["torchserve"] == {"batchSize": 32, "maxBatchDelay": 3}
    assert document["winner"]["triton_config_pbtxt"].startswith('name: "mlp"\nbackend: "pytorch"\nmax_batch_size: 32')
    frame = report().to_frame()
    assert len(frame) == 5 and list(frame["meets_budget"]) == [True, True, False, True, False]
    assert "queue_pct" in frame.columns and "queue_share" not in frame.columns


def test_the_profile_keeps_serve_beside_probe_and_sweep(tmp_path):
    device = DeviceInfo(backend="cpu", name="Test CPU")
    path = save_results(tmp_path, device, "mlp", "mbtune probe", probe=sample_probe())
    save_results(tmp_path, device, "mlp", "mbtune serve", serve=report())
    loaded = load_profile(path)
    assert loaded.probe == sample_probe() and loaded.serve == report()
    assert loaded.schema_version == SCHEMA_VERSION == 4


def test_a_version_1_profile_is_migrated_with_no_serve_section(tmp_path):
    old = Profile(schema_version=SCHEMA_VERSION, metadata=collect_metadata("mbtune probe", "2.13"),
                  probe=sample_probe()).to_dict()
    old["schema_version"] = 1
    del old["serve"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = load_profile(tmp_path / "old.json")
    assert loaded.schema_version == SCHEMA_VERSION and loaded.serve is None and loaded.probe == sample_probe()


def test_serve_config_defaults_follow_the_budget():
    config = ServeConfig(p99_budget_s=0.2, device="cpu")
    assert config.delays_s == (0.0, 0.02) and config.queue_timeout == pytest.approx(2.0)
    probe = config.probe_config()
    assert probe.mode == "infer" and probe.max_batch == 1024 and probe.margin == 0.15


@pytest.mark.parametrize("settings, field", [
    ({"p99_budget_s": 0.0}, "p99_budget_s"), ({"p99_budget_s": math.inf}, "p99_budget_s"),
    ({"p99_budget_s": 0.1, "rates": (10.0, -1.0)}, "rates"), ({"p99_budget_s": 0.1, "max_windows": 2}, "max_windows"),
    ({"p99_budget_s": 0.1, "min_requests": -1}, "min_requests"),
    ({"p99_budget_s": 0.1, "queue_delays_s": (0.0, -0.001)}, "queue_delays_s"),
    ({"p99_budget_s": 0.1, "max_batch_sizes": (0,)}, "max_batch_sizes"),
])
def test_serve_config_refuses_bad_settings_naming_the_field(settings, field):
    with pytest.raises(ConfigError) as refused:
        ServeConfig(device="cpu", **settings)
    assert refused.value.field == field


def test_a_serving_threshold_needs_a_serve_section():
    with pytest.raises(ConfigError, match=r"\[serve\]"):
        QualifySpec(probe=ServeConfig(p99_budget_s=0.1).probe_config(), thresholds=(("min_rate_at_p99", 10.0),))


def test_min_rate_at_p99_passes_fails_and_is_inconclusive_when_unstable():
    [passed] = serve_thresholds({"min_rate_at_p99": 150.0}, report(), None)
    [failed] = serve_thresholds({"min_rate_at_p99": 250.0}, report(), None)
    assert (passed.status, passed.measured, failed.status) == (PASS, 200.0, FAIL)
    shaky = report()
    shaky = ServeReport.from_dict({**shaky.to_dict(), "answers": [
        {**shaky.answers[0].to_dict(), "stable": False}, shaky.answers[1].to_dict()]})
    [unsure] = serve_thresholds({"min_rate_at_p99": 150.0}, shaky, None)
    assert unsure.status == INCONCLUSIVE and "unstable" in unsure.detail
    [none] = serve_thresholds({"min_rate_at_p99": 1.0}, ServeReport.from_dict({**report().to_dict(), "best": None}),
                              None)
    assert none.status == FAIL
    assert serve_thresholds({"min_ceiling": 1.0}, report(), None) == []


def test_a_spec_serve_section_reads_durations_and_a_serving_spec_runs_no_training_probe(tmp_path):
    from mbtune.qualifying.specfile import read_spec

    spec = tmp_path / "qualify.toml"
    spec.write_text('workload = "mlp"\ndevice = "cpu"\n[options]\nwidth = 32\n[serve]\np99 = "50ms"\n'
                    'queue_delays = ["0", "2ms"]\nmax_batch_sizes = [8]\n[thresholds]\nmin_rate_at_p99 = 100.0\n')
    loaded = read_spec(spec).spec
    assert loaded.probe is None and loaded.serve is not None
    assert (loaded.serve.p99_budget_s, loaded.serve.queue_delays_s, loaded.serve.max_batch_sizes) == (0.05, (0.0, 0.002), (8,))
    assert loaded.serve.workload_options == (("width", 32),) and loaded.thresholds == (("min_rate_at_p99", 100.0),)


def test_default_rates_stay_within_what_the_load_generator_can_send():
    from mbtune.serving.config import DEFAULT_RATE_SHARES
    from mbtune.serving.run import GENERATOR_SHARE, _default_rates

    curve = ServiceCurve(times=(ServiceTime(batch_size=32, times_s=(0.0001,)),), threads=1)  # 320,000/s
    rules = [BatchConfig(max_batch_size=32)]
    free = _default_rates(curve, rules)
    assert max(free) == pytest.approx(max(DEFAULT_RATE_SHARES) * 320_000, rel=0.05)  # the nearest E24 number
    warnings: list[str] = []
    capped = _default_rates(curve, rules, 10_000.0, warnings)
    assert max(capped) <= GENERATOR_SHARE * 10_000 * 1.05 and len(capped) == len(free)
    assert warnings and "more than the load generator can send" in warnings[0] and "--rates" in warnings[0]
    warnings.clear()
    assert _default_rates(curve, rules, 10_000_000.0, warnings) == free and not warnings


def test_default_rates_are_e24_numbers_so_runs_a_few_percent_apart_run_the_same_ladder():
    from mbtune.serving.run import E24, _default_rates, preferred_rate

    assert preferred_rate(390.0) == 390.0 and preferred_rate(318.0) == 330.0 and preferred_rate(0.0) == 1.0
    assert preferred_rate(96.0) == 100.0 and preferred_rate(9.6) == 10.0  # the next decade's first
    rules = [BatchConfig(max_batch_size=32)]

    def ladder(capacity: float) -> tuple[float, ...]:
        return _default_rates(ServiceCurve(times=(ServiceTime(batch_size=32, times_s=(32 / capacity,)),), threads=1),
                              rules)

    for rate in ladder(370.0):
        mantissa = rate / 10 ** math.floor(math.log10(rate))
        assert any(math.isclose(mantissa, m) for m in E24)
    # Capacities measured 3% apart share most rates (a share near a boundary falls on either side): over two
    # hundred capacities, 4 of the 6 on average, where rounding to two figures shared 1.3.
    shared = [len(set(ladder(c)) & set(ladder(c * 1.03))) for c in (100.0 * 1.013**k for k in range(200))]
    assert sum(shared) / len(shared) >= 4.0
