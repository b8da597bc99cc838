"""`mbtune serve` on CPU for real: the inference probe, the service-time curve, a server process behind the
dynamic batcher driven by a load-generator process, saved, resumed, and held to a qualify threshold.

The budget is generous (a second, for a model whose batch takes a millisecond), so what is asserted holds
by construction or by three orders of magnitude, never by a timing comparison."""

from __future__ import annotations

import dataclasses
import json
import signal

import pytest

from mbtune.cli import main
from mbtune.errors import Interrupted
from mbtune.journal import REPLAYED
from mbtune.saving.profiles import load_profile
from mbtune.saving.session import run_serve
from mbtune.serving.config import ServeConfig
from mbtune.serving.traffic import CLOSED, POISSON

pytestmark = pytest.mark.integration

OPTIONS = (("layers", 1), ("width", 32))
BUDGET_S = 1.0


def config(**overrides) -> ServeConfig:
    settings = dict(p99_budget_s=BUDGET_S, workload="mlp", workload_options=OPTIONS, device="cpu",
                    memory_budget_bytes=256 * 2**20, max_batch=64, rates=(100.0, 200.0), max_batch_sizes=(8,),
                    queue_delays_s=(0.002,), window_s=0.5, max_windows=4, min_requests=0, concurrency=(2,))
    return ServeConfig(**{**settings, **overrides})


class Progress:
    """Records what a run reports; raises Interrupted (as Ctrl-C does) when it starts `stop_at`."""

    def __init__(self, stop_at: str | None = None) -> None:
        self.stop_at, self.ended = stop_at, []

    def set_total(self, total):
        pass

    def start_trial(self, description):
        self.current = description
        if description == self.stop_at:
            raise Interrupted("interrupted by SIGINT", exit_code=130)

    def end_trial(self, status, detail=""):
        self.ended.append((self.current, status, detail))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-profiles")
    return run_serve(config(), profiles_dir=folder), folder


def test_a_real_run_finds_a_configuration_whose_measured_p99_meets_the_budget(served):
    report = served[0].serve
    winner = report.winner
    assert winner is not None and winner.max_rate_per_s == 200.0
    assert winner.p99_at_max_s is not None and winner.p99_at_max_s <= BUDGET_S
    assert report.ceiling.mode == "infer" and report.ceiling.stopped_at_max_batch  # 64 samples fit easily
    assert [t.batch_size for t in report.curve.times] == [1, 2, 4, 8, 16, 32, report.ceiling.safe_batch]


def test_every_request_is_accounted_for_and_batches_keep_to_the_rules(served):
    report = served[0].serve
    [run] = report.runs
    # The first look, then the second at the loads that decide the choice: the best's highest rate and the
    # rung below it, in a fresh server, with no closed loop.
    assert [(load.kind, load.rate_per_s or load.concurrency) for load in run.loads] == [
        (POISSON, 100.0), (POISSON, 200.0), (CLOSED, 2), (POISSON, 100.0), (POISSON, 200.0)]
    for load in run.loads:
        assert load.sent == load.completed + load.rejected + load.timed_out and load.completed > 0
        assert 1.0 <= load.mean_batch_size <= 8.0
        assert None not in (load.p50_s, load.p90_s, load.p99_s) and load.p50_s <= load.p90_s <= load.p99_s
        assert 0.0 <= load.queue_share <= 1.0
    closed = run.loads[2]
    assert closed.mean_batch_size <= 2.0  # never more than two requests in flight
    assert report.simulator is not None and report.simulator.points == 4


def test_the_server_and_the_load_generator_run_on_cores_of_their_own(served):
    import os

    [run] = served[0].serve.runs
    server, generator = run.cores
    allowed = set(os.sched_getaffinity(0))
    if len(allowed) < 2:
        assert set(server) == set(generator) == allowed  # one core: nothing to split, nothing pinned
    else:
        assert server and generator and not set(server) & set(generator) and set(server) | set(generator) <= allowed
        assert len(server) == len(allowed) - 1  # the model's threads: every core but the generator's


def test_without_pinning_both_run_on_every_core_and_without_recheck_each_load_runs_once(tmp_path):
    import os

    report = run_serve(config(pin_cpus=False, recheck=False, concurrency=()), profiles_dir=tmp_path).serve
    [run] = report.runs
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    assert run.cores == (allowed, allowed)
    assert [load.rate_per_s for load in run.loads] == [100.0, 200.0]


