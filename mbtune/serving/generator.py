"""What the load generator can send on this machine: measured before the default rates are chosen, so a
rate it cannot send is never offered (a rate beyond it would measure the generator, not the model)."""

from __future__ import annotations

import math

from mbtune.serving import traffic as gen
from mbtune.serving.infer import NO_MODEL, ModelSpec
from mbtune.serving.records import BatchConfig
from mbtune.serving.server import LoadPlan, ServerSpec, run_config

GENERATOR_CONCURRENCY = 256  # requests in flight while the generator's capacity is measured


def generator_capacity(*, timeout_s: float = 60.0,
                       cores: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> float | None:
    """Requests per second the load generator and the server's pipes carry here with a model that answers
    at once (batches of up to 32, GENERATOR_CONCURRENCY in flight, closed loop), the server and the
    generator on the cores they will run on (`cores`: serving/config.py serve_cores): no rate above it can
    be offered on this machine. None where it could not be measured."""
    rules = BatchConfig(max_batch_size=32)
    plan = LoadPlan(rules=rules, loads=((gen.CLOSED, float(GENERATOR_CONCURRENCY)),), budget_s=60.0,
                    window_s=0.5, max_windows=4, stable_windows=2, stop_after_failure=False,
                    p99_target=math.inf, cores=cores[1])  # a capacity: its latencies do not matter
    run = run_config(ServerSpec(model=ModelSpec(workload=NO_MODEL, cores=cores[0]), rules=rules), plan,
                     timeout_s=timeout_s)
    throughput = run.loads[0].throughput_per_s if run.loads else None
    return throughput if throughput else None
