"""FedProx's Synthetic(alpha, beta): a federation that generates any number of clients from its seed.

Li et al., "Federated Optimization in Heterogeneous Networks" (FedProx, MLSys 2020), §5.1 and Appendix C.1,
after Shamir et al.: 60-dimensional inputs, 10 classes, and for client k

    u_k ~ N(0, alpha),  B_k ~ N(0, beta)                       (one number each)
    W_k ~ N(u_k, 1) (10 x 60),  b_k ~ N(u_k, 1) (10)            (every entry)
    v_k ~ N(B_k, 1) (60),  x ~ N(v_k, Sigma),  Sigma diagonal with Sigma_jj = j^-1.2
    y = argmax softmax(W_k x + b_k)

(``iid: true``, FedProx's Synthetic-IID: one W ~ N(0, 1), b ~ N(0, 1) for every client and x ~ N(0, Sigma))
and client sizes from a power law: the authors' generator draws ``int(lognormal(4, 2)) + 50`` samples per
device. Reading of N(., alpha): the paper writes N(mean, alpha) without saying variance or standard deviation;
the authors' generator passes alpha and beta as numpy's ``scale`` (the standard deviation), and that is the
default here (``spread: std``); ``spread: variance`` takes them as variances. For the paper's settings
(0, 0), (1, 1) both readings agree; (0.5, 0.5) differs.

A property of the definition worth knowing: W_k x + b_k = u_k (1'x + 1) 1 + (Z_W x + Z_b) with
Z ~ N(0, 1), so u_k shifts all ten logits by the same amount and the argmax never sees it. alpha
therefore does not change any client's data; clients differ through the Z draws (always) and through beta,
which moves the inputs' mean and so concentrates each client's labels on fewer classes as it grows. Here
the Z draws do not depend on alpha, so two federations that differ only in alpha have identical data
(tested).

Scale: nothing is materialised per sample up front. Client k's parameters and samples come from its own
random streams (seed, k), so any client can be generated alone, in any order, in any process; the
training split is a lazy view of the concatenated clients (client k owns rows ``offsets[k]:offsets[k+1]``)
that generates a client's rows when a batch first asks for them and keeps the most recent clients in a
small cache. Memory is O(K) integers for the sizes plus the cache; a round costs the generation of its
clients' samples, independent of K. The test split is a held-out set of ``test_samples`` samples,
materialised: each draws its client with probability n_k / N (the pooled distribution, what the union of
FedProx's per-device held-out shares estimates) and its sample from that client's model on a test stream
separate from the training one, and it remembers its client (``test_owners``).

Evaluation. ``partition.per_client_test: true`` gives FedProx's evaluation: client k's test split is the
held-out samples drawn from client k (its own share, in expectation ``test_samples * n_k / N``), and the
personalised accuracy is the mean of the per-client accuracies over the clients that have a held-out
sample (the others are left out). Without it the metric is the global model's accuracy on the whole
held-out set, which is FedProx's pooled accuracy (correct over all devices' test samples). At 100,000
clients 10,000 held-out samples cover a few thousand clients; raise ``test_samples`` for more.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..errors import ConfigError
from .dataset import Dataset

__all__ = ["SyntheticSpec", "SyntheticClients", "LazyRows", "ClientRanges", "SyntheticDataset", "load_synthetic"]

# Purpose tags of the streams (after the run's seed and a tag that keeps them apart from engine streams).
_TAG = 0x5F3D
_PARAMS, _TRAIN, _TEST, _SIZES, _TEST_OWNERS, _SHARED_PARAMS = 0, 1, 2, 3, 4, 5
# Sizes are clipped here before the cast to int64 (a large sigma would overflow); far beyond any use.
_MAX_DRAW = float(1 << 40)
# Rows of generated clients kept in memory (4 bytes x dim each, plus labels): 1M rows of 60 floats ~ 250 MB.
DEFAULT_CACHE_ROWS = 1 << 20


def _key(name: str) -> str:
    return f"dataset.synthetic.{name}"


def _number(name: str, value: Any, low: float, inclusive: bool = True) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        ok = float(value) >= low if inclusive else float(value) > low
    if not ok:
        raise ConfigError(f"{_key(name)} must be a finite number {'>=' if inclusive else '>'} {low}, got {value!r}")
    return float(value)


def _integer(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ConfigError(f"{_key(name)} must be an integer >= {low}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that determines a synthetic federation (same spec, same data, in any process)."""

    num_clients: int
    seed: int = 0
    alpha: float = 1.0
    beta: float = 1.0
    spread: str = "std"
    dim: int = 60
    classes: int = 10
    size_log_mean: float = 4.0
    size_log_sigma: float = 2.0
    min_samples: int = 50
    max_samples: int | None = None
    test_samples: int = 10_000
    iid: bool = False

    def __post_init__(self) -> None:
        _integer("num_clients", self.num_clients, 1)
        _integer("seed", self.seed, 0)
        _number("alpha", self.alpha, 0.0)
        _number("beta", self.beta, 0.0)
        if self.spread not in ("std", "variance"):
            raise ConfigError(f"{_key('spread')} must be std or variance, got {self.spread!r}")
        _integer("dim", self.dim, 1)
        _integer("classes", self.classes, 2)
        _number("size_log_mean", self.size_log_mean, -math.inf)
        _number("size_log_sigma", self.size_log_sigma, 0.0)
        _integer("min_samples", self.min_samples, 1)
        if self.max_samples is not None and _integer("max_samples", self.max_samples, 1) < self.min_samples:
            raise ConfigError(f"{_key('max_samples')} ({self.max_samples}) is below min_samples ({self.min_samples})")
        _integer("test_samples", self.test_samples, 1)

    # -- streams and constants ------------------------------------------------------------------
    def rng(self, purpose: int, *coords: int) -> np.random.Generator:
        """The stream of one purpose (and client): NumPy's SeedSequence over (seed, tag, purpose, coords)."""
        return np.random.default_rng([self.seed, _TAG, purpose, *coords])

    def spread_of(self, value: float) -> float:
        """The standard deviation that alpha or beta stands for under ``spread``."""
        return value if self.spread == "std" else math.sqrt(value)

    def covariance_diagonal(self) -> np.ndarray:
        """Sigma_jj = j^-1.2 for j = 1..dim (float64)."""
        return np.arange(1, self.dim + 1, dtype=np.float64) ** -1.2

    # -- the federation -------------------------------------------------------------------------
    def sizes(self) -> np.ndarray:
        """Training samples per client (int64, length K): ``floor(lognormal(mu, sigma)) + min_samples``,
        capped at ``max_samples``. One stream in client order, so client k's size does not depend on K."""
        draws = self.rng(_SIZES).lognormal(self.size_log_mean, self.size_log_sigma, self.num_clients)
        sizes = np.floor(np.minimum(draws, _MAX_DRAW)).astype(np.int64) + self.min_samples
        if self.max_samples is not None:
            np.minimum(sizes, self.max_samples, out=sizes)
        return sizes

    def client_model(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Client k's ``(W_k, b_k, v_k)``: (classes x dim), (classes,), (dim,), float64. Under ``iid``
        (FedProx's Synthetic-IID) every client has the same W ~ N(0, 1), b ~ N(0, 1) and v = 0."""
        if self.iid:
            rng = self.rng(_SHARED_PARAMS)
            return rng.standard_normal((self.classes, self.dim)), rng.standard_normal(self.classes), np.zeros(self.dim)
        rng = self.rng(_PARAMS, k)
        u = self.spread_of(self.alpha) * rng.standard_normal()
        shift = self.spread_of(self.beta) * rng.standard_normal()  # B_k
        weights = u + rng.standard_normal((self.classes, self.dim))
        bias = u + rng.standard_normal(self.classes)
        mean = shift + rng.standard_normal(self.dim)
        return weights, bias, mean

    def client_samples(self, k: int, n: int, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """``n`` samples of client k from its train (or test) stream: x (n x dim, float32) and y (int64).

        x is rounded to float32 first and the label computed from the rounded x (in float64), so the label
        rule holds exactly for the stored inputs.
        """
        weights, bias, mean = self.client_model(k)
        rng = self.rng(_TRAIN if split == "train" else _TEST, k)
        x = (mean + rng.standard_normal((n, self.dim)) * np.sqrt(self.covariance_diagonal())).astype(np.float32)
        # softmax is monotone, so argmax softmax(z) = argmax z.
        y = np.argmax(x.astype(np.float64) @ weights.T + bias, axis=1).astype(np.int64)
        return x, y

    def test_set(self, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The held-out global test set: x, y and the client each sample came from (sorted by client)."""
        owners = self.rng(_TEST_OWNERS).choice(self.num_clients, size=self.test_samples, p=sizes / sizes.sum())
        clients, counts = np.unique(owners, return_counts=True)
        x = np.empty((self.test_samples, self.dim), dtype=np.float32)
        y = np.empty(self.test_samples, dtype=np.int64)
        pos = 0
        for k, m in zip(clients.tolist(), counts.tolist()):
            x[pos : pos + m], y[pos : pos + m] = self.client_samples(k, m, "test")
            pos += m
        return x, y, np.repeat(clients, counts)


class SyntheticClients:
    """The training rows of every client, generated on demand: client k owns ``offsets[k]:offsets[k+1]``.

    A small least-recently-used cache keeps the clients asked for last (a round's clients are trained one
    after another, each batch asking for rows of one client). Pickles without its cache, so worker
    processes regenerate what they need instead of receiving it.
    """

    def __init__(self, spec: SyntheticSpec, cache_rows: int = DEFAULT_CACHE_ROWS) -> None:
        self.spec = spec
        self.sizes = spec.sizes()
        self.offsets = np.concatenate(([0], np.cumsum(self.sizes))).astype(np.int64)
        self.cache_rows = int(cache_rows)
        self._cache: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._cached_rows = 0
        self._last = (-1, 0, 0)  # (client, first row, end) of the last lookup: a client's batches come in a run
        self._last_rows: torch.Tensor | None = None  # the last batch of one client and its rows in that client
        self._last_local: torch.Tensor | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"], state["_cached_rows"], state["_last"] = OrderedDict(), 0, (-1, 0, 0)
        state["_last_rows"] = state["_last_local"] = None
        return state

    @property
    def num_clients(self) -> int:
        return self.spec.num_clients

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])

    def block(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client k's training inputs (n_k, 1, 1, dim) float32 and labels (n_k,) int64."""
        hit = self._cache.get(k)
        if hit is not None:
            self._cache.move_to_end(k)
            return hit
        x, y = self.spec.client_samples(k, int(self.sizes[k]))
        block = (torch.from_numpy(x).view(-1, 1, 1, self.spec.dim), torch.from_numpy(y))
        self._cache[k] = block
        self._cached_rows += x.shape[0]
        while self._cached_rows > self.cache_rows and len(self._cache) > 1:
            _, (old_x, _) = self._cache.popitem(last=False)
            self._cached_rows -= old_x.shape[0]
        return block

    def client_of(self, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, rows, side="right") - 1

    def gather(self, rows: torch.Tensor, part: int) -> torch.Tensor:
        """Rows (global indices) of the inputs (``part`` 0) or labels (1), in the order asked.

        A training batch asks for its inputs and then its labels with the same index tensor (which nobody
        modifies in place), so the second lookup reuses the first one's client and local rows.
        """
        if rows is self._last_rows:  # the labels of the batch whose inputs were just taken
            return self.block(self._last[0])[part][self._last_local]
        if rows.numel() == 0:
            return self.block(0)[part][:0]
        low, high = (int(v) for v in torch.aminmax(rows))
        k, start, end = self._last
        if not start <= low < end:
            if low < 0 or high >= self.num_rows:
                raise IndexError(f"synthetic rows {low}..{high} outside 0..{self.num_rows - 1}")
            k = int(self.client_of(np.array([low]))[0])
            start, end = int(self.offsets[k]), int(self.offsets[k + 1])
            self._last = (k, start, end)
        if high < end:  # the usual case: a batch of one client
            local = rows - start
            self._last_rows, self._last_local = rows, local
            return self.block(k)[part][local]
        if high >= self.num_rows:
            raise IndexError(f"synthetic rows {low}..{high} outside 0..{self.num_rows - 1}")
        owners = torch.from_numpy(self.client_of(rows.numpy()))
        first = self.block(int(owners[0]))[part]
        out = torch.empty((rows.numel(), *first.shape[1:]), dtype=first.dtype)
        for c in torch.unique(owners).tolist():
            where = owners == c
            out[where] = self.block(c)[part][rows[where] - int(self.offsets[c])]
        return out


class LazyRows:
    """The inputs or the labels of the training split, indexable like a tensor (``rows[index_tensor]``).

    Only what the engine uses of a tensor: indexing by an index tensor, array, list, slice or int,
    ``shape``, ``dtype``, ``dim()``, ``len()``, ``share_memory_()`` (nothing to share: workers regenerate)
    and ``numpy()``, which generates every client (O(N): for statistics of small federations only).
    """

    def __init__(self, clients: SyntheticClients, part: int) -> None:
        self.clients = clients
        self.part = part  # 0 = inputs, 1 = labels

    @property
    def shape(self) -> torch.Size:
        n = self.clients.num_rows
        return torch.Size((n, 1, 1, self.clients.spec.dim) if self.part == 0 else (n,))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.part == 0 else torch.int64

    def dim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.clients.num_rows

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, torch.Tensor) and index.dim() == 1 and index.dtype == torch.int64:
            return self.clients.gather(index, self.part)  # a batch: the hot path
        if isinstance(index, slice):
            rows = torch.arange(*index.indices(len(self)), dtype=torch.int64)
        elif isinstance(index, numbers.Integral):
            row = int(index) + (len(self) if index < 0 else 0)
            return self.clients.gather(torch.tensor([row]), self.part)[0]
        else:
            rows = torch.as_tensor(index if isinstance(index, torch.Tensor) else np.asarray(index)).to(torch.int64)
        return self.clients.gather(rows.reshape(-1), self.part).reshape(*rows.shape, *self.shape[1:])

    def share_memory_(self) -> "LazyRows":
        return self

    def numpy(self) -> np.ndarray:
        return torch.cat([self.clients.block(k)[self.part] for k in range(self.clients.num_clients)]).numpy()

    def tolist(self) -> list:
        return self.numpy().tolist()


class ClientRanges(Sequence[torch.Tensor]):
    """Client k's training indices, ``arange(offsets[k], offsets[k+1])``, made when asked for (no K tensors)."""

    def __init__(self, offsets: np.ndarray) -> None:
        self.offsets = offsets

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = int(k)
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"client {k} outside 0..{len(self) - 1}")
        return torch.arange(int(self.offsets[k]), int(self.offsets[k + 1]), dtype=torch.int64)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[k] for k in range(len(self)))

    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class SyntheticDataset(Dataset):
    """A :class:`Dataset` whose training split is generated per client (``clients``); inputs are float32
    features of shape (1, 1, dim), already on their natural scale (mean 0, std 1: no normalisation)."""

    clients: SyntheticClients | None = None
    test_owners: torch.Tensor | None = None  # the client each held-out sample came from (sorted)

    def __post_init__(self) -> None:
        if self.clients is None:
            raise ValueError("SyntheticDataset needs its clients")
        dim = self.clients.spec.dim
        if self.test_x.dtype != torch.float32 or tuple(self.test_x.shape[1:]) != (1, 1, dim):
            raise ValueError(f"synthetic test inputs must be float32 (N, 1, 1, {dim})")
        if self.test_y.dtype != torch.int64 or self.test_y.shape != (self.test_x.shape[0],):
            raise ValueError("synthetic test labels must be int64, one per input")

    def client_ranges(self) -> ClientRanges:
        """Every client's training indices (the dataset's own, natural partition)."""
        return ClientRanges(self.clients.offsets)

    def client_test_ranges(self) -> ClientRanges:
        """Every client's held-out indices: the test samples drawn from that client (FedProx's per-device
        test share; empty for a client no held-out sample was drawn from). The test set is sorted by
        client, so client k's share is one contiguous range."""
        if self.test_owners is None:
            raise ValueError("this synthetic dataset has no record of its test samples' clients")
        owners = self.test_owners.numpy()
        offsets = np.searchsorted(owners, np.arange(self.clients.num_clients + 1), side="left").astype(np.int64)
        return ClientRanges(offsets)


def load_synthetic(
    root: Any = None,
    download: bool = False,
    verify: bool = True,
    *,
    num_clients: int = 30,
    seed: int = 0,
    alpha: float = 1.0,
    beta: float = 1.0,
    spread: str = "std",
    dim: int = 60,
    classes: int = 10,
    size_log_mean: float = 4.0,
    size_log_sigma: float = 2.0,
    min_samples: int = 50,
    max_samples: int | None = None,
    test_samples: int = 10_000,
    iid: bool = False,
) -> SyntheticDataset:
    """FedProx's Synthetic(alpha, beta), any number of clients, generated from the seed (no files).

    Its clients are its own (``partition.scheme: natural``); ``root``, ``download`` and ``verify`` are
    ignored. See the module docstring for the definition and the test set.
    """
    spec = SyntheticSpec(
        num_clients=num_clients, seed=seed, alpha=alpha, beta=beta, spread=spread, dim=dim, classes=classes,
        size_log_mean=size_log_mean, size_log_sigma=size_log_sigma, min_samples=min_samples,
        max_samples=max_samples, test_samples=test_samples, iid=iid,
    )  # fmt: skip
    clients = SyntheticClients(spec)
    test_x, test_y, owners = spec.test_set(clients.sizes)
    return SyntheticDataset(
        name="synthetic",
        train_x=LazyRows(clients, 0),  # type: ignore[arg-type]
        train_y=LazyRows(clients, 1),  # type: ignore[arg-type]
        test_x=torch.from_numpy(test_x).view(-1, 1, 1, dim),
        test_y=torch.from_numpy(test_y),
        num_classes=classes,
        mean=(0.0,),
        std=(1.0,),
        clients=clients,
        test_owners=torch.from_numpy(owners.astype(np.int64)),
    )
