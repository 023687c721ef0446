"""Model groups: clients of different architectures that share one feature dimension and a linear head.

The heterogeneous-model family (FD, FedProto, FedGH, FedTGP, LG-FedAvg, ...) is compared on HtFLlib's "HtFE"
groups (Zhang et al., KDD'25 Benchmark track; github.com/TsingZ0/HtFLlib, ``system/main.py``): a list of
architectures, client k training member ``k mod M``. Every member is split into an extractor ending in a feature
of one common dimension ``feature_dim`` (512 by default, HtFLlib's ``-fd``) and a head
``classifier = nn.Linear(feature_dim, num_classes)``; prototype methods read the feature, LG-FedAvg averages the
head. A group is chosen with ``model.group: NAME`` (options for its members in ``model.group_kwargs``, e.g.
``{feature_dim: 256}``); every member is also a model name of its own, so ``model.clients`` can list any of them.

**How each member reaches the common dimension.** HtFLlib's ``BaseHeadSplit`` takes a classifier, removes its
last linear layer (``fc``) and puts ``nn.AdaptiveAvgPool1d(feature_dim)`` in its place: the network's own
penultimate vector of width ``n`` is average-pooled to ``feature_dim`` along its length (windows
``[floor(i n/d), ceil((i+1) n/d))``, which overlap when ``n`` is not a multiple of ``d`` and repeat each entry
``d/n`` times when ``n < d``). The members taken from HtFLlib do exactly that (:class:`PooledToDim`):

=====================  ==========================================================  ==========  =============
member                 HtFLlib source                                              own width   to 512
=====================  ==========================================================  ==========  =============
``ht_fedavgcnn``       ``FedAvgCNN`` (models.py)                                   512         identity
``ht_resnet4/6/8/10``  ``resnet4/6/8/10`` (resnet.py, BasicBlock [1]..[1,1,1,1])   64..512     repeat 8/4/2/1
``ht_resnet18/34``     ``resnet18/34`` (resnet.py; torchvision's layout)           512         identity
``ht_mobilenet_v2``    ``mobilenet_v2`` (mobilenet_v2.py)                          1280        windows of 3
=====================  ==========================================================  ==========  =============

The members of our own make their last linear layer ``feature_dim`` wide, as HtFLlib's ``CNN`` and its text
models do with ``args.feature_dim``: ``ht_cnn4`` (four 3x3 conv + BatchNorm layers, global average pooling,
``Linear(256, feature_dim)`` + ReLU) and ``ht_mlp`` (``Linear(in, 1024)`` + ReLU, ``Linear(1024, feature_dim)`` +
ReLU).

**Adapted from HtFLlib, nothing else changed.** Its image groups are written for 3x32x32 inputs; here the first
convolution takes the input's channels (1 for MNIST) and FedAvgCNN's flatten size follows the input (1024 for
28x28, 1600 for 32x32, HtFLlib's ``dim``). Kept as HtFLlib has them: FedAvgCNN's unpadded 5x5 convolutions and
512-wide ``fc1`` (so the pool, not ``fc1``, follows ``feature_dim``); the ResNets' ImageNet stem (7x7/2
convolution, 3x3/2 max-pool) and widths 64/128/256/512 with one BasicBlock per stage for ResNet-4..10
(:class:`~fedistill.models.resnet.ResNet` builds the same layers); MobileNetV2's ImageNet strides and its
``Dropout(0.2)``, which sits before ``fc`` and so stays in HtFLlib's extractor (option ``dropout``; 0 removes it,
e.g. for ``run.cuda_graphs``). Parameter names differ from HtFLlib's; the layers, their counts and the
initialisations are the same (the ResNets' and MobileNetV2's Kaiming-normal fan_out convolutions and BatchNorm 1/0,
PyTorch's defaults for FedAvgCNN and for every head).
HtFLlib's ``HtFE-img-4/5/8`` also hold torchvision's GoogLeNet and ResNet-50/101/152, which are not in this zoo.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..registry import MODEL_GROUPS, MODELS
from .base import ClassifierModel, check_min_size, check_positive_ints
from .cnn import FedAvgNet
from .mlp import MLP
from .mobilenet import MobileNetV2
from .pooling import global_average_pool
from .resnet import ResNet, init_conv_bn

FEATURE_DIM = 512  # HtFLlib's default -fd


def pool_to_dim(features: torch.Tensor, dim: int) -> torch.Tensor:
    """``(batch, n) -> (batch, dim)``: HtFLlib's ``nn.AdaptiveAvgPool1d(dim)`` on the flat feature (n = dim: itself)."""
    if features.shape[-1] == dim:
        return features
    return F.adaptive_avg_pool1d(features.unsqueeze(1), dim).squeeze(1)


