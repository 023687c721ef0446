"""Multilayer perceptron: McMahan et al.'s "2NN" (two hidden layers of 200 units with ReLU) by default.

The input of any shape is flattened, so the same model takes 1x28x28 MNIST images, 1x8x8 digits or
3x32x32 colour images. ``hidden=()`` gives multinomial logistic regression (features = the flat input).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..registry import MODELS
from .base import ClassifierModel, check_positive_ints


class MLP(ClassifierModel):
    """Flatten, then ``Linear + ReLU`` for every width in ``hidden``, then a linear classifier.

    ``extract`` returns the last hidden layer's activations (after ReLU).
    """

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (200, 200)
    ) -> None:
        super().__init__(input_shape, num_classes)
        widths = check_positive_ints("mlp", "hidden", hidden)
        in_dim = math.prod(self.input_shape)
        layers: list[nn.Module] = []
        for width in widths:
            layers += [nn.Linear(in_dim, width), nn.ReLU()]
            in_dim = width
        self.features = nn.Sequential(*layers)
        self.hidden = widths
        self.feature_dim = in_dim
        self.classifier = nn.Linear(in_dim, self.num_classes)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(torch.flatten(x, 1))


@MODELS.register("mlp")
def mlp(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (200, 200)) -> MLP:
    """MLP on the flattened input, hidden=(200, 200) by default (McMahan et al.'s 2NN)."""
    return MLP(input_shape, num_classes, hidden=hidden)


@MODELS.register("logistic")
def logistic(input_shape: Sequence[int], num_classes: int) -> MLP:
    """Multinomial logistic regression on the flattened input (FedProx's synthetic model): mlp with hidden=()."""
    return MLP(input_shape, num_classes, hidden=())
