"""Workload.from_module: a plain nn.Module split at its trunk (found from its structure), traced once, with
the blocks computing what the model computes at any batch size, ties found and the model's own loss kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mbtune.errors import WorkloadError
from mbtune.workloads import Workload
from mbtune.workloads.trunk import find_trunk

WIDTH, VOCAB, SEQ = 16, 32, 8


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()  # sizes read in the forward, as models do: the batch must stay symbolic
        return x + self.mlp(self.norm(x)).view(b, t, c)


class TinyGPT(nn.Module):
    """The usual shape: embeddings, a ModuleList of layers, a head tied to the embedding, its own loss."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.h = nn.ModuleList(Layer() for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)  # a device the trace writes into the graph
        x = self.wte(idx) + self.wpe(pos)
        for layer in self.h:
            x = layer(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def tokens(batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def test_the_trunk_is_the_longest_run_of_one_class_and_containers_split_into_their_children():
    assert find_trunk(TinyGPT(layers=4)) == [f"h.{i}" for i in range(4)]
    stages = nn.Sequential(nn.Conv2d(3, 4, 3), *(nn.Sequential(nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)) for _ in range(3)),
                           nn.Flatten())
    assert find_trunk(stages) == [f"{s}.{c}" for s in (1, 2, 3) for c in (0, 1)]
    assert find_trunk(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def test_the_blocks_compute_the_models_loss_and_gradients_at_a_batch_size_it_was_not_traced_at():
    workload = Workload.from_module(TinyGPT, make_batch=tokens, name="tiny")
    assert workload.num_blocks == 3 + 2  # what runs before the trunk, each layer, what runs after it
    assert workload.ties == (((0, "piece.wte.weight"), (4, "piece.head.weight")),)  # found, not declared
    torch.manual_seed(0)
    model = TinyGPT()
    assert workload.num_parameters() == sum(p.numel() for p in model.parameters())
    inputs, targets = tokens(5, torch.Generator().manual_seed(1))
    chain = workload.build(seed=0)
    loss = workload.loss(chain(inputs), targets)
    _, expected = model(inputs, targets)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(chain[2].piece.get_parameter("h.1.mlp.weight").grad, model.h[1].mlp.weight.grad)


def test_a_stage_builds_only_its_blocks_and_a_user_loss_takes_the_outputs():
    workload = Workload.from_module(lambda: nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))),
                                    make_batch=lambda b, g: (torch.randn(b, 4, generator=g), torch.randn(b, 4, generator=g)),
                                    loss=F.mse_loss, name="linears")
    assert workload.num_blocks == 4  # nothing runs before or after the trunk: no block for it
    stage = workload.build([2, 3], seed=7)
    assert sum(p.numel() for p in stage.parameters()) == 2 * (16 + 4)
    whole = workload.build(seed=7)
    x = torch.randn(3, 4)
    torch.manual_seed(7)
    reference = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    torch.testing.assert_close(whole(x), reference(x))  # the weights are the model's own under the seed


def test_several_inputs_are_passed_positionally():
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x) * scale
            return x

    workload = Workload.from_module(Masked, loss=F.mse_loss, name="masked", make_batch=lambda b, g: (
        (torch.randn(b, 4, generator=g), torch.rand(b, 1, generator=g)), torch.randn(b, 4, generator=g)))
    (x, scale), _ = workload.make_batch(3, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    torch.testing.assert_close(workload.build(seed=0)(x, scale), Masked()(x, scale))


def test_a_model_the_tracer_cannot_follow_is_refused_in_one_line_pointing_to_the_blocks_contract():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x) if x.sum() > 0 else -layer(x)  # control flow on values
            return x

    with pytest.raises(WorkloadError, match="cannot trace the model") as caught:
        Workload.from_module(DataDependent, loss=F.mse_loss, make_batch=lambda b, g: (torch.randn(b, 4), torch.randn(b, 4)))
    assert "blocks" in caught.value.hint


@pytest.mark.parametrize(("build", "expect"), [
    (lambda: "not a module", "returned str, not an nn.Module"),
    (lambda: nn.Linear(2, 2), "found no trunk"),
])
def test_what_is_not_a_splittable_model_says_so(build, expect):
    with pytest.raises(WorkloadError, match=expect):
        Workload.from_module(build, loss=F.mse_loss, make_batch=lambda b, g: (torch.randn(b, 2), torch.randn(b, 2)))


def test_stages_are_balanced_by_the_parameters_that_compute_not_by_lookup_tables():
    workload = Workload.from_module(TinyGPT, make_batch=tokens, name="tiny")
    layer = sum(p.numel() for p in Layer().parameters())
    head = 2 * WIDTH + VOCAB * WIDTH  # the final norm, and the head's matmul with the tied embedding's tensor
    assert workload.compute_weights() == [0, layer, layer, layer, head]
