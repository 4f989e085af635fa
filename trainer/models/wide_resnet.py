"""Wide-ResNet (Zagoruyko & Komodakis) as torchvision builds it: a Bottleneck ResNet whose 3x3
convolutions are `width_factor` times wider (torchvision's `width_per_group = 64 * k`).

Perseus/Merak train `wide_resnet{50,101}_{2,4,8}` from torchvision on 224 x 224 ImageNet images
with 1000 classes. This is the same network, layer for layer, with torchvision's parameter names
(`conv1`, `layer3.7.conv2.weight`, `fc`) and initialisation (Kaiming-normal convolutions, unit
BatchNorm, PyTorch's default Linear), so its counts equal torchvision's (wide_resnet101_2: 126.89M)
without making torchvision a dependency of the trainer. The four stages are ModuleLists (torchvision:
Sequential; the state-dict names are the same) so that the pipeline and FSDP find the bottlenecks
like transformer blocks.

The forward takes `targets` like the trainer's language models (trainer/models/lm_loss.py): given
labels it returns the summed cross entropy of the batch, else the logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from trainer.models.lm_loss import LossForward

EXPANSION = 4                      # Bottleneck: output channels = planes x 4
STAGES = ("layer1", "layer2", "layer3", "layer4")


class WideResNetConfig(PretrainedConfig):
    model_type = "wide_resnet"

    def __init__(self, layers: list[int] | tuple[int, ...] = (3, 4, 6, 3), width_factor: int = 2,
                 num_classes: int = 1000, image_size: int = 224, num_channels: int = 3, stem_channels: int = 64,
                 base_planes: int = 64, **kwargs: Any):
        self.layers = [int(n) for n in layers]
        self.width_factor = int(width_factor)
        self.num_classes, self.image_size, self.num_channels = int(num_classes), int(image_size), int(num_channels)
        self.stem_channels, self.base_planes = int(stem_channels), int(base_planes)
        super().__init__(**kwargs)

    # What the trainer's generic code reads from a transformers config.
    @property
    def num_hidden_layers(self) -> int:
        return sum(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.base_planes * 8 * EXPANSION

    @property
    def depth(self) -> int:
        """The number in the name (50, 101): 3 convolutions per bottleneck + stem + fc."""
        return 3 * sum(self.layers) + 2


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int, width: int):
        super().__init__()
        self.conv1, self.bn1 = conv1x1(inplanes, width), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = conv3x3(width, width, stride), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = conv1x1(width, planes * EXPANSION), nn.BatchNorm2d(planes * EXPANSION)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes * EXPANSION:
            self.downsample = nn.Sequential(conv1x1(inplanes, planes * EXPANSION, stride),
                                            nn.BatchNorm2d(planes * EXPANSION))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class WideResNet(LossForward, nn.Module):
    """torchvision's ResNet(Bottleneck, layers, width_per_group=64 * width_factor)."""

    base_model_prefix = ""
    loss_chunks = 1

    def __init__(self, config: WideResNetConfig):
        super().__init__()
        self.config = c = config
        self.conv1 = nn.Conv2d(c.num_channels, c.stem_channels, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(c.stem_channels)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = c.stem_channels
        for i, (name, n) in enumerate(zip(STAGES, c.layers, strict=True)):
            planes = c.base_planes * 2 ** i
            width = planes * c.width_factor  # planes * (64 k / 64)
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(inplanes, planes, 2 if (i > 0 and j == 0) else 1, width))
                inplanes = planes * EXPANSION
            setattr(self, name, nn.ModuleList(blocks))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, c.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def stem(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))

    def bottlenecks(self) -> list[nn.Module]:
        return [b for name in STAGES for b in getattr(self, name)]

    def forward(self, pixel_values: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.stem(pixel_values if pixel_values is not None else input_ids)
        for block in self.bottlenecks():
            h = block(h)
        return classify(self.fc, self.avgpool, h, targets)


def train_flops_per_image(config: WideResNetConfig) -> float:
    """Forward + backward FLOPs of one image (3 x the forward's 2 x multiply-adds of every convolution
    and the fc; MFU's numerator, where 6 x parameters would ignore that a filter slides)."""
    size = config.image_size

    def out(n: int, stride: int) -> int:
        return (n - 1) // stride + 1

    def conv(cin: int, cout: int, k: int, n_out: int) -> float:
        return 2.0 * k * k * cin * cout * n_out * n_out

    n = out(size, 2)  # conv1, stride 2
    total = conv(config.num_channels, config.stem_channels, 7, n)
    n = out(n, 2)  # maxpool
    inplanes = config.stem_channels
    for i, blocks in enumerate(config.layers):
        planes = config.base_planes * 2 ** i
        width = planes * config.width_factor
        for j in range(blocks):
            stride = 2 if (i > 0 and j == 0) else 1
            n2 = out(n, stride)
            total += conv(inplanes, width, 1, n) + conv(width, width, 3, n2) + conv(width, planes * EXPANSION, 1, n2)
            if stride != 1 or inplanes != planes * EXPANSION:
                total += conv(inplanes, planes * EXPANSION, 1, n2)
            inplanes, n = planes * EXPANSION, n2
    total += 2.0 * inplanes * config.num_classes
    return 3.0 * total


def classify(fc: nn.Module, pool: nn.Module, h: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """Pool, fc, and with targets the batch's summed cross entropy (fp32)."""
    logits = fc(torch.flatten(pool(h), 1))
    if targets is None:
        return logits
    return F.cross_entropy(logits.float(), targets, reduction="sum")
