"""The event simulator on cases checkable by hand, and the per-rank orders it follows."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from mbtune.pipeline.theory import stage_to_rank, theoretical_bubble
from mbtune.planning.orders import gpipe_order, one_f_one_b_order, schedule_orders
from mbtune.planning.records import OrderedAction, Spread, StageCost
from mbtune.planning.simulate import Jitter, Overheads, peak_in_flight, simulate, uniform_costs

F, B = 1.0, 2.0  # forward and full-backward seconds per stage; the formulas below hold for any F and B


def run(schedule: str, p: int, m: int, v: int = 1, *, costs=None, overheads=None, accum: int = 1, jitter=None):
    orders = schedule_orders(schedule, num_ranks=p, num_micro_batches=m, stages_per_rank=v)
    costs = costs or uniform_costs(p * v, forward_s=F / v, backward_s=B / v)
    return simulate(orders, stage_to_rank=stage_to_rank(schedule, p, p * v), stage_costs=costs,
                    overheads=overheads, num_accum=accum, jitter=jitter)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 2), (2, 8), (4, 4), (4, 16), (8, 8), (8, 32)])
def test_uniform_costs_reproduce_the_fill_drain_bubble_exactly(schedule: str, p: int, m: int) -> None:
    sim = run(schedule, p, m)
    assert sim.pipeline_s == pytest.approx((m + p - 1) * (F + B))
    assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert sim.bubble == pytest.approx(theoretical_bubble(schedule, num_ranks=p, num_micro_batches=m))
    assert sim.busy_s == pytest.approx((m * (F + B),) * p)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 4, 16, 2),
    ("interleaved-1f1b", 4, 8, 3), ("interleaved-1f1b", 4, 2, 2),  # m < p: each loop-back refills the pipe
    ("looped-bfs", 4, 8, 2), ("looped-bfs", 2, 6, 3),
])
def test_interleaved_orders_give_their_unit_time_bubble(schedule: str, p: int, m: int, v: int) -> None:
    # v virtual stages per rank, each costing 1/v of a stage: the rank waits p-1 virtual slots.
    assert run(schedule, p, m, v).bubble == pytest.approx(
        theoretical_bubble(schedule, num_ranks=p, num_micro_batches=m, stages_per_rank=v))
    if m >= p:
        assert run(schedule, p, m, v).bubble == pytest.approx((p - 1) / (v * m + p - 1))


def split_costs(num_model_stages: int, v: int) -> tuple[StageCost, ...]:
    """Forward = backward-input = backward-weight = 1/v: the zero-bubble papers' unit-time case."""
    return uniform_costs(num_model_stages, forward_s=1 / v, backward_s=2 / v, backward_input_s=1 / v,
                         backward_weight_s=1 / v)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16)])
def test_zero_bubble_order_has_a_third_of_the_interleaved_bubble(p: int, m: int) -> None:
    sim = run("zero-bubble", p, m, 2, costs=split_costs(2 * p, 2))
    assert sim.bubble == pytest.approx((p - 1) / (3 * 2 * m + p - 1))
    assert sim.bubble == pytest.approx(theoretical_bubble("zero-bubble", num_ranks=p, num_micro_batches=m))


@pytest.mark.parametrize(("p", "m"), [(2, 3), (2, 8), (4, 7), (4, 8), (4, 16)])
def test_zbv_idles_only_while_the_first_micro_batch_travels_down_the_v(p: int, m: int) -> None:
    """With m >= 2p-1 torch's ZB-V keeps every rank busy except for the fill: the last rank cannot start
    before p-1 chunk slots have passed, and every rank ends together, so each idles p-1 slots of its
    6m (two stages x forward, input and weight backward per micro-batch), which theory.py now counts too."""
    sim = run("zbv", p, m, 2, costs=split_costs(2 * p, 2))
    slot = 0.5
    assert sim.pipeline_s == pytest.approx((6 * m + p - 1) * slot)
    assert sim.bubble == pytest.approx((p - 1) / (6 * m + p - 1))
    assert sim.bubble == pytest.approx(theoretical_bubble("zbv", num_ranks=p, num_micro_batches=m))


def test_transfer_adds_one_hand_over_per_boundary_each_way() -> None:
    p, m, t = 4, 6, 0.25
    sim = run("gpipe", p, m, overheads=Overheads(transfer_s=(t,) * (p - 1)))
    assert sim.pipeline_s == pytest.approx((m + p - 1) * (F + B) + 2 * (p - 1) * t)


def test_rank_overheads_and_accumulation_steps() -> None:
    m, gap, start = 3, 0.1, 0.5
    one = run("gpipe", 1, m, overheads=Overheads(gap_s=gap, start_s=start))
    assert one.pipeline_s == pytest.approx(start + m * (F + B) + (2 * m - 1) * gap)
    two = run("gpipe", 1, m, overheads=Overheads(gap_s=gap, start_s=start), accum=2)
    assert two.pipeline_s == pytest.approx(2 * one.pipeline_s + gap)
    send = run("gpipe", 2, 1, overheads=Overheads(send_s=0.3))
    assert send.pipeline_s == pytest.approx(2 * (F + B) + 2 * 0.3)  # one send each way holds up the other rank


