"""The target's hardware in a plan: the link between pipeline ranks and between replicas, the data-parallel
all-reduce over it, and another device's compute. Pure: no torch."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mbtune.actions import COMPUTE_KINDS
from mbtune.planning.memory import allreduce_volume_bytes
from mbtune.planning.records import BlockCost, CostModel, LinearCost


@dataclass(frozen=True, kw_only=True)
class Link:
    """The interconnect between pipeline ranks and between data-parallel replicas (None: as measured)."""

    bandwidth_bytes_per_s: float | None = None
    latency_s: float | None = None
    # Pipeline ranks per node: a hand-over between ranks on different nodes costs the inter-node transfer
    # measured under torchrun (CostModel.inter_node_transfer), or this link where bandwidth or latency is
    # given; within a node, what was measured there. None: one kind of boundary, this link or as measured.
    ranks_per_node: int | None = None

    def crosses(self, rank: int, other: int) -> bool:
        return self.ranks_per_node is not None and rank // self.ranks_per_node != other // self.ranks_per_node

    @property
    def given(self) -> bool:
        return self.bandwidth_bytes_per_s is not None or self.latency_s is not None


def on_device(model: CostModel, profiled: str, target: str, precision: str) -> tuple[CostModel, str]:
    """The model with its compute on another device: every action and the update take the profiled device's
    time x its dense peak FLOP/s over the target's (the efficiency measured on the profiled device carried
    over), and the note that says so. ValueError where either peak is unknown (the efficiency cannot carry)."""
    from mbtune.device.peak_flops import peak_flops

    here, there = peak_flops(profiled, precision), peak_flops(target, precision)
    if there is None:
        raise ValueError(f"no {precision} peak FLOP/s is known for {target!r}: name a device of the table "
                         "(H200, H100, A100, L40S, A10, V100), or profile on it")
    if here is None:
        raise ValueError(f"the profiled device ({profiled or 'unknown'}) has no known {precision} peak FLOP/s, so "
                         f"its efficiency cannot carry over to {target}: profile on a GPU of the peak-FLOPs table")
    factor = here / there

    def scaled(cost: LinearCost) -> LinearCost:
        return cost.scaled(factor)

    blocks = tuple(BlockCost(**{kind: scaled(getattr(b, kind)) for kind in COMPUTE_KINDS}) for b in model.blocks)
    moved = replace(model, blocks=blocks, loss=scaled(model.loss), update_fixed_s=model.update_fixed_s * factor,
                    update_per_parameter_s=model.update_per_parameter_s * factor, device=target)
    return moved, (f"estimate for {target}: compute and update times are {profiled}'s x {factor:.3g} (dense "
                   f"{precision} peak {here / 1e12:.0f} against {there / 1e12:.0f} TFLOP/s, the efficiency measured "
                   f"on {profiled} carried over); hand-overs and all-reduce as measured or given")


def transfer_s(model: CostModel, link: Link | None, last_block: int, micro_batch_size: int, *,
                crosses: bool = False) -> float:
    """One hand-over across a stage boundary: as measured, or over the given link (see Link)."""
    if crosses and not (link is not None and link.given) and model.inter_node_transfer is not None:
        return model.inter_node_transfer.at(micro_batch_size)
    if link is None or not link.given or (link.ranks_per_node is not None and not crosses):
        return model.transfer.at(micro_batch_size)
    latency = link.latency_s if link.latency_s is not None else model.transfer.fixed_s
    sizes = model.facts.output_bytes_per_sample
    if link.bandwidth_bytes_per_s is None or not sizes:
        return latency + model.transfer.per_sample_s * micro_batch_size
    return latency + sizes[last_block] * micro_batch_size / link.bandwidth_bytes_per_s


def allreduce_s(parameters: int, replicas: int, link: Link | None, model: CostModel, *, num_ranks: int = 1) -> float:
    """Ring all-reduce of one rank's gradients over the replicas: the given link's bandwidth and latency
    (2(d-1) hops) where it has a bandwidth, else the effective bandwidth calibrated from measured
    data-parallel points, else free (the plan says so).

    With pipeline ranks per node (`link.ranks_per_node`, k) and a link bandwidth, the replicas a node holds
    (k // num_ranks of them where the pipeline is shorter than a node) reduce among themselves first at the
    bandwidth measured here (or the link's), and only their share crosses the nodes over the link: the
    hierarchical all-reduce NCCL runs across nodes."""
    if replicas <= 1:
        return 0.0
    volume = allreduce_volume_bytes(parameters, replicas)
    per_node = link.ranks_per_node if link is not None else None
    if link is not None and link.bandwidth_bytes_per_s and per_node:
        local = max(1, min(replicas, per_node // max(1, num_ranks)))
        nodes = -(-replicas // local)
        # Within a node at least the link's bandwidth (what was measured here may be a slower machine's).
        inside = max(model.allreduce_bytes_per_s or 0.0, link.bandwidth_bytes_per_s)
        within = allreduce_volume_bytes(parameters, local) / inside if local > 1 else 0.0
        across = (allreduce_volume_bytes(parameters, nodes) / local / link.bandwidth_bytes_per_s
                  + 2 * (nodes - 1) * (link.latency_s or 0.0)) if nodes > 1 else 0.0
        flat = volume / link.bandwidth_bytes_per_s + 2 * (replicas - 1) * (link.latency_s or 0.0)
        return min(within + across, flat)
    if link is not None and link.bandwidth_bytes_per_s:
        return volume / link.bandwidth_bytes_per_s + 2 * (replicas - 1) * (link.latency_s or 0.0)
    if model.allreduce_bytes_per_s:
        return volume / model.allreduce_bytes_per_s
    return 0.0
