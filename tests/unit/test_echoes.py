"""Later micro-batches echoed from earlier ones: a traced rank step predicts the peak it predicts with every
micro-batch computed, and falls back to computing them where an echo cannot reproduce what it stands for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mbtune.actions import BACKWARD, FORWARD
from mbtune.device.tensor_bytes import TensorBytes, fake_tensors
from mbtune.pipeline.echoes import Echoing, real_microbatches
from mbtune.pipeline.point import SweepPoint
from mbtune.pipeline.point_spec import PipelineSpec
from mbtune.pipeline.rank_memory import RankPeaks
from mbtune.workloads import load_workload

GPT = (("layers", 4), ("d_model", 32), ("heads", 2), ("seq_len", 16), ("vocab", 64))


def test_the_real_micro_batches_head_the_forward_and_the_backward_order():
    ascending = [(0, FORWARD, k) for k in range(6)] + [(0, BACKWARD, k) for k in range(6)]
    assert real_microbatches(ascending) == {0: frozenset({0, 1})}
    descending = [(0, FORWARD, k) for k in range(6)] + [(0, BACKWARD, k) for k in reversed(range(6))]
    assert real_microbatches(descending) == {0: frozenset({0, 1, 4, 5})}
    two_stages = [(s, FORWARD, k) for s in (1, 3) for k in range(4)] + [(s, BACKWARD, k) for s in (3, 1)
                                                                         for k in range(4)]
    assert real_microbatches(two_stages) == {1: frozenset({0, 1}), 3: frozenset({0, 1})}


def _spec(schedule: str, m: int, *, recompute: str = "none", dp: int = 1, precision: str = "fp32",
          accum: int = 1) -> PipelineSpec:
    from mbtune.pipeline.theory import stages_per_rank_of

    point = SweepPoint(schedule=schedule, num_ranks=2, num_micro_batches=m, grad_accum_steps=accum,
                       micro_batch_size=2, stages_per_rank=stages_per_rank_of(schedule, None), data_parallel_size=dp,
                       recompute=recompute)
    return PipelineSpec.for_point(point, workload="gpt", workload_options=GPT, device="cpu", precision=precision,
                                  optimizer="adamw", measured_steps=1)


@pytest.fixture(scope="module")
def gpt():
    return load_workload("gpt", GPT)


@pytest.mark.parametrize(("spec", "echoed"), [
    (_spec("gpipe", 6), True), (_spec("1f1b", 6), True), (_spec("interleaved-1f1b", 6), True),
    (_spec("looped-bfs", 6), True),  # its backwards run last micro-batch first
    (_spec("1f1b", 8, recompute="full", dp=2, precision="bf16", accum=2), True),
    (_spec("zbv", 4), False),  # a split backward is never echoed
], ids=["gpipe", "1f1b", "interleaved", "looped-bfs", "recompute-dp-bf16-accum", "zbv"])
def test_an_echoed_step_predicts_the_peak_of_every_micro_batch_computed(gpt, spec, echoed):
    echoes, computed = RankPeaks(gpt, echoes=True), RankPeaks(gpt, echoes=False)
    for rank in range(spec.num_ranks):
        fast = echoes.rank(echoes.prepare(spec), rank, timeline=True)
        whole = computed.rank(computed.prepare(spec), rank, timeline=True)
        assert fast.peak_bytes == whole.peak_bytes
        assert (fast.num_echoed > 0) == echoed and whole.num_echoed == 0
        assert fast.timeline is not None and whole.timeline is not None
        assert fast.timeline[-1] == whole.timeline[-1]  # and it ends where the step ends
        if echoed:
            assert len(fast.timeline) < len(whole.timeline)


class _Block(nn.Module):
    def __init__(self, *, views: bool = False, sliced: bool = False) -> None:
        super().__init__()
        self.one, self.two, self.views, self.sliced = nn.Linear(16, 64), nn.Linear(64, 16), views, sliced

    def forward(self, x: torch.Tensor):
        with torch.no_grad():  # working memory of the forward alone, let go before it returns
            torch.ones(64, 1024).sum()
        y = self.two(torch.relu(self.one(x)))
        if self.sliced:
            return torch.cat([y, y])[: len(y)]  # the first half of a tensor twice its size
        return (y, y[:1]) if self.views else y


def _micro_batches(*, views: bool = False, sliced: bool = False, echo: bool, num: int = 5) -> tuple[int, int, Echoing | None]:
    """`num` micro-batches through a fake block (all forwards, then the backwards in order): the counted
    peak, the live bytes after the last backward, and the echoing module."""
    with fake_tensors():
        count = TensorBytes(device_type=None)
        module = _Block(views=views, sliced=sliced)
        with count:
            run: nn.Module = Echoing(module, count, frozenset({0, 1})) if echo else module
            inputs = [torch.randn(8, 16, requires_grad=True) for _ in range(num)]
            losses = []
            for index, x in enumerate(inputs):
                if isinstance(run, Echoing):
                    run.chunk = index
                out = run(x)
                losses.append((out[0] if isinstance(out, tuple) else out).sum())
            for loss in losses:
                loss.backward()
            del losses, inputs, out
            live = count.live_bytes
    return count.peak_bytes, live, run if isinstance(run, Echoing) else None


def test_a_module_echoed_rises_keeps_and_lets_go_as_it_did():
    *whole, _ = _micro_batches(echo=False)
    *fast, echoing = _micro_batches(echo=True)
    assert echoing is not None and echoing.num_echoed == 3 and not echoing.failed
    assert fast == whole


@pytest.mark.parametrize(("shape", "why"), [({"views": True}, "share storage"),
                                             ({"sliced": True}, "a view into a larger tensor")])
def test_outputs_an_echo_cannot_make_are_not_echoed_and_say_why(shape, why):
    *_, echoing = _micro_batches(**shape, echo=True)
    assert echoing is not None and echoing.num_echoed == 0
    assert why in echoing.failed


def test_a_step_whose_echo_breaks_is_computed_whole(gpt, monkeypatch):
    from mbtune.pipeline import echoes

    def broken(*args, **kwargs):
        raise RuntimeError("an echo that cannot run")

    spec = _spec("1f1b", 6)
    expected = RankPeaks(gpt, echoes=False).rank(RankPeaks(gpt, echoes=False).prepare(spec), 0)
    monkeypatch.setattr(echoes._Echo, "forward", staticmethod(broken))
    predict = RankPeaks(gpt)
    trace = predict.rank(predict.prepare(spec), 0)
    assert (trace.peak_bytes, trace.num_echoed) == (expected.peak_bytes, 0)