def test_a_rank_posts_a_send_after_each_action_whose_result_another_rank_takes() -> None:
    # GPipe, 2 ranks, 2 micro-batches: forwards of stage 0 and backwards of stage 1 hand over (send_s after
    # them, and before the result arrives); the last forward and the first stage's backwards hand nothing
    # over (gap_s after them).
    send, gap = 0.5, 0.1
    sim = simulate(gpipe_order(2, 2), stage_to_rank=(0, 1), stage_costs=uniform_costs(2, forward_s=F, backward_s=B),
                   overheads=Overheads(send_s=send, gap_s=gap))
    starts = {(a.kind, a.stage, a.microbatch): a.start_s for a in sim.timeline}
    f1_0 = F + send
    f1_1 = max(f1_0 + F + gap, (F + send) + F + send)
    b1_0 = f1_1 + F + gap
    b1_1 = b1_0 + B + send
    b0_0 = b1_0 + B + send
    b0_1 = max(b0_0 + B + gap, b1_1 + B + send)
    assert starts == pytest.approx({
        ("forward", 0, 0): 0.0, ("forward", 0, 1): F + send, ("forward", 1, 0): f1_0, ("forward", 1, 1): f1_1,
        ("backward", 1, 0): b1_0, ("backward", 1, 1): b1_1, ("backward", 0, 0): b0_0, ("backward", 0, 1): b0_1})
    assert sim.pipeline_s == pytest.approx(b0_1 + B)


def test_a_boundary_inside_one_rank_costs_no_hand_over() -> None:
    # ZB-V on 2 ranks holds stages 0 and 3 on rank 0, 1 and 2 on rank 1: boundary 1 (stage 1 -> 2) stays on
    # rank 1, so its transfer time is never paid; the other two are.
    costs = split_costs(4, 2)
    free = run("zbv", 2, 4, 2, costs=costs)
    inner = run("zbv", 2, 4, 2, costs=costs, overheads=Overheads(transfer_s=(0.0, 9.0, 0.0)))
    outer = run("zbv", 2, 4, 2, costs=costs, overheads=Overheads(transfer_s=(9.0, 0.0, 0.0)))
    assert inner.pipeline_s == pytest.approx(free.pipeline_s)
    assert outer.pipeline_s > free.pipeline_s + 9.0


def test_loss_runs_after_the_last_forward_and_is_busy_time() -> None:
    costs = tuple(StageCost(forward_s=F, backward_s=B, backward_input_s=B / 2, backward_weight_s=B / 2,
                            loss_s=0.5 if s == 1 else 0.0) for s in range(2))
    sim = simulate(gpipe_order(2, 2), stage_to_rank=(0, 1), stage_costs=costs)
    losses = [a for a in sim.timeline if a.kind == "loss"]
    assert [(a.stage, a.microbatch) for a in losses] == [(1, 0), (1, 1)]
    forward = next(a for a in sim.timeline if a.kind == "forward" and a.stage == 1 and a.microbatch == 0)
    assert losses[0].start_s == forward.end_s
    assert sim.busy_s[1] == pytest.approx(2 * (F + B + 0.5))


def test_timeline_has_every_action_with_rank_and_times() -> None:
    sim = run("1f1b", 2, 4)
    assert len(sim.timeline) == 2 * 2 * 4
    assert all(a.end_s > a.start_s for a in sim.timeline)
    for rank in (0, 1):
        spans = sorted((a.start_s, a.end_s) for a in sim.timeline if a.rank == rank)
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))  # a rank does one thing at a time


def test_an_order_that_waits_for_itself_deadlocks_with_a_clear_error() -> None:
    bad = ((OrderedAction(stage=0, kind="backward", microbatch=0), OrderedAction(stage=0, kind="forward", microbatch=0)),
           (OrderedAction(stage=1, kind="forward", microbatch=0), OrderedAction(stage=1, kind="backward", microbatch=0)))
    with pytest.raises(ValueError, match="deadlocks: rank 0 waits forever at backward of stage 0, micro-batch 0"):
        simulate(bad, stage_to_rank=(0, 1), stage_costs=uniform_costs(2))


def test_peak_in_flight_activations() -> None:
    assert peak_in_flight(gpipe_order(4, 8), 4) == (8, 8, 8, 8)
    assert peak_in_flight(one_f_one_b_order(4, 8), 4) == (4, 3, 2, 1)
    assert run("1f1b", 4, 8).peak_in_flight == (4, 3, 2, 1)