class PooledToDim(ClassifierModel):
    """A zoo model (``body``) whose own feature is average-pooled to ``feature_dim`` before a new linear head.

    HtFLlib's ``BaseHeadSplit``: ``extract(x) = pool(dropout(body.extract(x)))``, ``classifier`` a new
    ``Linear(feature_dim, num_classes)``. The body's classifier becomes an identity, so no unused weights enter
    the flat vector. ``native_dim`` is the body's own feature width.
    """

    def __init__(self, body: ClassifierModel, feature_dim: int, dropout: float = 0.0) -> None:
        super().__init__(body.input_shape, body.num_classes)
        body.classifier = nn.Identity()  # type: ignore[assignment]
        self.body = body
        self.native_dim = body.feature_dim
        self.feature_dim = feature_dim
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.classifier = nn.Linear(feature_dim, self.num_classes)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return pool_to_dim(self.dropout(self.body.extract(x)), self.feature_dim)


class FedAvgCNN(FedAvgNet):
    """HtFLlib's FedAvgCNN: our ``cnn`` (two 5x5 convolutions of 32 and 64 channels, 2x2 max-pooling, a 512-wide
    ``fc1``) with its convolutions unpadded, so its flatten size follows the input as HtFLlib's ``dim`` does (1024
    for 28x28, 1600 for 32x32)."""

    zoo_name = "ht_fedavgcnn"
    padding = 0


class ConvNet4(ClassifierModel):
    """Four 3x3 convolutions (padding 1, no bias) each with BatchNorm and ReLU, 2x2 max-pooling after the first
    three, global average pooling, then ``Linear(channels[-1], feature_dim)`` + ReLU (our own member)."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        feature_dim: int,
        channels: Sequence[int] = (32, 64, 128, 256),
    ) -> None:
        super().__init__(input_shape, num_classes)
        widths = check_positive_ints("ht_cnn4", "channels", channels, length=4)
        check_min_size("ht_cnn4", self.input_shape, 8)
        layers: list[nn.Module] = []
        in_ch = self.input_shape[0]
        for i, width in enumerate(widths):
            layers += [nn.Conv2d(in_ch, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
            if i < len(widths) - 1:
                layers.append(nn.MaxPool2d(2))
            in_ch = width
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(in_ch, feature_dim)
        self.feature_dim = feature_dim
        self.classifier = nn.Linear(feature_dim, self.num_classes)
        init_conv_bn(self)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(global_average_pool(self.features(x))))


def _feature_dim(name: str, feature_dim: object) -> int:
    (dim,) = check_positive_ints(name, "feature_dim", feature_dim, length=1)
    return dim


# -- the members --------------------------------------------------------------------------------------------


@MODELS.register("ht_fedavgcnn")
def ht_fedavgcnn(input_shape: Sequence[int], num_classes: int, feature_dim: int = FEATURE_DIM) -> PooledToDim:
    """HtFLlib's FedAvgCNN: 2x (unpadded 5x5 conv + ReLU + 2x2 max-pool), fc1 512 + ReLU, pooled to feature_dim."""
    dim = _feature_dim("ht_fedavgcnn", feature_dim)
    return PooledToDim(FedAvgCNN(input_shape, num_classes), dim)


def _ht_resnet(
    name: str, blocks: Sequence[int], input_shape: Sequence[int], num_classes: int, feature_dim: object
) -> PooledToDim:
    """HtFLlib's resnet.py: ImageNet stem, BasicBlock stages of widths 64/128/256/512 (strides 1/2/2/2)."""
    dim = _feature_dim(name, feature_dim)
    stages = [(64 * 2**i, n, 1 if i == 0 else 2) for i, n in enumerate(blocks)]
    return PooledToDim(ResNet(input_shape, num_classes, stages=stages, stem_channels=64, stem="imagenet"), dim)


@MODELS.register("ht_resnet4")
def ht_resnet4(input_shape: Sequence[int], num_classes: int, feature_dim: int = FEATURE_DIM) -> PooledToDim:
    """HtFLlib's ResNet-4: ImageNet stem, one BasicBlock of 64 ch; the 64-d feature pooled (repeated) to feature_dim."""
    return _ht_resnet("ht_resnet4", [1], input_shape, num_classes, feature_dim)


@MODELS.register("ht_resnet6")
def ht_resnet6(input_shape: Sequence[int], num_classes: int, feature_dim: int = FEATURE_DIM) -> PooledToDim:
    """HtFLlib's ResNet-6: ImageNet stem, BasicBlock [1,1] (64/128 ch); the 128-d feature pooled to feature_dim."""
    return _ht_resnet("ht_resnet6", [1, 1], input_shape, num_classes, feature_dim)


@MODELS.register("ht_resnet8")
def ht_resnet8(input_shape: Sequence[int], num_classes: int, feature_dim: int = FEATURE_DIM) -> PooledToDim:
    """HtFLlib's ResNet-8: ImageNet stem, BasicBlock [1,1,1] (64-256 ch); the 256-d feature pooled to feature_dim."""
    return _ht_resnet("ht_resnet8", [1, 1, 1], input_shape, num_classes, feature_dim)


