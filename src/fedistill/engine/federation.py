"""The federation: the dataset and every client's index sets (train, and test for personalised runs), built
from the configured partition, with the views the runtimes and executors read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..config import Config
from ..data.dataset import Dataset
from ..errors import ConfigError


@dataclass
class Federation:
    """The dataset tensors plus every client's index sets (train, and test for personalised runs).

    The index sets are a list of tensors, or, for a dataset that generates its clients (synthetic), a
    sequence that makes client k's indices when asked (:class:`~fedistill.data.synthetic.ClientRanges`):
    nothing here may walk every client per round.
    """

    dataset: Dataset
    train_indices: Sequence[torch.Tensor]
    test_indices: Sequence[torch.Tensor] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.train_indices)

    def client_sizes(self) -> np.ndarray:
        """n_k of every client (int64)."""
        sizes = getattr(self.train_indices, "sizes", None)
        if sizes is not None:
            return np.asarray(sizes(), dtype=np.int64)
        return np.array([int(ix.numel()) for ix in self.train_indices], dtype=np.int64)

    def partition_digest(self) -> str:
        """A fingerprint of the partition (every client's sizes and, where they are stored, its indices): a
        checkpoint keeps it so that a resume refuses to continue on a different partition (e.g. one made by an
        older version of a partition scheme from the same seed)."""
        import hashlib

        digest = hashlib.sha256(np.ascontiguousarray(self.client_sizes()).tobytes())
        if isinstance(self.train_indices, list) and self.train_indices:
            digest.update(torch.cat([ix.to(torch.int64) for ix in self.train_indices]).numpy().tobytes())
        return digest.hexdigest()[:16]

    def train_map(self) -> Mapping[int, torch.Tensor]:
        """Client id -> train indices, as ClientRuntime takes them."""
        return _IndexMap(self.train_indices)

    def test_map(self) -> Mapping[int, torch.Tensor] | None:
        return _IndexMap(self.test_indices) if self.test_indices is not None else None

    def class_counts_of(self, cids: Sequence[int]) -> np.ndarray:
        """len(cids) x C label counts of the clients ``cids`` (a round's clients: cheap at any K)."""
        out = np.zeros((len(cids), self.dataset.num_classes), dtype=np.int64)
        for row, cid in enumerate(cids):
            labels = self.dataset.train_y[self.train_indices[cid]]
            out[row] = np.bincount(np.asarray(labels), minlength=self.dataset.num_classes)
        return out

    def report_counts(self, limit: int = 1_000) -> tuple[np.ndarray, bool]:
        """The label counts a run directory records (partition_counts.csv, partition.png), and whether they
        stop short of the population: a generated federation makes every client's samples to count them
        (0.65 ms per synthetic client: 6.5 s for 10,000, 65 s for 100,000), so past ``limit`` clients only the
        first ``limit`` are counted. Stored partitions are counted whole (one pass over the labels)."""
        if isinstance(self.train_indices, list) or self.num_clients <= limit:
            return self.class_counts(), False
        return self.class_counts_of(range(limit)), True

    def class_counts(self) -> np.ndarray:
        """K x C label counts of every client (O(N); a generated federation generates every client)."""
        if isinstance(self.train_indices, list):  # one pass over the labels
            labels = self.dataset.train_y.numpy()
            num_classes = self.dataset.num_classes
            sizes = self.client_sizes()
            owner = np.repeat(np.arange(self.num_clients), sizes)
            rows = np.concatenate([ix.numpy() for ix in self.train_indices]) if self.num_clients else np.empty(0, np.int64)
            flat = np.bincount(owner * num_classes + labels[rows], minlength=self.num_clients * num_classes)
            return flat.reshape(self.num_clients, num_classes)
        return self.class_counts_of(range(self.num_clients))


class _IndexMap(Mapping[int, torch.Tensor]):
    """A read-only {client id: indices} view of an index sequence (no copy, no K tensors made)."""

    def __init__(self, indices: Sequence[torch.Tensor]) -> None:
        self._indices = indices

    def __getitem__(self, cid: int) -> torch.Tensor:
        if not 0 <= cid < len(self._indices):
            raise KeyError(cid)
        return self._indices[cid]

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._indices)))

    def __len__(self) -> int:
        return len(self._indices)


def build_federation(cfg: Config, dataset: Dataset) -> Federation:
    from ..data.partition import make_partition

    p = cfg.partition
    client_ranges = getattr(dataset, "client_ranges", None)
    if p.scheme == "natural" or client_ranges is not None:
        if client_ranges is None:
            raise ConfigError(f"partition.scheme: natural needs a dataset that makes its own clients; {dataset.name} does not")
        if p.scheme != "natural":
            raise ConfigError(f"partition.scheme: dataset {dataset.name} makes its own clients; use natural, not {p.scheme}")
        ranges = client_ranges()
        if len(ranges) != p.num_clients:
            raise ConfigError(f"partition.num_clients: {p.num_clients}, but dataset {dataset.name} was made with {len(ranges)} clients")
        # per-client test splits of a natural federation: each client's own held-out share (FedProx's evaluation)
        test_ranges = getattr(dataset, "client_test_ranges", None)
        if p.per_client_test and test_ranges is None:
            raise ConfigError(f"partition.per_client_test: dataset {dataset.name} has one held-out global test set (no per-client test splits)")
        return Federation(dataset, ranges, test_ranges() if p.per_client_test else None)
    params: dict[str, Any] = {}
    if p.scheme in ("lda", "client_dirichlet"):
        params["alpha"] = p.alpha
    for key in ("min_size", "max_retries"):
        if getattr(p, key) is not None:  # the config allows them only for lda
            params[key] = getattr(p, key)
    if p.scheme == "shards":
        params["shards_per_client"] = p.shards_per_client
    if p.scheme == "nway_kshot":
        params.update({key: getattr(p, key) for key in ("ways", "shots", "stdev") if getattr(p, key) is not None})
    part = make_partition(
        p.scheme,
        dataset.train_y.numpy(),
        p.num_clients,
        cfg.partition_seed(),
        test_labels=dataset.test_y.numpy(),
        per_client_test=p.per_client_test,
        **params,
    )
    train = [torch.as_tensor(np.asarray(ix), dtype=torch.int64) for ix in part.train]
    test = [torch.as_tensor(np.asarray(ix), dtype=torch.int64) for ix in part.test] if part.test is not None else None
    return Federation(dataset, train, test)



def check_partition(saved: str | None, current: str | None, scheme: str) -> None:
    """Refuse to resume on a partition other than the checkpoint's (same config, different clients' data)."""
    if saved is not None and current is not None and saved != current:
        raise ConfigError(
            "resume: the partition differs from the checkpointed run's (same configuration, other clients' samples: "
            "the data files or fedistill's partition code changed); the rest of the run would not continue it. "
            "Start a new run, or resume with the data and fedistill version that made the checkpoint"
        )
    if saved is None and current is not None and scheme == "client_dirichlet":
        # client_dirichlet's sampler was rewritten after checkpoints began to carry the digest: an older
        # checkpoint of this scheme was made on another partition of the same seed.
        raise ConfigError(
            "resume: this checkpoint predates partition fingerprints, and partition.scheme=client_dirichlet now "
            "draws a different partition from the same seed; start a new run (or resume with the fedistill "
            "version that made the checkpoint)"
        )