def test_one_f_one_b_order_is_torchs_warmup_steady_cooldown() -> None:
    kinds = [(a.kind[0], a.microbatch) for a in one_f_one_b_order(3, 4)[0]]
    assert kinds == [("f", 0), ("f", 1), ("f", 2), ("b", 0), ("f", 3), ("b", 1), ("b", 2), ("b", 3)]
    last = [(a.kind[0], a.microbatch) for a in one_f_one_b_order(3, 4)[2]]
    assert last == [("f", 0), ("b", 0), ("f", 1), ("b", 1), ("f", 2), ("b", 2), ("f", 3), ("b", 3)]
    with pytest.raises(ValueError, match="at least as many micro-batches"):
        one_f_one_b_order(4, 2)


# --- torch's own orders ------------------------------------------------------------------------------------------

def torch_orders(schedule: str, p: int, m: int, v: int = 1):
    pytest.importorskip("torch.distributed.pipelining")
    from mbtune.pipeline.schedules import schedule_action_orders

    return schedule_action_orders(schedule, num_ranks=p, num_micro_batches=m, stages_per_rank=v)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 5), (4, 8)])
def test_pure_orders_match_torchs_published_orders(p: int, m: int) -> None:
    ours = [[(a.stage, a.kind, a.microbatch) for a in rank] for rank in gpipe_order(p, m)]
    assert ours == [list(rank) for rank in torch_orders("gpipe", p, m)]
    ours = [[(a.stage, a.kind, a.microbatch) for a in rank] for rank in one_f_one_b_order(p, m)]
    theirs = [list(rank) for rank in torch_orders("1f1b", p, m)]
    assert ours[:-1] == theirs[:-1]
    # torch 2.13's published 1F1B order numbers the last rank's micro-batches from 1 (its hand-written loop,
    # which is what runs and what we mirror, starts at 0): the kinds agree either way.
    assert [k for _, k, _ in ours[-1]] == [k for _, k, _ in theirs[-1]]


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 10, 2), ("looped-bfs", 2, 3, 3),
    ("zero-bubble", 4, 8, 2), ("zbv", 2, 4, 2), ("zbv", 4, 3, 2),
])
def test_torch_orders_run_every_action_once_on_the_rank_that_holds_the_stage(schedule: str, p: int, m: int,
                                                                              v: int) -> None:
    orders = torch_orders(schedule, p, m, v)
    owners = stage_to_rank(schedule, p, p * v)
    split = schedule in ("zero-bubble", "zbv")
    kinds = ("forward", "backward_input", "backward_weight") if split else ("forward", "backward")
    for rank, actions in enumerate(orders):
        mine = [s for s in range(p * v) if owners[s] == rank]
        assert sorted(actions) == sorted((s, k, i) for s in mine for k in kinds for i in range(m))
    assert schedule_orders(schedule, num_ranks=p, num_micro_batches=m, stages_per_rank=v)[0][0].stage == orders[0][0][0]


def test_torch_refuses_points_that_cannot_run() -> None:
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        torch_orders("interleaved-1f1b", 2, 5, 2)


def test_plan_modules_do_not_import_torch() -> None:
    code = ("import sys, mbtune.planning.simulate, mbtune.planning.calibrate, mbtune.planning.planner, mbtune.planning.quick, "
            "mbtune.planning.accuracy, mbtune.planning.api, mbtune.report.plan, mbtune.report.trace, mbtune.report.timeline, "
            "mbtune.report.plots; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_jitter_scales_compute_hand_overs_and_gaps_by_what_it_draws() -> None:
    overheads = Overheads(transfer_s=(0.25,), send_s=0.1, gap_s=0.05)
    plain = run("gpipe", 2, 4, overheads=overheads)
    doubled = Overheads(transfer_s=(0.5,), send_s=0.1, gap_s=0.05)
    # Every compute action x2 and every hand-over x2; gaps x1: the same as doubled costs and transfer.
    jitter = Jitter(Spread(compute=(2.0,), transfer=(2.0,), gap=(1.0,)), seed=0)
    drawn = run("gpipe", 2, 4, overheads=overheads, jitter=jitter)
    expected = run("gpipe", 2, 4, costs=uniform_costs(2, forward_s=2 * F, backward_s=2 * B), overheads=doubled)
    assert drawn.pipeline_s == pytest.approx(expected.pipeline_s)
    assert drawn.pipeline_s > plain.pipeline_s


def test_scattered_costs_make_a_longer_step_than_their_mean_and_repeat_with_the_seed() -> None:
    """A pipeline waits for the slower of the actions it joins: scatter with mean 1 lengthens the step."""
    spread = Spread(compute=(0.5, 1.0, 1.5), transfer=(), gap=())
    steady = run("1f1b", 4, 8).pipeline_s
    scattered = [run("1f1b", 4, 8, jitter=Jitter(spread, seed)).pipeline_s for seed in range(200)]
    assert sum(scattered) / len(scattered) > 1.05 * steady
    assert run("1f1b", 4, 8, jitter=Jitter(spread, 7)).pipeline_s == scattered[7]
    assert len(set(scattered)) > 10
