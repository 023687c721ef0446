"""Residual networks: ``resnet8`` (CIFAR style) and ``resnet18`` (two stems) with BasicBlocks, and
DaFKD's ``resnet11`` with 3x3 Bottleneck blocks.

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

``resnet11`` — DaFKD's ``MTLResNet(Bottleneck, [2, 2, 2])`` (spec/dafkd.md "Architectures"): a 3x3 conv stem
with 16 channels + BN + ReLU, three stages of two :class:`Bottleneck` blocks with widths 16/32/64 and expansion 4
(block outputs 64/128/256 channels), strides 1/2/2, global average pooling to a 256-d feature and a linear
classifier. Unlike torchvision's bottleneck, all three convolutions of a block are 3x3. Parameter counts (card):
817,872 in the trunk for 3 input channels (817,584 for 1) plus 2,570 in the 10-class head; 3,616 BatchNorm
running-statistic floats. DaFKD's discriminator is the same network with ``num_classes=1``.

All accept any number of input channels and any spatial size (global average pooling makes the
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
from .pooling import global_average_pool


def init_conv_bn(module: nn.Module) -> None:
    """Kaiming-normal (fan_out, ReLU) for convolutions, BN weight 1 / bias 0; linear layers keep their init."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


def _shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module:
    """Identity, or a 1x1 convolution + BatchNorm ("option B") when the stride or the width changes."""
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False),
        nn.BatchNorm2d(out_ch),
    )


def relu_of_sum(out: torch.Tensor, shortcut: torch.Tensor) -> torch.Tensor:
    """``relu(out + shortcut)``, written into ``out`` (a block's own BatchNorm output) where the dtypes agree.

    The same values as the out-of-place expression: only fewer activation-sized buffers are written, which is
    what these narrow networks' elementwise operators cost on a CPU (a 3 MB activation misses the core's cache:
    benchmarks/RESULTS.md, "The pooling's gradient layout"). BatchNorm's backward reads its input, not its
    output, so overwriting the output is safe for autograd (torchvision's blocks do the same). Where the dtypes
    differ (an fp32 identity shortcut beside a bf16 autocast branch) the sum is promoted, as before, out of place.
    """
    if out.dtype == shortcut.dtype and out.shape == shortcut.shape:
        return F.relu(out.add_(shortcut), inplace=True)
    return F.relu(out + shortcut)


class BasicBlock(nn.Module):
    """conv3x3 -> BN -> ReLU -> conv3x3 -> BN, plus the shortcut, then ReLU."""

    expansion = 1  # output channels = expansion x the block's width

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv3x3(in_ch, out_ch, stride)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = conv3x3(out_ch, out_ch)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut = _shortcut(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return relu_of_sum(out, self.shortcut(x))


class Bottleneck(nn.Module):
    """DaFKD's bottleneck: three 3x3 convolutions ``in -> width -> width -> 4·width``, each followed by BN,
    ReLU after the first two and after the sum with the shortcut.

    DaFKD's code uses 3x3 kernels for all three convolutions (not torchvision's 1x1-3x3-1x1). The stride
    sits on the middle convolution (torchvision v1.5 placement); the card only says that the first block
    of a stage strides, and the placement does not change the parameter count.
    """

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = conv3x3(in_ch, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv3x3(width, out_ch)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.shortcut = _shortcut(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = F.relu(self.bn2(self.conv2(out)), inplace=True)
        out = self.bn3(self.conv3(out))
        return relu_of_sum(out, self.shortcut(x))


class ResNet(ClassifierModel):
    """Stem, stages of residual blocks, global average pooling (``extract``), linear ``classifier``.

    ``stages`` lists ``(width, blocks, stride)`` per stage; only the first block of a stage strides. A stage
    outputs ``width x block.expansion`` channels (``block`` is :class:`BasicBlock` or :class:`Bottleneck`).
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
        block: type[BasicBlock] | type[Bottleneck] = BasicBlock,
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
        for width, blocks, stride in stages:
            layer: list[nn.Module] = [block(ch, width, stride)]
            ch = width * block.expansion
            layer += [block(ch, width) for _ in range(blocks - 1)]
            built.append(nn.Sequential(*layer))
        self.stages = nn.Sequential(*built)
        self.feature_dim = ch
        self.classifier = nn.Linear(ch, self.num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        init_conv_bn(self)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """Output of the last stage before pooling, shape ``(batch, feature_dim, h, w)``."""
        return self.stages(self.stem(x))

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return global_average_pool(self.feature_map(x))


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


@MODELS.register("resnet11")
def resnet11(input_shape: Sequence[int], num_classes: int, width: int = 16) -> ResNet:
    """DaFKD's ResNet-11: 3x3 stem, 3x3 Bottleneck [2,2,2] (widths 16/32/64, out 64/128/256 ch, strides 1/2/2), BN."""
    (w,) = check_positive_ints("resnet11", "width", width, length=1)
    stages = [(w, 2, 1), (2 * w, 2, 2), (4 * w, 2, 2)]
    return ResNet(input_shape, num_classes, stages=stages, stem_channels=w, block=Bottleneck)
