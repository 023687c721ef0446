"""The tensor data pipeline: normalisation, batched augmentations, batching by index."""

from __future__ import annotations

import torch

from conftest import toy_dataset
from fedistill.data.pipeline import AugmentSpec, TensorPipeline, cutout, random_crop, random_flip


def _dataset(n=20, c=3, h=8, w=8):
    return toy_dataset(n, c, h, w)


def test_normalise_matches_formula():
    ds = _dataset()
    pipe = TensorPipeline(ds)
    expected = (ds.train_x.float() / 255 - 0.5) / 0.25
    assert torch.allclose(pipe.normalise(ds.train_x), expected, atol=1e-5)


def test_random_crop_is_a_shifted_window_of_the_zero_padded_image():
    x = torch.arange(2 * 1 * 5 * 5, dtype=torch.uint8).view(2, 1, 5, 5)
    out = random_crop(x, 2, torch.Generator().manual_seed(3))
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(2):
        matches = [
            (dy, dx) for dy in range(5) for dx in range(5) if torch.equal(padded[i, :, dy : dy + 5, dx : dx + 5], out[i])
        ]
        assert matches, "each crop must be a window of the padded image"


def test_flip_mirrors_about_half_of_the_images():
    x = torch.randint(0, 255, (2000, 1, 4, 4), dtype=torch.uint8)
    out = random_flip(x, torch.Generator().manual_seed(0))
    flipped = (out == x.flip(3)).flatten(1).all(1) & ~(out == x).flatten(1).all(1)
    kept = (out == x).flatten(1).all(1)
    assert bool((flipped | kept).all())
    assert 850 < int(flipped.sum()) < 1150


def test_cutout_zeroes_a_clipped_square():
    x = torch.ones(500, 1, 32, 32)
    out = cutout(x, 16, torch.Generator().manual_seed(0))
    zeros = (out == 0).flatten(1).sum(1)
    assert int(zeros.max()) == 256 and int(zeros.min()) >= 64  # corner centres clip to 8x8
    assert bool(((out == 0) | (out == 1)).all())


def test_batches_cover_the_index_set_once_per_epoch_and_keep_the_last_partial_batch():
    ds = _dataset(n=23)
    pipe = TensorPipeline(ds)
    idx = torch.tensor([1, 4, 5, 9, 11, 12, 13, 20, 22])
    batches = list(pipe.epoch_batches(idx, 4, torch.Generator().manual_seed(1)))
    assert [b[0].shape[0] for b in batches] == [4, 4, 1]
    labels = torch.cat([b[1] for b in batches])
    assert sorted(labels.tolist()) == sorted(ds.train_y[idx].tolist())


def test_sequential_batches_walk_the_indices_in_order_and_drop_the_last_partial_batch():
    """local.batch_order sequential (HtFLlib's DataLoader(shuffle=False, drop_last=True)): 9 indices in batches of
    4 give the first 8 in their order, and the same in every epoch whatever the generator; epoch_columns agrees."""
    ds = _dataset(n=23)
    pipe = TensorPipeline(ds, sequential_batches=True)
    idx = torch.tensor([13, 4, 5, 9, 11, 12, 1, 20, 22])
    for seed in (1, 2):
        batches = list(pipe.epoch_batches(idx, 4, torch.Generator().manual_seed(seed)))
        assert [b[1].tolist() for b in batches] == [ds.train_y[idx[:4]].tolist(), ds.train_y[idx[4:8]].tolist()]
    columns = list(pipe.epoch_columns(idx, 4, torch.Generator().manual_seed(1)))
    assert [c[0].tolist() for c in columns] == [idx[:4].tolist(), idx[4:8].tolist()]
    assert list(pipe.epoch_batches(idx, 10, torch.Generator())) == []  # fewer samples than a batch: no step


def test_augmentation_is_reproducible_from_the_generator():
    ds = _dataset()
    pipe = TensorPipeline(ds, AugmentSpec.from_names(["crop", "flip", "cutout"], cutout=4))
    idx = torch.arange(20)
    a = pipe.train_batch(idx, torch.Generator().manual_seed(5))[0]
    b = pipe.train_batch(idx, torch.Generator().manual_seed(5))[0]
    c = pipe.train_batch(idx, torch.Generator().manual_seed(6))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_channels_last_batches_hold_the_same_values():
    ds = _dataset()
    a = TensorPipeline(ds).normalise(ds.train_x)
    b = TensorPipeline(ds, channels_last=True).normalise(ds.train_x)
    assert b.is_contiguous(memory_format=torch.channels_last) and torch.equal(a, b)
