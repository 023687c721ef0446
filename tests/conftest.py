"""Shared fixtures: a small real dataset (scikit-learn's digits) and tiny configs that run in seconds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedistill.algorithms  # noqa: F401  (registers algorithms)
import fedistill.models  # noqa: F401
from fedistill.config import build_config
from fedistill.data.dataset import Dataset


def _digits() -> Dataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(np.round(d.images * 255 / 16), dtype=torch.uint8)[:, None]
    y = torch.tensor(d.target, dtype=torch.int64)
    return Dataset("digits", x[:1500], y[:1500], x[1500:], y[1500:], 10, (0.3,), (0.4,))


@pytest.fixture(scope="session")
def digits() -> Dataset:
    return _digits()


def small_config(**overrides):
    """A config that trains a few clients for a few rounds on digits in well under a second a round."""
    base = {
        "rounds": 3,
        "clients_per_round": 3,
        "partition": {"scheme": "lda", "num_clients": 6, "alpha": 0.5},
        "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
        "run": {"progress": False, "checkpoint_every": 1},
    }
    return build_config(base, overrides)


@pytest.fixture
def make_config():
    return small_config
