"""A trunk of alike members traced by its first three, the third copied for the rest (workloads/identical_members.py):
taken where the members compute alike, and the blocks then compute the model's loss and gradients exactly;
the whole model traced where a member differs, reads an earlier member than the one before it, or the
model does not run shortened."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mbtune.workloads import Workload
from mbtune.workloads.identical_members import signature
from tests.unit.test_from_module import VOCAB, Layer, TinyGPT, tokens


class Indexed(TinyGPT):
    """Runs its layers by index up to a count of its own: shortened, it fails."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for i in range(8):
            x = self.h[i](x)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class Scaled(Layer):
    def __init__(self, scale: float, index: int) -> None:
        super().__init__()
        self.scale, self.layer_idx = scale, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.mlp(self.norm(x))


class FromFirst(TinyGPT):
    """Every layer after the first also adds the first layer's output: not what the one before gave."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        first = x = self.h[0](x)
        for layer in self.h[1:]:
            x = layer(x) + first
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class Numbered(TinyGPT):
    """Hands each layer its position, which it computes with: a constant in each layer's graph."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for i, layer in enumerate(self.h):
            x = layer(x) * (1.0 + i / 10)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def _scaled(scales: list[float]) -> TinyGPT:
    model = TinyGPT(layers=len(scales))
    model.h = nn.ModuleList(Scaled(s, i) for i, s in enumerate(scales))
    return model


def _exact(build, copied: int) -> None:
    workload = Workload.from_module(build, make_batch=tokens, name="model")
    assert workload.traced.num_copied == copied
    torch.manual_seed(0)
    model = build()
    inputs, targets = tokens(5, torch.Generator().manual_seed(1))
    chain = workload.build(seed=0)
    assert [block.label for block in chain][1:-1] == [f"h.{i}" for i in range(len(model.h))]
    loss = workload.loss(chain(inputs), targets)
    _, expected = model(inputs, targets)
    assert loss.item() == expected.item()
    loss.backward()
    expected.backward()
    for i in (3, len(model.h) - 1):  # copies, each with its own layer's weights
        assert torch.equal(chain[1 + i].piece.get_parameter("h.2.mlp.weight" if copied else f"h.{i}.mlp.weight").grad,
                           model.h[i].mlp.weight.grad)


def test_alike_layers_are_traced_by_the_first_three_and_compute_the_models_loss_and_gradients():
    _exact(lambda: TinyGPT(layers=8), copied=5)
    _exact(lambda: _scaled([0.5] * 8), copied=5)  # each layer's own index is not a difference


def test_a_layer_with_other_settings_means_the_whole_model_is_traced():
    _exact(lambda: _scaled([0.5] * 5 + [2.0] + [0.5] * 2), copied=0)
    assert signature(Scaled(0.5, 0)) == signature(Scaled(0.5, 7)) != signature(Scaled(2.0, 0))
    hooked = Scaled(0.5, 1)
    hooked.register_forward_hook(lambda *_: None)
    assert signature(hooked) is None


def test_a_layer_reading_an_earlier_layer_than_the_one_before_means_the_whole_model_is_traced():
    _exact(lambda: FromFirst(layers=8), copied=0)


def test_a_layer_computing_with_its_position_means_the_whole_model_is_traced():
    _exact(lambda: Numbered(layers=8), copied=0)


def test_a_model_that_does_not_run_shortened_is_traced_whole():
    _exact(lambda: Indexed(layers=8), copied=0)
