"""FedICT's client and server models (paper Table III; spec/experiments-fedict.md §4) with an explicit
extractor / predictor split for federated distillation (FedGKT, FedDKC, FedICT).

A federated-distillation client is cut in two:

* the **extractor** maps an input to the features ``H`` that the client uploads to the server;
* the **predictor** maps ``H`` to logits (everything after the extractor, classifier included).

Client models are :class:`SplitClassifier` instances. They are ordinary :class:`ClassifierModel` s
(``extract`` = pooled penultimate vector, ``classifier`` = final ``nn.Linear``, ``forward = classify(extract)``),
so weight-averaging methods (FedAvg, FedAdam, ...) train them like any zoo model, and additionally expose

* ``split_features(x) -> H`` — the extractor output (attribute ``extractor``);
* ``split_predict(h) -> logits`` — the predictor (attributes ``body`` and ``classifier``);
  ``forward(x) == split_predict(split_features(x))`` exactly (the same operations in the same order);
* ``embed(h)`` — the predictor without its classifier: ``extract(x) == embed(split_features(x))``;
* ``feature_shape`` — the per-sample shape of ``H`` for the model's ``input_shape``;
* ``predictor_modules()``, ``extractor_parameters()``, ``predictor_parameters()`` — to tell the two
  halves' parameters apart (e.g. FedGKT-style methods that freeze or regularise one of them).

Server models (:class:`FDResNetServer`, ``fd_server_mlp``) take ``H`` as their input: their
``input_shape`` is a client's ``feature_shape`` and they contain no stem. ``forward(h)`` = logits,
``extract(h)`` = their pooled penultimate vector. Build one with
``build_model(server_name, client.feature_shape, num_classes)``.

Image models (CIFAR-style ResNet pieces; ``resnet*_56`` in the FedICT code)
--------------------------------------------------------------------------
Extractor: Conv3x3(C_in→16, stride 1, padding 1, no bias) → BN(16) → ReLU, so ``H`` has shape
``(16, height, width)`` (the spatial size is kept). Predictor: a stage of residual blocks →
AdaptiveAvgPool(1) → flatten → Linear(·, num_classes). Parameter counts for 3 input channels, 10 classes
(the card's "ours" column; BatchNorm affine parameters included, running statistics are buffers):

=====================  =========  ================================================================  =======
name                   paper      predictor stage                                                    params
=====================  =========  ================================================================  =======
``fd_resnet2``         A^C_1      none; Linear(16, C)                                                    634
``fd_resnet4``         A^C_2      1 BasicBlock(16); Linear(16, C)                                      5,306
``fd_resnet8``         A^C_3      2 Bottleneck(planes 16 → 64 ch, first with 1x1 projection); Linear   10,586
``fd_resnet10``        A^C_4      2 BasicBlock(16); Linear(16, C)                                      9,978
``fd_resnet12``        A^C_5      2 BasicBlock(16) (same forward path as A^C_4); Linear(16, C)         9,978
``fd_server_resnet56`` A^S_0      input H; 3 stages x 6 Bottlenecks, planes 16/32/64, strides 1/2/2  590,858
=====================  =========  ================================================================  =======

The FedICT code builds unused ``layer2`` modules in A^C_4/A^C_5 and an unused stem in the server; they are
not built here (they would add weights that never train but still travel in a flat weight vector).
The extractor has ``16·C_in·9 + 32`` parameters (464 for 3 channels, 176 for 1).

``fd_server_resnet56`` takes ``blocks_per_stage`` (default 6, the paper's ResNet-56 server): a smaller
value builds the same three-stage server with fewer Bottlenecks per stage, e.g. ``blocks_per_stage=1`` for
quick CPU benchmarks. Its first block reads ``input_shape[0]`` channels (16 for the clients above).

Blocks: :class:`~fedistill.models.resnet.BasicBlock` (torchvision layout: conv3x3-BN-ReLU-conv3x3-BN, plus
the identity or a 1x1-conv+BN projection, then ReLU) and :class:`TorchvisionBottleneck` (1x1 → 3x3 (stride)
→ 1x1 with 4x expansion, BN after each, ReLU after the first two and after the sum; 1x1-conv+BN projection
when the channels or the stride change). The zoo's ``resnet.Bottleneck`` uses three 3x3 convolutions
(DaFKD) and is therefore not reused. Initialisation: convolutions Kaiming-normal (fan_out, ReLU gain),
BatchNorm weight 1 / bias 0, linear layers PyTorch's default.

Fully connected models (TMD; features "13")
-------------------------------------------
Clients ``fd_mlp16`` / ``fd_mlp32`` / ``fd_mlp64`` (A^C_6/7/8): extractor flatten → Linear(d, 13) → ReLU,
predictor Linear(13, h) → ReLU → Linear(h, C) with h = 16/32/64, where d = C_in·H·W is the flattened
size of ``input_shape`` (tabular data is given as ``(d, 1, 1)``). Parameters
``13d + 13 + 14h + hC + C``, i.e. ``13d + 322 / 626 / 1234`` for C = 5. ``extract`` is the hidden layer
of width h (after ReLU); ``H`` has ``feature_shape == (13,)`` and ``split_features`` returns ``(B, 13)``.

Server ``fd_server_mlp`` (A^S_1): Linear(13, 35) → ReLU → Linear(35, 38) → ReLU → Linear(38, C); 2,053
parameters for C = 5. Flat features: :class:`ClassifierModel` stores a 3-D ``input_shape``, so the factories
of the fully connected models also accept a 1-D shape ``(n,)`` and store it as ``(n, 1, 1)``; the server's
``input_shape`` is then ``(13, 1, 1)`` and ``build_model("fd_server_mlp", client.feature_shape, C)`` works
with the client's ``(13,)``. Every fully connected model flattens its input from dimension 1 on, so the
server accepts ``H`` as ``(B, 13)`` or ``(B, 13, 1, 1)`` alike, and a client any ``(B, *input_shape)``.

Wrapping a model with MOON's ``projection_dim`` (:class:`~fedistill.models.projection.ProjectedClassifier`)
gives a plain ClassifierModel without the split methods.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
from torch import nn

from ..registry import MODELS
from .base import ClassifierModel, check_positive_ints
from .mlp import MLP
from .pooling import GlobalAveragePool
from .resnet import BasicBlock, conv3x3, init_conv_bn, relu_of_sum

#: The per-sample feature width of the image clients' extractor (the channels of ``H``).
IMAGE_FEATURE_CHANNELS = 16
#: The per-sample feature size of the fully connected clients' extractor.
MLP_FEATURE_DIM = 13

#: Image clients in paper order A^C_1 .. A^C_5 (heterogeneous setting: client k gets entry k mod 5).
IMAGE_CLIENT_MODELS = ("fd_resnet2", "fd_resnet4", "fd_resnet8", "fd_resnet10", "fd_resnet12")
#: Fully connected (TMD) clients A^C_6, A^C_7, A^C_8.
MLP_CLIENT_MODELS = ("fd_mlp16", "fd_mlp32", "fd_mlp64")


class TorchvisionBottleneck(nn.Module):
    """torchvision's Bottleneck (v1.5): 1x1 ``in→planes``, 3x3 ``planes→planes`` (stride), 1x1
    ``planes→4·planes``, BN after each, ReLU after the first two and after the sum with the shortcut.

    The shortcut is the identity, or a 1x1 convolution (with the stride) + BN when the channels or the
    stride change.
    """

    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = planes * self.expansion
        self.conv1 = nn.Conv2d(in_ch, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_ch, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)  # on this block's own BatchNorm outputs only (resnet.relu_of_sum)
        if stride != 1 or in_ch != out_ch:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return relu_of_sum(out, self.shortcut(x))


def _pool_flatten() -> nn.Module:
    """Global average pooling to ``(batch, channels)``, its gradient in the activations' layout (models/pooling.py)."""
    return GlobalAveragePool()