@MODELS.register("ht_resnet10")
def ht_resnet10(input_shape: Sequence[int], num_classes: int, feature_dim: int = FEATURE_DIM) -> PooledToDim:
    """HtFLlib's ResNet-10: ImageNet stem, BasicBlock [1,1,1,1] (64-512 ch); the 512-d feature pooled to feature_dim."""
    return _ht_resnet("ht_resnet10", [1, 1, 1, 1], input_shape, num_classes, feature_dim)


@MODELS.register("ht_resnet18")
def ht_resnet18(input_shape: Sequence[int], num_classes: int, feature_dim: int = FEATURE_DIM) -> PooledToDim:
    """HtFLlib's (torchvision's) ResNet-18: ImageNet stem, BasicBlock [2,2,2,2]; 512-d feature pooled to feature_dim."""
    return _ht_resnet("ht_resnet18", [2, 2, 2, 2], input_shape, num_classes, feature_dim)


@MODELS.register("ht_resnet34")
def ht_resnet34(input_shape: Sequence[int], num_classes: int, feature_dim: int = FEATURE_DIM) -> PooledToDim:
    """HtFLlib's (torchvision's) ResNet-34: ImageNet stem, BasicBlock [3,4,6,3]; 512-d feature pooled to feature_dim."""
    return _ht_resnet("ht_resnet34", [3, 4, 6, 3], input_shape, num_classes, feature_dim)


@MODELS.register("ht_mobilenet_v2")
def ht_mobilenet_v2(
    input_shape: Sequence[int], num_classes: int, feature_dim: int = FEATURE_DIM, dropout: float = 0.2
) -> PooledToDim:
    """HtFLlib's MobileNetV2: ImageNet strides, 1280-d feature, its Dropout(0.2), pooled to feature_dim."""
    dim = _feature_dim("ht_mobilenet_v2", feature_dim)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"model 'ht_mobilenet_v2': dropout must be a number in [0, 1), got {dropout!r}")
    return PooledToDim(MobileNetV2(input_shape, num_classes, stem="imagenet"), dim, dropout=float(dropout))


@MODELS.register("ht_cnn4")
def ht_cnn4(
    input_shape: Sequence[int],
    num_classes: int,
    feature_dim: int = FEATURE_DIM,
    channels: Sequence[int] = (32, 64, 128, 256),
) -> ConvNet4:
    """Four 3x3 conv + BN + ReLU (32-256 ch), 3 max-pools, global average pool, Linear to feature_dim + ReLU."""
    return ConvNet4(input_shape, num_classes, _feature_dim("ht_cnn4", feature_dim), channels=channels)


@MODELS.register("ht_mlp")
def ht_mlp(input_shape: Sequence[int], num_classes: int, feature_dim: int = FEATURE_DIM, hidden: int = 1024) -> MLP:
    """MLP on the flattened input: Linear(in, hidden) + ReLU, Linear(hidden, feature_dim) + ReLU."""
    dim = _feature_dim("ht_mlp", feature_dim)
    (width,) = check_positive_ints("ht_mlp", "hidden", hidden, length=1)
    return MLP(input_shape, num_classes, hidden=(width, dim))


# -- the groups ---------------------------------------------------------------------------------------------


def register_group(name: str, members: Sequence[str], help: str) -> None:
    """Register ``members`` (model names, in the order clients are assigned to them) as model group ``name``."""
    chosen = tuple(members)

    def group() -> tuple[str, ...]:
        return chosen

    MODEL_GROUPS.register(name, help)(group)


def group_members(name: str) -> tuple[str, ...]:
    """The members of model group ``name``; client k trains member ``k mod M``. ConfigError listing the groups."""
    return tuple(MODEL_GROUPS.get(name, key="model.group")())


register_group(
    "htfe2", ["ht_fedavgcnn", "ht_resnet18"], "HtFLlib's HtFE-img-2: FedAvgCNN and ResNet-18"
)  # fmt: skip
register_group(
    "htfe3", ["ht_resnet10", "ht_resnet18", "ht_resnet34"], "HtFLlib's HtFE-img-3: ResNet-10, ResNet-18, ResNet-34"
)  # fmt: skip
register_group(
    "resnets5", ["ht_resnet4", "ht_resnet6", "ht_resnet8", "ht_resnet10", "ht_resnet18"],
    "ResNet-4/6/8/10/18, the first five of HtFLlib's HtFE-img-9 (one family, five depths)",
)  # fmt: skip
register_group(
    "mixed8",
    ["ht_fedavgcnn", "ht_cnn4", "ht_mlp", "ht_resnet4", "ht_resnet8", "ht_resnet10", "ht_resnet18", "ht_mobilenet_v2"],
    "Eight architectures of four families: FedAvgCNN, a 4-layer BN CNN, an MLP, ResNet-4/8/10/18, MobileNetV2",
)  # fmt: skip
register_group(
    "mixed4", ["ht_fedavgcnn", "ht_mlp", "ht_resnet4", "ht_resnet8"],
    "Four of mixed8's cheapest on a CPU: FedAvgCNN, the MLP, ResNet-4, ResNet-8",
)  # fmt: skip
