"""MobileNetV2 (Sandler et al., CVPR 2018), for FedLMD Table 4's "MobileNet".

The FedLMD paper reports a "MobileNet" column that neither its text nor its released code defines
(spec/experiments-fedlmd.md §3: "unspecified, choose and document"). We take MobileNetV2 as in the paper's
Table 2: a 3x3 stem convolution with 32 channels, then inverted-residual stages ``(t, c, n, s)`` =
(1,16,1,1) (6,24,2,2) (6,32,3,2) (6,64,4,2) (6,96,3,1) (6,160,3,2) (6,320,1,1), a 1x1 convolution to 1280
channels, global average pooling (``extract``) and a linear classifier. An inverted residual is a 1x1
expansion by ``t`` (skipped when t = 1), a 3x3 depthwise convolution with the stage's stride on its first
block, each followed by BatchNorm and ReLU6, then a linear 1x1 projection with BatchNorm; the input is added
when the stride is 1 and the widths match.

``stem="cifar"`` (default, for 32x32 inputs) uses stride 1 in the stem and in the second stage, the usual
adaptation that keeps 4x4 maps at the end instead of 1x1; ``stem="imagenet"`` keeps the paper's strides.
``width`` scales every channel count (rounded to multiples of 8, as in the paper's reference); the last
1280 is not reduced below 1280. Convolutions are Kaiming-normal (fan_out), BatchNorm weights 1, biases 0.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..registry import MODELS
from .base import ClassifierModel

# (expansion t, output channels c, blocks n, stride s) of MobileNetV2's Table 2.
STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def round_channels(channels: float, divisor: int = 8) -> int:
    """Nearest multiple of ``divisor``, never below ``divisor`` nor more than 10% below ``channels``."""
    rounded = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * channels else rounded


def conv_bn(in_ch: int, out_ch: int, kernel: int, stride: int = 1, groups: int = 1, activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_ch),
    ]
    if activation:
        layers.append(nn.ReLU6(inplace=True))
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """1x1 expansion (t > 1) -> 3x3 depthwise (stride) -> linear 1x1 projection, plus the input if shapes allow."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = in_ch * expansion
        layers: list[nn.Module] = []
        if expansion != 1:
            layers.append(conv_bn(in_ch, hidden, 1))
        layers.append(conv_bn(hidden, hidden, 3, stride=stride, groups=hidden))
        layers.append(conv_bn(hidden, out_ch, 1, activation=False))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and in_ch == out_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.residual else out


class MobileNetV2(ClassifierModel):
    def __init__(self, input_shape: Sequence[int], num_classes: int, width: float = 1.0, stem: str = "cifar") -> None:
        super().__init__(input_shape, num_classes)
        if isinstance(width, bool) or not isinstance(width, (int, float)) or width <= 0:
            raise ConfigError(f"model 'mobilenet_v2': width must be a positive number, got {width!r}")
        if stem not in ("cifar", "imagenet"):
            raise ConfigError(f"model 'mobilenet_v2': stem must be 'cifar' or 'imagenet', got {stem!r}")
        cifar = stem == "cifar"
        ch = round_channels(32 * width)
        self.stem = conv_bn(self.input_shape[0], ch, 3, stride=1 if cifar else 2)
        blocks: list[nn.Module] = []
        for index, (t, c, n, s) in enumerate(STAGES):
            out_ch = round_channels(c * width)
            stride = 1 if (cifar and index == 1) else s
            for i in range(n):
                blocks.append(InvertedResidual(ch, out_ch, stride if i == 0 else 1, t))
                ch = out_ch
        self.blocks = nn.Sequential(*blocks)
        self.feature_dim = round_channels(1280 * width) if width > 1.0 else 1280
        self.head = conv_bn(ch, self.feature_dim, 1)
        self.classifier = nn.Linear(self.feature_dim, self.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(F.adaptive_avg_pool2d(self.head(self.blocks(self.stem(x))), 1), 1)


@MODELS.register("mobilenet_v2")
def mobilenet_v2(input_shape: Sequence[int], num_classes: int, width: float = 1.0, stem: str = "cifar") -> MobileNetV2:
    """MobileNetV2 (inverted residuals, BN, ReLU6); stem 'cifar' (stride 1, FedLMD Table 4's MobileNet) or 'imagenet'."""
    return MobileNetV2(input_shape, num_classes, width=width, stem=stem)