def _flat_shape(input_shape: Sequence[int]) -> Sequence[int]:
    """A 1-D shape ``(n,)`` becomes ``(n, 1, 1)``; anything else is passed on (and validated by the base)."""
    try:
        if len(input_shape) == 1:
            return (input_shape[0], 1, 1)
    except TypeError:
        pass
    return input_shape


def _bottleneck_stage(in_ch: int, planes: int, blocks: int, stride: int) -> tuple[nn.Sequential, int]:
    """``blocks`` Bottlenecks of width ``planes``; only the first strides. Returns the stage and its width."""
    layers: list[nn.Module] = [TorchvisionBottleneck(in_ch, planes, stride)]
    out_ch = planes * TorchvisionBottleneck.expansion
    layers += [TorchvisionBottleneck(out_ch, planes) for _ in range(blocks - 1)]
    return nn.Sequential(*layers), out_ch


class SplitClassifier(ClassifierModel):
    """A client model cut into ``extractor`` (features ``H`` that are uploaded) and predictor
    (``body`` → ``classifier``).

    Subclasses set ``extractor``, ``body`` (``H`` → penultimate vector of size ``feature_dim``),
    ``classifier`` and ``feature_shape`` (per-sample shape of ``H``).
    """

    extractor: nn.Module
    body: nn.Module
    feature_shape: tuple[int, ...]

    def split_features(self, x: torch.Tensor) -> torch.Tensor:
        """The extractor's output ``H``, shape ``(batch, *feature_shape)``."""
        return self.extractor(x)

    def embed(self, h: torch.Tensor) -> torch.Tensor:
        """The predictor without its classifier: ``H`` → penultimate vector ``(batch, feature_dim)``."""
        return self.body(h)

    def split_predict(self, h: torch.Tensor) -> torch.Tensor:
        """The predictor: ``H`` → logits ``(batch, num_classes)``."""
        return self.classify(self.embed(h))

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(self.split_features(x))

    def predictor_modules(self) -> tuple[nn.Module, nn.Module]:
        """The modules after the extractor, in order: ``(body, classifier)``."""
        return (self.body, self.classifier)

    def extractor_parameters(self) -> Iterator[nn.Parameter]:
        return self.extractor.parameters()

    def predictor_parameters(self) -> Iterator[nn.Parameter]:
        for module in self.predictor_modules():
            yield from module.parameters()


