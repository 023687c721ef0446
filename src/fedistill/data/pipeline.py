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
    n = x.shape[0]
    oy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    ox = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    return crop_at(x, padding, oy.to(x.device), ox.to(x.device))


def crop_at(x: torch.Tensor, padding: int, oy: torch.Tensor, ox: torch.Tensor) -> torch.Tensor:
    """The crop of :func:`random_crop` at given window offsets (``oy``, ``ox`` on ``x``'s device)."""
    n, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    device = x.device
    rows = (oy[:, None] + torch.arange(h, device=device))[:, None, :, None]
    cols = (ox[:, None] + torch.arange(w, device=device))[:, None, None, :]
    batch = torch.arange(n, device=device)[:, None, None, None]
    chans = torch.arange(c, device=device)[None, :, None, None]
    return padded[batch, chans, rows, cols]


def random_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Mirror each image horizontally with probability 1/2."""
    flip = torch.rand(x.shape[0], generator=generator) < 0.5
    return flip_where(x, flip.to(x.device))


def flip_where(x: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Mirror the images whose ``flip`` is true."""
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def cutout(x: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """Zero a ``size`` x ``size`` square (clipped at the border) centred uniformly in each image."""
    n, _, h, w = x.shape
    cy = torch.randint(0, h, (n,), generator=generator)
    cx = torch.randint(0, w, (n,), generator=generator)
    return cutout_at(x, size, cy.to(x.device), cx.to(x.device))


def cutout_at(x: torch.Tensor, size: int, cy: torch.Tensor, cx: torch.Tensor) -> torch.Tensor:
    """The cutout of :func:`cutout` at given square centres (on ``x``'s device)."""
    _, _, h, w = x.shape
    half = size // 2
    ys = torch.arange(h, device=x.device)[None, :]
    xs = torch.arange(w, device=x.device)[None, :]
    in_rows = (ys >= (cy - half)[:, None]) & (ys < (cy + half)[:, None])
    in_cols = (xs >= (cx - half)[:, None]) & (xs < (cx + half)[:, None])
    keep = ~(in_rows[:, :, None] & in_cols[:, None, :])
    return x * keep[:, None, :, :].to(x.dtype)


class TensorPipeline:
    """Batches of a :class:`Dataset` by index, normalised (and augmented for training) as whole tensors.

    On an accelerator (``device`` not the CPU) the uint8 images and the labels are copied to the device once,
    and an epoch's shuffled order and every random draw of its augmentation are made on the host at the
    epoch's start (in the order the CPU path draws them: per batch crop offsets, flip coins, cutout centres)
    and sent in one copy: a training step then gathers, augments and normalises on the device without any
    host-device transfer or synchronisation.
    """

    def __init__(
        self,
        dataset: Dataset,
        augment: AugmentSpec = AugmentSpec(),
        device: torch.device | str = "cpu",
        channels_last: bool = False,
        sequential_batches: bool = False,
    ) -> None:
        self.dataset = dataset
        # local.batch_order "sequential": epochs walk the indices in their order and drop the last partial batch
        self.sequential_batches = sequential_batches
        self.augment = augment
        self.device = torch.device(device)
        self.channels_last = channels_last
        std = torch.tensor(dataset.std, dtype=torch.float32).view(1, -1, 1, 1)
        mean = torch.tensor(dataset.mean, dtype=torch.float32).view(1, -1, 1, 1)
        # x_norm = (x/255 - mean)/std = x * scale + shift: one fused op per batch. Float inputs (the synthetic
        # dataset's features) are on their own scale already, not 0..255.
        full_scale = 255.0 if dataset.test_x.dtype == torch.uint8 else 1.0
        self._scale = (1.0 / (full_scale * std)).to(self.device)
        self._shift = (-mean / std).to(self.device)
        self.on_host = self.device.type == "cpu"
        if self.on_host:
            self._train_x, self._train_y = dataset.train_x, dataset.train_y
            self._test_x, self._test_y = dataset.test_x, dataset.test_y
        else:  # uint8 on the device: CIFAR-10's 50,000 training images are 154 MB
            self._train_x, self._train_y = dataset.train_x.to(self.device), dataset.train_y.to(self.device)
            self._test_x, self._test_y = dataset.test_x.to(self.device), dataset.test_y.to(self.device)

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.on_host or t.device == self.device:
            return t
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t.to(self.device)

    def normalise(self, x_uint8: torch.Tensor) -> torch.Tensor:
        x = x_uint8.to(self.device, non_blocking=True).float() * self._scale + self._shift
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def train_batch(self, indices: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (augmented, normalised) and labels of the training samples ``indices``."""
        indices = self._to_device(indices)
        x = self._train_x[indices]
        if self.augment.crop_padding:
            x = random_crop(x, self.augment.crop_padding, generator)
        if self.augment.flip:
            x = random_flip(x, generator)
        x = self.normalise(x)
        if self.augment.cutout:
            x = cutout(x, self.augment.cutout, generator)
        return x, self._train_y[indices]

    def epoch_batches(
        self, indices: torch.Tensor, batch_size: int, generator: torch.Generator
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One shuffled pass over ``indices`` in batches of ``batch_size``; the last partial batch is kept (with
        ``sequential_batches``: the indices in their order, the last partial batch dropped)."""
        if self.on_host:
            order, stop = self.epoch_order(indices, batch_size, generator)
            for start in range(0, stop, batch_size):
                yield self.train_batch(order[start : start + batch_size], generator)
            return
        # On an accelerator the epoch's indices and augmentation draws go over in one copy (epoch_columns).
        for cols in self.epoch_columns(indices, batch_size, generator):
            yield self.batch_from_columns(cols)

    def epoch_order(self, indices: torch.Tensor, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
        """An epoch's sample order and where its batches stop: a permutation drawn from ``generator`` and the end
        (shuffled), or the indices as they are and the end of the last full batch (sequential)."""
        if self.sequential_batches:
            return indices, (indices.numel() // batch_size) * batch_size
        return indices[torch.randperm(indices.numel(), generator=generator)], indices.numel()

    def epoch_columns(self, indices: torch.Tensor, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
        """:meth:`epoch_batches` as index batches: per batch a ``(rows, m)`` tensor on the pipeline's device holding
        the sample indices and every random draw of their augmentation (drawn in the CPU path's order, so the same
        numbers), which :meth:`batch_from_columns` turns into the same ``(x, y)``. A captured CUDA graph takes the
        columns as its one input and gathers, augments and normalises inside (engine/cuda_graphs.py)."""
        order, stop = self.epoch_order(indices, batch_size, generator)
        order = order[:stop]
        aug = self.augment
        h, w = self._train_x.shape[2], self._train_x.shape[3]
        rows: list[list[torch.Tensor]] = [[order]]  # row 0: the order; then one row per random quantity
        for start in range(0, order.numel(), batch_size):
            m = min(batch_size, order.numel() - start)
            draws: list[torch.Tensor] = []
            if aug.crop_padding:
                draws += [torch.randint(0, 2 * aug.crop_padding + 1, (m,), generator=generator) for _ in range(2)]
            if aug.flip:
                draws.append((torch.rand(m, generator=generator) < 0.5).long())
            if aug.cutout:
                draws += [torch.randint(0, h, (m,), generator=generator), torch.randint(0, w, (m,), generator=generator)]
            for j, d in enumerate(draws, start=1):
                if len(rows) <= j:
                    rows.append([])
                rows[j].append(d)
        table = self._to_device(torch.stack([torch.cat(r).long() for r in rows]))  # the epoch's one copy
        for start in range(0, order.numel(), batch_size):
            yield table[:, start : start + batch_size]

    def batch_from_columns(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training batch of one :meth:`epoch_columns` entry: gathered, augmented, normalised, on the device."""
        aug = self.augment
        ix, j = cols[0], 1
        x = self._train_x[ix]
        if aug.crop_padding:
            x, j = crop_at(x, aug.crop_padding, cols[j], cols[j + 1]), j + 2
        if aug.flip:
            x, j = flip_where(x, cols[j].bool()), j + 1
        x = self.normalise(x)
        if aug.cutout:
            x = cutout_at(x, aug.cutout, cols[j], cols[j + 1])
        return x, self._train_y[ix]

    def test_batches_of(self, indices: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The test samples ``indices`` (a client's own test split) in order, normalised, never augmented."""
        indices = self._to_device(indices)
        for start in range(0, indices.numel(), batch_size):
            ix = indices[start : start + batch_size]
            yield self.normalise(self._test_x[ix]), self._test_y[ix].to(self.device)

    def clean_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training samples ``indices`` normalised but not augmented (an upload's clean view)."""
        indices = self._to_device(indices)
        return self.normalise(self._train_x[indices]), self._train_y[indices].to(self.device)

    @property
    def test_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The test images (uint8 or float, as stored) and labels every test batch is cut from, on the pipeline's
        device for a GPU run: a captured evaluation (engine/cuda_graphs.py) keys on their addresses."""
        return self._test_x, self._test_y

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The test split in order, normalised batch by batch (no float copy of the whole split is kept)."""
        x, y = self._test_x, self._test_y
        for start in range(0, x.shape[0], batch_size):
            yield self.normalise(x[start : start + batch_size]), y[start : start + batch_size].to(self.device)
