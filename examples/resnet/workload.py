"""The ResNet as an mbtune workload: `mbtune check --workload examples.resnet.workload:resnet`. GroupNorm by
default: BatchNorm's statistics change with the micro-batch, so a pipeline is not the plain model (check says so)."""
import torch
import torch.nn.functional as F
from torch import nn

from examples.resnet.model import resnet18
from mbtune.workloads import Workload


def resnet(image: int = 32, classes: int = 10, width: int = 16, norm: str = "group") -> Workload:
    layer = (lambda c: nn.GroupNorm(4, c)) if norm == "group" else nn.BatchNorm2d
    return Workload.from_module(
        lambda: resnet18(num_classes=classes, width=width, norm_layer=layer), name="resnet18",
        make_batch=lambda b, g: (torch.randn(b, 3, image, image, generator=g), torch.randint(0, classes, (b,), generator=g)),
        loss=F.cross_entropy)