# -- image models -------------------------------------------------------------------------------------


class FDResNetClient(SplitClassifier):
    """Image client: 3x3 conv stem (16 ch) + BN + ReLU as the extractor, then ``stage`` → global average
    pooling → ``Linear(feature_dim, num_classes)``.

    ``stage`` is ``"none"``, ``"basic"`` (``blocks`` BasicBlocks of 16 channels) or ``"bottleneck"``
    (``blocks`` Bottlenecks of width 16, 64 output channels, the first with a 1x1 projection).
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, stage: str = "none", blocks: int = 0) -> None:
        super().__init__(input_shape, num_classes)
        in_ch, height, width = self.input_shape
        ch = IMAGE_FEATURE_CHANNELS
        self.extractor = nn.Sequential(conv3x3(in_ch, ch), nn.BatchNorm2d(ch), nn.ReLU(inplace=True))
        self.feature_shape = (ch, height, width)
        if stage == "none":
            layers: nn.Module = nn.Identity()
        elif stage == "basic":
            layers = nn.Sequential(*[BasicBlock(ch, ch) for _ in range(blocks)])
        elif stage == "bottleneck":
            layers, ch = _bottleneck_stage(ch, IMAGE_FEATURE_CHANNELS, blocks, stride=1)
        else:  # a registration bug, not a user error
            raise ValueError(f"unknown stage kind {stage!r}")
        self.stage_kind = stage
        self.body = nn.Sequential(layers, _pool_flatten())
        self.feature_dim = ch
        self.classifier = nn.Linear(ch, self.num_classes)
        init_conv_bn(self)


class FDResNetServer(ClassifierModel):
    """Image server (FedICT's ``resnet56_server``): input ``H`` (``input_shape[0]`` channels, 16 for the
    clients), three stages of ``blocks_per_stage`` Bottlenecks with planes 16/32/64 and strides 1/2/2
    (outputs 64/128/256 channels), global average pooling, ``Linear(256, num_classes)``. No stem."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, blocks_per_stage: int = 6) -> None:
        super().__init__(input_shape, num_classes)
        (blocks,) = check_positive_ints("fd_server_resnet56", "blocks_per_stage", blocks_per_stage, length=1)
        ch = self.input_shape[0]
        stages: list[nn.Module] = []
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            stage, ch = _bottleneck_stage(ch, planes, blocks, stride)
            stages.append(stage)
        self.blocks_per_stage = blocks
        self.stages = nn.Sequential(*stages)
        self.pool = _pool_flatten()
        self.feature_dim = ch
        self.classifier = nn.Linear(ch, self.num_classes)
        init_conv_bn(self)

    def feature_map(self, h: torch.Tensor) -> torch.Tensor:
        """Output of the last stage before pooling, shape ``(batch, 256, h', w')``."""
        return self.stages(h)

    def extract(self, h: torch.Tensor) -> torch.Tensor:
        return self.pool(self.feature_map(h))


@MODELS.register("fd_resnet2")
def fd_resnet2(input_shape: Sequence[int], num_classes: int) -> FDResNetClient:
    """FedICT A^C_1 (resnet2_56): conv stem extractor; predictor = avg-pool + Linear(16, C) (634 params)."""
    return FDResNetClient(input_shape, num_classes, stage="none")