def test_a_poisson_load_short_of_min_requests_runs_past_max_windows_to_hold_them():
    from mbtune.serving.infer import NO_MODEL, ModelSpec
    from mbtune.serving.records import BatchConfig
    from mbtune.serving.server import LoadPlan, ServerSpec, run_config

    rules = BatchConfig(max_batch_size=8)
    plan = LoadPlan(rules=rules, loads=((POISSON, 100.0),), budget_s=BUDGET_S, window_s=0.5, max_windows=3,
                    min_requests=500)  # windows of 1 s (100 arrivals each): 5 of them hold about 500
    run = run_config(ServerSpec(model=ModelSpec(workload=NO_MODEL), rules=rules), plan, timeout_s=120)
    [load] = run.loads
    # Four windows hold 500 arrivals of a Poisson(400) count only five deviations out; without min_requests
    # the load would end at its third.
    assert not run.error and load.windows == 5 and load.completed >= 300


def test_the_profile_holds_the_run_and_show_prints_it(served, capsys, monkeypatch, tmp_path):
    outcome, folder = served
    assert outcome.saved_to is not None and not list(folder.rglob("*.journal.jsonl"))
    assert load_profile(outcome.saved_to).serve == outcome.serve
    assert run_cli(["show", str(outcome.saved_to)], monkeypatch, tmp_path) == 0
    shown = capsys.readouterr().out
    assert "TorchServe: batchSize=8" in shown and "--export DIR writes" in shown


def test_an_interrupted_run_keeps_what_finished_and_resumes_without_measuring_it_again(tmp_path):
    two_delays = config(queue_delays_s=(0.0, 0.002), concurrency=(), rates=(100.0,))
    first = run_serve(two_delays, Progress(stop_at="max 8, delay 2 ms"), profiles_dir=tmp_path)
    assert first.interrupted and len(first.serve.runs) == 1
    assert list(tmp_path.rglob("*.journal.jsonl"))
    again = Progress()
    resumed = run_serve(two_delays, again, profiles_dir=tmp_path, resume=True)
    assert not resumed.interrupted and len(resumed.serve.runs) == 2
    def measured(run):  # the predictions are made afresh from every load there is, so they may differ
        return [dataclasses.replace(load, predicted_p99_s=None) for load in run.loads]

    kept = len(first.serve.runs[0].loads)  # the resumed run adds its second look after them
    assert measured(resumed.serve.runs[0])[:kept] == measured(first.serve.runs[0])
    details = dict((name, detail) for name, _, detail in again.ended)
    assert details["max 8, delay 0 ms"] == REPLAYED and details["max 8, delay 2 ms"] != REPLAYED
    assert all(detail == REPLAYED for name, _, detail in again.ended if name.startswith("batch "))


def run_cli(args, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with pytest.raises(SystemExit) as ended:
            main(args)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return ended.value.code


def test_a_budget_below_one_batch_of_one_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    code = run_cli(["serve", "-w", "mlp", "-d", "cpu", "--p99", "1us", "--no-save"], monkeypatch, tmp_path)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "below the latency of one batch of 1" in lines[0], err
    assert "Traceback" not in err


def test_qualify_holds_the_serving_answer_to_min_rate_at_p99(monkeypatch, tmp_path, capsys):
    spec = tmp_path / "qualify.toml"
    spec.write_text('workload = "mlp"\ndevice = "cpu"\nmemory_budget = "256MiB"\n[options]\nlayers = 1\nwidth = 32\n'
                    '[serve]\np99 = "1s"\nrates = [100.0]\nmax_batch_sizes = [8]\nqueue_delays = ["2ms"]\n'
                    'window = "0.5s"\nmax_windows = 4\nmin_requests = 0\nmax_batch = 64\n'
                    '[thresholds]\nmin_rate_at_p99 = 1000000.0\n')
    code = run_cli(["qualify", "--spec", str(spec), "--format", "json", "--profiles-dir", str(tmp_path / "runs")],
                   monkeypatch, tmp_path)
    verdict = json.loads(capsys.readouterr().out)
    [check] = [c for c in verdict["checks"] if "p99 budget" in c["name"]]
    assert code == 1 and verdict["status"] == "FAIL" and check["status"] == "FAIL"
    saved = load_profile(next((tmp_path / "runs").rglob("mlp.json")))
    assert check["measured"] == saved.serve.winner.max_rate_per_s == 100.0
    assert saved.probe is None  # a serving spec alone runs no training probe
