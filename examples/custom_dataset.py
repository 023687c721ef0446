"""Example (c): a dataset of your own, registered and run from Python.

"bars": 8x8 grey images of a bar in one of four orientations (horizontal, vertical, two diagonals) at a
random position, with noise, four classes. A dataset is train and test tensors: uint8 images (N, C, H, W),
int64 labels, and the per-channel mean and std used to normalise them. Every partition, method and metric of
fedistill then works on it:

    python examples/custom_dataset.py [--rounds 10] [--out bars]

From the command line: ``fedistill run --plugin examples/custom_dataset.py --dataset bars --model mlp``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import fedistill
from fedistill.data.dataset import Dataset


def _bars(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, 4, (n,), generator=generator)
    offsets = torch.randint(1, 7, (n,), generator=generator)
    images = torch.zeros(n, 8, 8)
    line = torch.arange(8)
    for i, (label, k) in enumerate(zip(labels.tolist(), offsets.tolist())):
        if label == 0:
            images[i, k, :] = 1.0  # horizontal
        elif label == 1:
            images[i, :, k] = 1.0  # vertical
        elif label == 2:
            images[i, line, (line + k) % 8] = 1.0  # diagonal
        else:
            images[i, line, (k - line) % 8] = 1.0  # anti-diagonal
    noisy = (images * 200 + torch.rand(n, 8, 8, generator=generator) * 55).round()
    return noisy.to(torch.uint8).unsqueeze(1), labels


@fedistill.register_dataset("bars", help="8x8 bars in four orientations (examples/custom_dataset.py)")
def load_bars(root, download: bool = False, verify: bool = True, samples: int = 4000) -> Dataset:
    """The loader fedistill calls: ``root``, ``download`` and ``verify`` are for datasets with files (unused
    here); other keyword arguments become ``dataset.options`` (e.g. ``samples``)."""
    generator = torch.Generator().manual_seed(0)
    train_x, train_y = _bars(samples, generator)
    test_x, test_y = _bars(samples // 4, generator)
    mean = float(train_x.float().mean() / 255)
    std = float(train_x.float().std() / 255)
    return Dataset("bars", train_x, train_y, test_x, test_y, num_classes=4, mean=(mean,), std=(std,))


def main(argv: list[str] | None = None) -> fedistill.RunResult:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bars"))
    args = parser.parse_args(argv)
    result = fedistill.run(
        {"dataset": {"name": "bars", "augment": []}, "model": {"name": "mlp"},
         "partition": {"scheme": "lda", "alpha": 0.5, "num_clients": 10}, "clients_per_round": 5},
        rounds=args.rounds, out_dir=str(args.out), name="fedavg-bars", threads=1,
    )  # fmt: skip
    curve = ", ".join(f"{row['test_accuracy']:.1f}" for row in result.history)
    print(f"FedAvg on bars, test accuracy per round: {curve}")
    print(f"run directory: {result.run_dir}")
    return result


if __name__ == "__main__":
    main()
