"""Tensor data pipeline: batches by index from the in-memory uint8 tensors, batched augmentation.

No DataLoader, no PIL, no per-sample Python: a batch is ``train_x[indices]`` (one gather), augmented as a
whole with tensor ops driven by the client's seeded ``torch.Generator``, then converted and normalised in
one fused multiply-add. Augmentations follow the papers' pipelines (experiments-fedlmd.md §1):
``RandomCrop(size, padding=4)`` pads with zeros *before* normalisation (like a black PIL border),
``RandomHorizontalFlip(0.5)``, and ``Cutout(16)`` zeroes a square *after* normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .dataset import Dataset

AUGMENTATIONS = ("crop", "flip", "cutout")


@dataclass(frozen=True)
class AugmentSpec:
    crop_padding: int = 0  # 0 disables random crop
    flip: bool = False
    cutout: int = 0  # side of the zeroed square; 0 disables

    @classmethod
    def from_names(cls, names: list[str] | tuple[str, ...], crop_padding: int = 4, cutout: int = 16) -> "AugmentSpec":
        unknown = [n for n in names if n not in AUGMENTATIONS]
        if unknown:
            raise ConfigError(f"dataset.augment: unknown augmentation {unknown[0]!r}; choose from {', '.join(AUGMENTATIONS)}")
        return cls(
            crop_padding=crop_padding if "crop" in names else 0,
            flip="flip" in names,
            cutout=cutout if "cutout" in names else 0,
        )

    @property
    def enabled(self) -> bool:
        return bool(self.crop_padding or self.flip or self.cutout)


def random_crop(x: torch.Tensor, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Zero-pad every image by ``padding`` and cut a random window of the original size from each."""
    n, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    oy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    ox = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    rows = (oy[:, None] + torch.arange(h))[:, None, :, None]
    cols = (ox[:, None] + torch.arange(w))[:, None, None, :]
    batch = torch.arange(n)[:, None, None, None]
    chans = torch.arange(c)[None, :, None, None]
    return padded[batch, chans, rows, cols]


def random_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Mirror each image horizontally with probability 1/2."""
    flip = torch.rand(x.shape[0], generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def cutout(x: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """Zero a ``size`` x ``size`` square (clipped at the border) centred uniformly in each image."""
    n, _, h, w = x.shape
    cy = torch.randint(0, h, (n,), generator=generator)
    cx = torch.randint(0, w, (n,), generator=generator)
    half = size // 2
    ys = torch.arange(h)[None, :]
    xs = torch.arange(w)[None, :]
    in_rows = (ys >= (cy - half)[:, None]) & (ys < (cy + half)[:, None])
    in_cols = (xs >= (cx - half)[:, None]) & (xs < (cx + half)[:, None])
    keep = ~(in_rows[:, :, None] & in_cols[:, None, :])
    return x * keep[:, None, :, :].to(x.dtype)


class TensorPipeline:
    """Batches of a :class:`Dataset` by index, normalised (and augmented for training) as whole tensors."""

    def __init__(
        self,
        dataset: Dataset,
        augment: AugmentSpec = AugmentSpec(),
        device: torch.device | str = "cpu",
        channels_last: bool = False,
    ) -> None:
        self.dataset = dataset
        self.augment = augment
        self.device = torch.device(device)
        self.channels_last = channels_last
        std = torch.tensor(dataset.std, dtype=torch.float32).view(1, -1, 1, 1)
        mean = torch.tensor(dataset.mean, dtype=torch.float32).view(1, -1, 1, 1)
        # x_norm = (x/255 - mean)/std = x * scale + shift: one fused op per batch.
        self._scale = (1.0 / (255.0 * std)).to(self.device)
        self._shift = (-mean / std).to(self.device)

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    def normalise(self, x_uint8: torch.Tensor) -> torch.Tensor:
        x = x_uint8.to(self.device, non_blocking=True).float() * self._scale + self._shift
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def train_batch(self, indices: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (augmented, normalised) and labels of the training samples ``indices``."""
        x = self.dataset.train_x[indices]
        if self.augment.crop_padding:
            x = random_crop(x, self.augment.crop_padding, generator)
        if self.augment.flip:
            x = random_flip(x, generator)
        x = self.normalise(x)
        if self.augment.cutout:
            x = cutout(x, self.augment.cutout, generator)
        return x, self.dataset.train_y[indices].to(self.device, non_blocking=True)

    def epoch_batches(
        self, indices: torch.Tensor, batch_size: int, generator: torch.Generator
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One shuffled pass over ``indices`` in batches of ``batch_size``; the last partial batch is kept."""
        order = indices[torch.randperm(indices.numel(), generator=generator)]
        for start in range(0, order.numel(), batch_size):
            yield self.train_batch(order[start : start + batch_size], generator)

    def test_batches_of(self, indices: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The test samples ``indices`` (a client's own test split) in order, normalised, never augmented."""
        for start in range(0, indices.numel(), batch_size):
            ix = indices[start : start + batch_size]
            yield self.normalise(self.dataset.test_x[ix]), self.dataset.test_y[ix].to(self.device)

    def clean_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training samples ``indices`` normalised but not augmented (an upload's clean view)."""
        return self.normalise(self.dataset.train_x[indices]), self.dataset.train_y[indices].to(self.device)

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The test split in order, normalised batch by batch (no float copy of the whole split is kept)."""
        x, y = self.dataset.test_x, self.dataset.test_y
        for start in range(0, x.shape[0], batch_size):
            yield self.normalise(x[start : start + batch_size]), y[start : start + batch_size].to(self.device)