@MODELS.register("fd_resnet4")
def fd_resnet4(input_shape: Sequence[int], num_classes: int) -> FDResNetClient:
    """FedICT A^C_2 (resnet4_56): conv stem extractor; predictor = 1 BasicBlock(16) + Linear(16, C) (5,306)."""
    return FDResNetClient(input_shape, num_classes, stage="basic", blocks=1)


@MODELS.register("fd_resnet8")
def fd_resnet8(input_shape: Sequence[int], num_classes: int) -> FDResNetClient:
    """FedICT A^C_3 (resnet8_56): conv stem extractor; predictor = 2 Bottlenecks (→64 ch) + Linear(64, C) (10,586)."""
    return FDResNetClient(input_shape, num_classes, stage="bottleneck", blocks=2)


@MODELS.register("fd_resnet10")
def fd_resnet10(input_shape: Sequence[int], num_classes: int) -> FDResNetClient:
    """FedICT A^C_4 (resnet10_56): conv stem extractor; predictor = 2 BasicBlocks(16) + Linear(16, C) (9,978)."""
    return FDResNetClient(input_shape, num_classes, stage="basic", blocks=2)


@MODELS.register("fd_resnet12")
def fd_resnet12(input_shape: Sequence[int], num_classes: int) -> FDResNetClient:
    """FedICT A^C_5 (resnet12_56): same forward path as A^C_4, unused modules not built (9,978)."""
    return FDResNetClient(input_shape, num_classes, stage="basic", blocks=2)


@MODELS.register("fd_server_resnet56")
def fd_server_resnet56(input_shape: Sequence[int], num_classes: int, blocks_per_stage: int = 6) -> FDResNetServer:
    """FedICT A^S_0 on features H: 3 stages x blocks_per_stage Bottlenecks (64/128/256 ch) + Linear(256, C)."""
    return FDResNetServer(input_shape, num_classes, blocks_per_stage=blocks_per_stage)


# -- fully connected models ---------------------------------------------------------------------------


class FDMLPClient(SplitClassifier):
    """Fully connected client: extractor flatten → ``Linear(d, 13)`` → ReLU; predictor ``Linear(13, hidden)``
    → ReLU → ``Linear(hidden, num_classes)`` with ``d = prod(input_shape)``."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int = 16) -> None:
        super().__init__(_flat_shape(input_shape), num_classes)
        (width,) = check_positive_ints("fd_mlp", "hidden", hidden, length=1)
        in_dim = math.prod(self.input_shape)
        self.extractor = nn.Sequential(nn.Flatten(1), nn.Linear(in_dim, MLP_FEATURE_DIM), nn.ReLU())
        self.feature_shape = (MLP_FEATURE_DIM,)
        # Flatten first so that split_predict also takes H as (B, 13, 1, 1).
        self.body = nn.Sequential(nn.Flatten(1), nn.Linear(MLP_FEATURE_DIM, width), nn.ReLU())
        self.hidden = width
        self.feature_dim = width
        self.classifier = nn.Linear(width, self.num_classes)


@MODELS.register("fd_mlp16")
def fd_mlp16(input_shape: Sequence[int], num_classes: int) -> FDMLPClient:
    """FedICT A^C_6: Linear(d,13)+ReLU extractor; Linear(13,16)+ReLU+Linear(16,C) predictor (13d+322 for C=5)."""
    return FDMLPClient(input_shape, num_classes, hidden=16)


@MODELS.register("fd_mlp32")
def fd_mlp32(input_shape: Sequence[int], num_classes: int) -> FDMLPClient:
    """FedICT A^C_7: Linear(d,13)+ReLU extractor; Linear(13,32)+ReLU+Linear(32,C) predictor (13d+626 for C=5)."""
    return FDMLPClient(input_shape, num_classes, hidden=32)


@MODELS.register("fd_mlp64")
def fd_mlp64(input_shape: Sequence[int], num_classes: int) -> FDMLPClient:
    """FedICT A^C_8: Linear(d,13)+ReLU extractor; Linear(13,64)+ReLU+Linear(64,C) predictor (13d+1234 for C=5)."""
    return FDMLPClient(input_shape, num_classes, hidden=64)


@MODELS.register("fd_server_mlp")
def fd_server_mlp(input_shape: Sequence[int], num_classes: int) -> MLP:
    """FedICT A^S_1 on 13 features: Linear(13,35)+ReLU+Linear(35,38)+ReLU+Linear(38,C) (2,053 params for C=5).

    The zoo's :class:`~fedistill.models.mlp.MLP`, which flattens its input, so ``(B, 13)`` and ``(B, 13, 1, 1)``
    features give the same logits."""
    return MLP(_flat_shape(input_shape), num_classes, hidden=(35, 38))
