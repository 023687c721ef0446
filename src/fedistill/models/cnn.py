"""Small convolutional classifiers: the FedAvg/FedNTD/FedLMD "CNN" and a tiny CNN for 8x8 digits.

``cnn`` is the two-conv network of McMahan et al. as used by FedNTD and FedLMD (``FedAvgNetMNIST`` /
``FedAvgNetCIFAR`` in their code; spec/experiments-fedlmd.md §3): two 5x5 convolutions with padding 2,
each followed by ReLU and 2x2 max-pooling, a 512-unit fully connected layer with ReLU, and a linear
classifier. No BatchNorm, no dropout, PyTorch's default initialisation. The flatten size is derived from
the input shape, so one class covers both published variants and any other size:

==================  ==========  ==========
input, classes      flatten     parameters
==================  ==========  ==========
1x28x28, 10         64*7*7      1,663,370
3x32x32, 10         64*8*8      2,156,490
3x32x32, 100        64*8*8      2,202,660
==================  ==========  ==========

``digits_cnn`` is a CPU-fast network for 8x8x1 inputs (scikit-learn's embedded digits data set, which
makes the default command work without any download); it is our own choice, not from a paper.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import MODELS
from .base import ClassifierModel, check_min_size, check_positive_ints


def max_pool_2x2(x: torch.Tensor) -> torch.Tensor:
    """``F.max_pool2d(x, 2)``; without autograd on the CPU, pairwise maxima over strided views.

    The forwards that need no gradient (evaluation, the frozen teachers of FedNTD/FedLMD/FedAvg+KD, MOON's
    frozen models, the ensembles of the server-side methods) get the same values, bit for bit (max does not
    round, NaN propagates either way, an odd edge row or column is dropped as ``max_pool2d`` floors). The CPU
    kernel also writes an int64 index per output for a backward that never comes. On an even-sized batch in
    memory order (channels-last or contiguous) the maximum is taken in two passes over contiguous halves: of
    each pair of columns (adjacent in memory), then of each pair of rows; elsewhere of the four strided
    sub-grids. Either way the window is max(max(x00, x01), max(x10, x11)). bf16 channels-last, one thread:
    500x16x28x28 4.0 ms native, 4.3 four sub-grids, 1.25 two passes (benchmarks/RESULTS.md). With autograd
    the native kernel stays: its backward's choice among tied maxima is the one the training results and
    tests rely on, where ``torch.maximum`` would split the gradient of a tie.
    """
    if x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return F.max_pool2d(x, 2)
    if x.dim() == 4 and x.shape[-2] % 2 == 0 and x.shape[-1] % 2 == 0:
        n, c, h, w = x.shape
        if x.is_contiguous(memory_format=torch.channels_last):
            pixels = x.permute(0, 2, 3, 1).reshape(n, h, w // 2, 2 * c)  # a view: (n, h, w, c) in memory
            columns = torch.maximum(pixels[..., :c], pixels[..., c:]).view(n, h // 2, w * c)  # rows 2i, 2i+1 side by side
            rows = torch.maximum(columns[..., : w // 2 * c], columns[..., w // 2 * c :])
            return rows.view(n, h // 2, w // 2, c).permute(0, 3, 1, 2)  # channels-last, as the input
        if x.is_contiguous():
            pixels = x.view(n, c, h, w // 2, 2)
            columns = torch.maximum(pixels[..., 0], pixels[..., 1]).view(n, c, h // 2, w)
            return torch.maximum(columns[..., : w // 2], columns[..., w // 2 :])
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    x = x[..., :h, :w]
    top = torch.maximum(x[..., 0::2, 0::2], x[..., 0::2, 1::2])
    return torch.maximum(top, torch.maximum(x[..., 1::2, 0::2], x[..., 1::2, 1::2]))


class FedAvgNet(ClassifierModel):
    """Two 5x5 conv (pad 2) + ReLU + 2x2 max-pool layers, fc1 + ReLU, linear classifier.

    ``extract`` returns the fc1 output after its ReLU (512-d by default), the feature MOON uses.
    """

    zoo_name = "cnn"  # the name its errors give
    padding = 2  # of both convolutions (HtFLlib's FedAvgCNN, the group member below: 0)

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (32, 64),
        hidden: int = 512,
    ) -> None:
        super().__init__(input_shape, num_classes)
        name, padding = self.zoo_name, self.padding
        c1, c2 = check_positive_ints(name, "channels", channels, length=2)
        (hidden,) = check_positive_ints(name, "hidden", hidden, length=1)
        in_ch, h, w = self.input_shape
        # Two 5x5 convolutions, each followed by a 2x2 pooling with floor rounding; the smallest side that leaves
        # one pixel: 4 with padding 2 (ours), 16 unpadded (HtFLlib's FedAvgCNN: 16 -> 12 -> 6 -> 2 -> 1).
        side = lambda s: ((s + 2 * padding - 4) // 2 + 2 * padding - 4) // 2  # noqa: E731
        check_min_size(name, self.input_shape, 16 - 6 * padding)
        self.conv1 = nn.Conv2d(in_ch, c1, kernel_size=5, padding=padding)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=5, padding=padding)
        self.flat_dim = c2 * side(h) * side(w)
        self.fc1 = nn.Linear(self.flat_dim, hidden)
        self.feature_dim = hidden
        self.classifier = nn.Linear(hidden, self.num_classes)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        # ReLU after the pooling: max(relu(a)) = relu(max(a)) and the gradient reaches the same element, so
        # the outputs and gradients are bit-identical to conv -> ReLU -> pool, with the ReLU on a quarter of
        # the elements (about 9% of a bf16 training step on MNIST; tests/test_models.py checks the identity).
        x = F.relu(max_pool_2x2(self.conv1(x)))
        x = F.relu(max_pool_2x2(self.conv2(x)))
        # flatten works on channels_last tensors too (it copies into the logical NCHW order).
        return F.relu(self.fc1(torch.flatten(x, 1)))


class DigitsCNN(ClassifierModel):
    """Tiny CNN for 8x8 inputs: conv 3x3 (16) + ReLU, conv 3x3 (32) + ReLU, 2x2 max-pool, fc 64 + ReLU.

    38,282 parameters for 1x8x8 inputs and 10 classes; a forward/backward pass of a batch of 64 takes
    well under a millisecond per sample on one CPU core. Any input of at least 2x2 is accepted (the
    flatten size is derived from the shape).
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (16, 32),
        hidden: int = 64,
    ) -> None:
        super().__init__(input_shape, num_classes)
        c1, c2 = check_positive_ints("digits_cnn", "channels", channels, length=2)
        (hidden,) = check_positive_ints("digits_cnn", "hidden", hidden, length=1)
        in_ch, h, w = self.input_shape
        check_min_size("digits_cnn", self.input_shape, 2)
        self.conv1 = nn.Conv2d(in_ch, c1, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=3, padding=1)
        self.flat_dim = c2 * (h // 2) * (w // 2)
        self.fc1 = nn.Linear(self.flat_dim, hidden)
        self.feature_dim = hidden
        self.classifier = nn.Linear(hidden, self.num_classes)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(max_pool_2x2(self.conv2(x)))  # = pool(relu(.)) bit for bit (see FedAvgNet.extract)
        return F.relu(self.fc1(torch.flatten(x, 1)))


@MODELS.register("cnn")
def cnn(
    input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (32, 64), hidden: int = 512
) -> FedAvgNet:
    """FedAvg/FedNTD/FedLMD CNN: 2x (5x5 conv + ReLU + 2x2 max-pool), fc 512 + ReLU, linear classifier."""
    return FedAvgNet(input_shape, num_classes, channels=channels, hidden=hidden)


class FedProtoCNN(FedAvgNet):
    """FedProto's MNIST model, the authors' ``CNNMnist`` (spec/fedproto.md §9): our ``cnn`` with unpadded
    convolutions of 10 and 20 channels and a 50-wide ``fc1`` (the prototype dimension), 21,840 parameters for 10
    classes; its two dropouts are left out."""

    zoo_name = "fedproto_cnn"
    padding = 0


@MODELS.register("fedproto_cnn")
def fedproto_cnn(
    input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (10, 20), hidden: int = 50
) -> FedProtoCNN:
    """FedProto's MNIST CNN: 2x (unpadded 5x5 conv + ReLU + 2x2 max-pool; 10, 20 channels), fc 50 + ReLU, linear."""
    return FedProtoCNN(input_shape, num_classes, channels=channels, hidden=hidden)


@MODELS.register("digits_cnn")
def digits_cnn(
    input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (16, 32), hidden: int = 64
) -> DigitsCNN:
    """Tiny CNN for 8x8 digits: 2x 3x3 conv + ReLU, 2x2 max-pool, fc 64 + ReLU, linear classifier."""
    return DigitsCNN(input_shape, num_classes, channels=channels, hidden=hidden)
