"""A fast stack of residual MLP blocks for quick runs and tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mbtune.workloads import Workload


class MlpBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def mlp(layers: int = 4, width: int = 256, classes: int = 10) -> Workload:
    """The built-in MLP workload: input projection, `layers` residual blocks, classifier head."""
    for key, value in {"layers": layers, "width": width, "classes": classes}.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")

    def make_batch(batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(batch_size, width, generator=generator)
        return inputs, torch.randint(0, classes, (batch_size,), generator=generator)

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), targets)

    blocks: list[Callable[[], nn.Module]] = [lambda: nn.Linear(width, width)]
    blocks += [lambda: MlpBlock(width) for _ in range(layers)]
    blocks += [lambda: nn.Linear(width, classes)]
    forward = 2 * (width * width + layers * 4 * width * width + width * classes)
    return Workload(
        name="mlp", blocks=blocks, make_batch=make_batch, loss=loss, flops_per_sample=3.0 * forward,
        description=f"residual MLP, {layers} blocks, width {width}, {classes} classes",
    )
