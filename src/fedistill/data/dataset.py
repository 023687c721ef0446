"""The in-memory dataset: one uint8 image tensor per split plus int64 labels.

Every source (official files or the embedded digits) is decoded once into this form; batches are then
taken by index (see :mod:`fedistill.data.pipeline`), so no per-client DataLoader or PIL image exists.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class Dataset:
    """Train and test splits of an image classification dataset held in memory.

    ``train_x``/``test_x`` are uint8 tensors of shape (N, C, H, W); ``train_y``/``test_y`` are int64 (N,).
    ``mean``/``std`` are the per-channel normalisation constants (on the [0, 1] scale) used by the
    papers' pipelines.
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            if x.dtype != torch.uint8 or x.dim() != 4:
                raise ValueError(f"{self.name} {split} images must be uint8 (N, C, H, W), got {x.dtype} {tuple(x.shape)}")
            if y.dtype != torch.int64 or y.shape != (x.shape[0],):
                raise ValueError(f"{self.name} {split} labels must be int64 of length {x.shape[0]}")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"{self.name}: mean/std need one value per channel ({self.channels})")

    @property
    def channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> tuple[int, int]:
        return int(self.train_x.shape[2]), int(self.train_x.shape[3])

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (self.channels, *self.image_size)


SUBSET_SEED = 0  # the training subset is part of the protocol, not of a run's randomness


def train_subset(dataset: Dataset, samples: int | None) -> Dataset:
    """``dataset`` with a fixed random subset of ``samples`` training samples (the test split unchanged).

    Reduced protocols (a claim's 3 seeds within a session's budget) shrink each client's data this way
    instead of changing the partition. The subset is drawn once with :data:`SUBSET_SEED`, so every method
    and every run seed trains on the same images, and kept in the original order (a partition seeded as
    before sees the same kind of input). ``None`` returns the dataset unchanged.
    """
    if samples is None:
        return dataset
    available = int(dataset.train_x.shape[0])
    if samples > available:
        raise ValueError(
            f"dataset.train_samples: {samples} is more than the {available} training samples of {dataset.name}; "
            f"use at most {available} (or leave it out to train on all of them)"
        )
    if samples == available:
        return dataset
    generator = torch.Generator().manual_seed(SUBSET_SEED)
    keep = torch.randperm(available, generator=generator)[:samples].sort().values
    return replace(dataset, train_x=dataset.train_x[keep].contiguous(), train_y=dataset.train_y[keep].contiguous())


def resized(dataset: Dataset, size: int | None, chunk: int = 8192) -> Dataset:
    """``dataset`` with every image bilinearly resized to ``size x size`` (uint8 again, rounded), or unchanged.

    DaFKD's protocol (spec/dafkd.md ambiguity 11) resizes 28x28 datasets to 32x32 so that its 32x32 DCGAN and
    classifier apply unchanged. Done once at load time, in chunks, so batches cost nothing extra. The labels
    and the normalisation constants are those of the original images (a resize keeps channel statistics
    nearly unchanged).
    """
    if size is None or dataset.image_size == (size, size):
        return dataset

    def convert(images: torch.Tensor) -> torch.Tensor:
        out = torch.empty((images.shape[0], images.shape[1], size, size), dtype=torch.uint8)
        for start in range(0, images.shape[0], chunk):
            part = images[start : start + chunk].float()
            scaled = torch.nn.functional.interpolate(part, size=(size, size), mode="bilinear", align_corners=False)
            out[start : start + chunk] = scaled.round_().clamp_(0, 255).to(torch.uint8)
        return out

    return replace(dataset, train_x=convert(dataset.train_x), test_x=convert(dataset.test_x))
