"""The interface every classifier in the model zoo shares.

A classifier is split in two at its penultimate representation:

* ``extract(x)`` maps a batch of inputs to features of shape ``(batch, feature_dim)``
  (the CNN's 512-d fc1 output, a ResNet's pooled vector, an MLP's last hidden layer);
* ``classify(features)`` is the final linear layer (attribute ``classifier``) that turns them into logits.

``forward(x) == classify(extract(x))``. Methods that need the representation (MOON's contrastive term,
FedGen's generator in feature space, feature-level distillation) call the two halves directly instead
of hooking into a model, so any model of the zoo works with them.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch
from torch import nn

from ..errors import ConfigError


class ClassifierModel(nn.Module):
    """Base class: a feature extractor followed by one linear ``classifier``.

    Subclasses build their layers, set ``self.classifier`` (an ``nn.Linear`` from ``feature_dim`` to
    ``num_classes``) and implement :meth:`extract`.
    """

    feature_dim: int
    num_classes: int
    input_shape: tuple[int, int, int]
    classifier: nn.Linear

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.input_shape = check_input_shape(input_shape)
        self.num_classes = check_num_classes(num_classes)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate representation, shape ``(batch, feature_dim)``."""
        raise NotImplementedError

    def classify(self, features: torch.Tensor) -> torch.Tensor:
        """Logits from features, shape ``(batch, num_classes)``."""
        return self.classifier(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.extract(x))

    def num_parameters(self) -> int:
        """Number of parameters (trainable or not; BatchNorm running statistics are buffers, not counted)."""
        return sum(p.numel() for p in self.parameters())


def check_input_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    """Validate a ``(channels, height, width)`` shape and return it as a tuple of ints."""
    try:
        # operator.index accepts ints (and numpy integers) but not floats, strings or bools-as-sizes.
        shape = tuple(int(operator.index(s)) for s in input_shape)
        ok = len(shape) == 3 and all(s >= 1 for s in shape)
        ok = ok and not any(isinstance(s, bool) for s in input_shape)
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(
            "model input_shape must be (channels, height, width) with three positive integers, "
            f"got {input_shape!r}"
        )
    return shape  # type: ignore[return-value]


def check_num_classes(num_classes: int) -> int:
    """Validate the number of classes (a positive integer) and return it as an int."""
    try:
        n = int(operator.index(num_classes))
    except TypeError:
        n = 0
    if isinstance(num_classes, bool) or n < 1:
        raise ConfigError(f"model num_classes must be a positive integer, got {num_classes!r}")
    return n


def check_min_size(name: str, input_shape: tuple[int, int, int], min_size: int) -> None:
    """Raise a ConfigError when the spatial size is below what the model's pooling can take."""
    _, h, w = input_shape
    if h < min_size or w < min_size:
        raise ConfigError(
            f"model {name!r} needs inputs of at least {min_size}x{min_size} pixels, got {h}x{w} "
            f"(input_shape={input_shape})"
        )


def check_positive_ints(name: str, key: str, values: object, length: int | None = None) -> tuple[int, ...]:
    """Validate a kwarg that must be a positive int or a sequence of them (of a given length)."""
    seq = (values,) if isinstance(values, int) and not isinstance(values, bool) else values
    try:
        out = tuple(seq)  # type: ignore[arg-type]
    except TypeError:
        out = ()
        ok = False
    else:
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in out)
    if ok and length is not None:
        ok = len(out) == length
    if not ok:
        what = f"{length} positive integers" if length is not None else "positive integers"
        raise ConfigError(f"model {name!r}: {key} must be {what}, got {values!r}")
    return out
