"""Residual networks with BasicBlocks: ``resnet8`` (CIFAR style) and ``resnet18`` (two stems).

Blocks follow He et al. (2016): two 3x3 convolutions with BatchNorm, ReLU after the first and after the
sum; the shortcut is the identity, or a 1x1 convolution + BatchNorm when the stride or the width changes
("option B"). Convolutions have no bias; they are initialised Kaiming-normal (fan_out, ReLU gain),
BatchNorm weights to 1 and biases to 0, the linear classifier keeps PyTorch's default initialisation.

``resnet18`` — BasicBlock [2, 2, 2, 2] with 64/128/256/512 channels. ``stem="cifar"`` (default) is a
3x3/1 convolution without max-pooling, the usual choice for 32x32 images; ``stem="imagenet"`` is the
7x7/2 convolution + 3x3/2 max-pool layout of torchvision that FedFTG's code applies to CIFAR
(spec/fedftg.md: 11,181,642 parameters for 10 classes, 11,227,812 for 100 — this implementation has
exactly those counts). With the cifar stem a 3x32x32 input reaches the last stage at 4x4; with the
imagenet stem at 1x1.

``resnet8`` — the FedLMD paper's Table 4 reports a "ResNet-8" that neither the text nor the released code
defines (spec/experiments-fedlmd.md §3). We take the CIFAR-style ResNet of He et al. §4.2 with one
BasicBlock per stage (6n+2 layers with n=1: 1 stem conv + 3 blocks x 2 convs + 1 linear = 8 weight
layers): a 3x3 conv stem with 16 channels + BN + ReLU, three stages of 16/32/64 channels with strides
1/2/2, global average pooling and a linear classifier (78,042 parameters for 3x32x32 inputs, 10 classes).

Both accept any number of input channels and any spatial size (global average pooling makes the
classifier independent of it); inputs below 8x8 shrink to 1x1 early and are not a useful setting.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..registry import MODELS
from .base import ClassifierModel, check_positive_ints


def conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """conv3x3 -> BN -> ReLU -> conv3x3 -> BN, plus the shortcut, then ReLU."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv3x3(in_ch, out_ch, stride)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = conv3x3(out_ch, out_ch)
        self.bn2 = nn.BatchNorm2d(out_ch)
        if stride != 1 or in_ch != out_ch:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(ClassifierModel):
    """Stem, stages of BasicBlocks, global average pooling (``extract``), linear ``classifier``.

    ``stages`` lists ``(channels, blocks, stride)`` per stage; only the first block of a stage strides.
    Attributes ``stem`` and ``stages`` (an ``nn.Sequential`` of stages) let callers split the network,
    e.g. into FedICT's extractor and predictor.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        stages: Sequence[tuple[int, int, int]],
        stem_channels: int,
        stem: str = "cifar",
    ) -> None:
        super().__init__(input_shape, num_classes)
        in_ch = self.input_shape[0]
        if stem == "cifar":
            self.stem = nn.Sequential(
                conv3x3(in_ch, stem_channels),
                nn.BatchNorm2d(stem_channels),
                nn.ReLU(inplace=True),
            )
        elif stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(in_ch, stem_channels, kernel_size=7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(stem_channels),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            )
        else:
            raise ConfigError(f"resnet stem must be 'cifar' or 'imagenet', got {stem!r}")
        self.stem_kind = stem

        ch = stem_channels
        built: list[nn.Module] = []
        for out_ch, blocks, stride in stages:
            layer = [BasicBlock(ch, out_ch, stride)]
            layer += [BasicBlock(out_ch, out_ch) for _ in range(blocks - 1)]
            built.append(nn.Sequential(*layer))
            ch = out_ch
        self.stages = nn.Sequential(*built)
        self.feature_dim = ch
        self.classifier = nn.Linear(ch, self.num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """Output of the last stage before pooling, shape ``(batch, feature_dim, h, w)``."""
        return self.stages(self.stem(x))

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(F.adaptive_avg_pool2d(self.feature_map(x), 1), 1)


@MODELS.register("resnet8")
def resnet8(input_shape: Sequence[int], num_classes: int, width: int = 16) -> ResNet:
    """CIFAR-style ResNet-8: 3x3 stem, one BasicBlock per stage (16/32/64 ch, strides 1/2/2), BatchNorm."""
    (w,) = check_positive_ints("resnet8", "width", width, length=1)
    return ResNet(input_shape, num_classes, stages=[(w, 1, 1), (2 * w, 1, 2), (4 * w, 1, 2)], stem_channels=w)


@MODELS.register("resnet18")
def resnet18(input_shape: Sequence[int], num_classes: int, stem: str = "cifar", width: int = 64) -> ResNet:
    """ResNet-18: BasicBlock [2,2,2,2], 64-512 ch, BN; stem 'cifar' (3x3/1) or 'imagenet' (7x7/2 + max-pool)."""
    (w,) = check_positive_ints("resnet18", "width", width, length=1)
    stages = [(w, 2, 1), (2 * w, 2, 2), (4 * w, 2, 2), (8 * w, 2, 2)]
    return ResNet(input_shape, num_classes, stages=stages, stem_channels=w, stem=stem)
