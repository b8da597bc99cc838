"""N GPUs split every way: `mbtune plan --gpus N --global-batch G`. Pure: no torch.

Every pipeline depth p and replica count d with p x d = N, every micro-batch size b, count m and
accumulation a with b x m x a x d = G, every schedule (the looped ones at each of the virtual-stage counts
given), and each recompute mode: thousands of configurations at N=512. Each is first estimated in closed
form: its ranks' compute per micro-batch from the calibrated per-block costs (the stages split as the runner
splits them), stretched by the schedule's theoretical bubble, plus the data-parallel all-reduce and the
update; its memory from the same per-stage model with the micro-batches in flight a schedule of its kind
holds at least. The best estimated (and the best of every depth, for the chart) are then simulated for real
(planner.predict: the schedule's own action order, the measured costs and scatter, memory from the exact
micro-batches in flight) and ranked by predicted throughput, fitting ones first; each runner-up says which
part of its step time lost to the winner's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.theory import LOOP, SINGLE, check_point, schedule_info, stage_to_rank, theoretical_bubble
from mbtune.planning.hardware import Link, allreduce_s
from mbtune.planning.memory import point_split
from mbtune.planning.orders import RankOrders
from mbtune.planning.planner import point_actions, predict, stage_memory_bytes
from mbtune.planning.records import CostModel, Prediction, SkippedPoint

FINALISTS = 8  # configurations simulated for real, besides the best of every depth
# A configuration past this many actions a step is estimated, not simulated: torch's own orders for it alone
# would take longer than the whole plan should (about 0.4 s every 50k actions).
MAX_FINALIST_ACTIONS = 200_000


@dataclass(frozen=True, kw_only=True)
class ClusterGrid:
    """What `plan --gpus N --global-batch G` enumerates."""

    num_gpus: int
    global_batch: int
    schedules: tuple[str, ...]
    recompute: tuple[str, ...] = ("none", "full")
    stages_per_rank: tuple[int, ...] = (2, 4)  # stages per rank tried for the looped schedules
    finalists: int = FINALISTS


@dataclass(frozen=True, kw_only=True)
class Estimate:
    point: SweepPoint
    step_s: float
    memory_bytes: float  # the busiest rank's, at the fewest micro-batches in flight its schedule holds

    @property
    def samples_per_s(self) -> float:
        return self.point.global_batch / self.step_s if self.step_s > 0 else 0.0


def divisors(n: int) -> list[int]:
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def _splits(grid: ClusterGrid, num_blocks: int) -> Iterator[tuple[SweepPoint, bool]]:
    """Every split of the GPUs and the batch, per schedule and stages per rank (recompute "none"), and
    whether it can run with the model's blocks."""
    for p in divisors(grid.num_gpus):
        d = grid.num_gpus // p
        if grid.global_batch % d:
            continue
        for b, m, a in _factorizations(grid.global_batch // d):
            for schedule in grid.schedules:
                for v in _stages_per_rank(schedule, grid.stages_per_rank):
                    runs = p * v <= num_blocks and not check_point(schedule, p * v, p, m)
                    yield SweepPoint(schedule=schedule, num_ranks=p, num_micro_batches=m, grad_accum_steps=a,
                                     micro_batch_size=b, stages_per_rank=v, data_parallel_size=d), runs


def count_points(grid: ClusterGrid, num_blocks: int, limit: int) -> int:
    """How many configurations cluster_points gives; past `limit`, limit + 1 (it stops counting there)."""
    count = 0
    for _, runs in _splits(grid, num_blocks):
        count += len(grid.recompute) if runs else 0
        if count > limit:
            return limit + 1
    return count


def cluster_points(grid: ClusterGrid, num_blocks: int) -> tuple[list[SweepPoint], int]:
    """Every configuration that can run with the model's blocks, and how many were left out (the model has
    too few blocks for the depth, or the schedule cannot run the split)."""
    points: list[SweepPoint] = []
    left_out = 0
    for point, runs in _splits(grid, num_blocks):
        if runs:
            points.extend(replace(point, recompute=r) for r in grid.recompute)
        else:
            left_out += len(grid.recompute)
    return points, left_out


def _factorizations(n: int) -> Iterator[tuple[int, int, int]]:
    """Every (micro-batch size, micro-batches, accumulation steps) that multiply to n."""
    for b in divisors(n):
        for m in divisors(n // b):
            yield b, m, n // b // m


def _stages_per_rank(schedule: str, virtual: Sequence[int]) -> tuple[int, ...]:
    layout = schedule_info(schedule).layout
    return tuple(virtual) if layout == LOOP else (1,) if layout == SINGLE else (2,)


class CostTable:
    """The model's per-block costs and parameters as prefix sums, so a stage of any blocks costs two
    lookups per part (fixed and per-sample seconds of forward, backward and its two halves)."""

    PARTS = ("forward", "backward", "backward_input", "backward_weight")

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.sums: dict[str, tuple[list[float], list[float]]] = {}
        for part in self.PARTS:
            costs = [getattr(block, part) for block in model.blocks]
            self.sums[part] = (_prefix([c.fixed_s for c in costs]), _prefix([c.per_sample_s for c in costs]))
        self.parameters = _prefix([float(p) for p in model.facts.parameters])

    def seconds(self, part: str, first: int, end: int, size: int) -> float:
        fixed, per_sample = self.sums[part]
        return fixed[end] - fixed[first] + size * (per_sample[end] - per_sample[first])

    def stage_parameters(self, first: int, end: int) -> int:
        return round(self.parameters[end] - self.parameters[first])


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for value in values:
        out.append(out[-1] + value)
    return out


def estimate(table: CostTable, point: SweepPoint, link: Link | None) -> Estimate:
    """A configuration's step time and memory in closed form (see the module docstring)."""
    model = table.model
    split = point_split(point, model.facts)
    owners = stage_to_rank(point.schedule, point.num_ranks, len(split))
    size, again = point.micro_batch_size, point.recompute == "full"
    backward_parts = ("backward_input", "backward_weight") if schedule_info(point.schedule).splits_backward else ("backward",)
    busy = [0.0] * point.num_ranks
    params = [0] * point.num_ranks
    for stage, blocks in enumerate(split):
        first, end = blocks[0], blocks[-1] + 1
        forward = table.seconds("forward", first, end, size)
        backward = sum(table.seconds(part, first, end, size) + (forward if again else 0.0) for part in backward_parts)
        loss = model.loss.at(size) if stage == len(split) - 1 else 0.0
        busy[owners[stage]] += forward + backward + loss
        params[owners[stage]] += table.stage_parameters(first, end)
    bubble = theoretical_bubble(point.schedule, num_ranks=point.num_ranks, num_micro_batches=point.num_micro_batches,
                                stages_per_rank=point.stages_per_rank)
    pipeline = point.num_micro_batches * max(busy) / max(1e-9, 1 - bubble)
    update = model.update_fixed_s + model.update_per_parameter_s * max(params)
    reduce = allreduce_s(max(params), point.data_parallel_size, link, model, num_ranks=point.num_ranks)
    step = point.grad_accum_steps * pipeline + reduce + update
    held = [_held_at_least(point, stage, owners[stage]) for stage in range(len(split))]
    memory = [model.base_bytes] * point.num_ranks
    for stage, stage_bytes in enumerate(stage_memory_bytes(model, split, held, point.micro_batch_size, point.recompute)):
        memory[owners[stage]] += stage_bytes
    return Estimate(point=point, step_s=step, memory_bytes=max(memory))


def _held_at_least(point: SweepPoint, stage: int, rank: int) -> int:
    """The micro-batches a stage holds at once, at least: all of them (fill-drain, breadth first), or as
    many as the ranks after it (the 1F1B family), never more than there are."""
    if point.schedule in ("gpipe", "looped-bfs"):
        return point.num_micro_batches
    return min(point.num_micro_batches, point.num_ranks - rank)


def plan_cluster(model: CostModel, grid: ClusterGrid, *, link: Link | None, memory_limit_bytes: float | None,
                 tokens_per_sample: int | None, orders_of: Callable[[SweepPoint], RankOrders],
                 ) -> tuple[list[Prediction], list[SkippedPoint], int, int]:
    """The simulated finalists ranked (fitting first, by throughput), the runners-up with why they lost;
    the configurations enumerated, and those simulated."""
    points, _ = cluster_points(grid, model.facts.num_blocks)
    table = CostTable(model)
    estimates = [estimate(table, point, link) for point in points]
    fits = [memory_limit_bytes is None or e.memory_bytes <= memory_limit_bytes for e in estimates]
    small = [i for i in range(len(estimates)) if point_actions(estimates[i].point) <= MAX_FINALIST_ACTIONS]
    order = sorted(small, key=lambda i: (not fits[i], -estimates[i].samples_per_s))
    chosen = order[:grid.finalists]
    best_of_depth: dict[int, int] = {}
    for i in order:
        best_of_depth.setdefault(estimates[i].point.num_ranks, i)
    chosen += [i for i in best_of_depth.values() if i not in chosen]
    predictions, skipped = [], []
    for i in chosen:
        try:
            predictions.append(predict(model, estimates[i].point, link=link, memory_limit_bytes=memory_limit_bytes,
                                       tokens_per_sample=tokens_per_sample, orders_of=orders_of))
        except ValueError as exc:
            skipped.append(SkippedPoint(point=estimates[i].point, reason=str(exc)))
    ranked = sorted(predictions, key=lambda p: ({True: 0, None: 1, False: 2}[p.fits], -p.samples_per_s))
    return with_reasons(ranked), skipped, len(points), len(chosen)


def with_reasons(ranked: Sequence[Prediction]) -> list[Prediction]:
    """Each prediction after the first with the part of its step time that lost most to the first's."""
    if not ranked:
        return []
    best = ranked[0]
    return [best, *(replace(p, lost_because=why_slower(p, best)) for p in ranked[1:])]


def why_slower(p: Prediction, best: Prediction) -> str:
    """The part of p's step time (per sample of the global batch) furthest above the winner's: compute,
    bubble, all-reduce or update; or memory where it does not fit."""
    if p.fits is False and best.fits is not False:
        return f"does not fit: rank {p.binding_rank} needs {_gib(p.max_memory_bytes)} GiB"

    def parts(x: Prediction) -> dict[str, float]:
        idle = x.pipeline_s * x.bubble
        per = x.point.global_batch
        return {"compute": (x.pipeline_s - idle) / per, "bubble": idle / per, "all-reduce": x.allreduce_s / per,
                "update": x.update_s / per}

    mine, theirs = parts(p), parts(best)
    worst = max(mine, key=lambda k: mine[k] - theirs[k])
    gap = (mine[worst] - theirs[worst]) * p.point.global_batch
    if gap <= 1e-9 * best.step_time_s:  # what is left is rounding
        return "ties"
    detail = {"bubble": f"{p.bubble:.0%} idle vs {best.bubble:.0%}",
              "all-reduce": f"{p.allreduce_s / p.step_time_s:.0%} of its step vs {best.allreduce_s / best.step_time_s:.0%}",
              "compute": f"micro-batch {p.point.micro_batch_size} vs {best.point.micro_batch_size}"
                         + (", recompute" if p.point.recompute != best.point.recompute else ""),
              "update": f"{p.point.num_ranks} ranks vs {best.point.num_ranks}"}[worst]
    amount = f"{gap * 1e3:.3g} ms" if gap < 1 else f"{gap:.3g} s"
    return f"{worst} +{amount} a step ({detail})"


def _gib(value: float) -> str:
    return f"{value / 2**30:.3g}"
