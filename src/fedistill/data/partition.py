"""Splitting a labelled training set among federated clients (label-skew partitions).

Every scheme is a function ``fn(train_labels, num_clients, seed, **params) -> list[np.ndarray]`` registered
in :data:`fedistill.registry.PARTITIONS`; it returns one int64 index array (into the train split) per client.
:func:`make_partition` validates the parameters, dispatches by name and, on request, also splits the test
split so that each client's test set follows its own train class mix (FedICT).

Schemes (the cards in ``spec/`` say what; the comments here say why the code looks the way it does):

==================== ===================================== =========================================
name                 params                                spec
==================== ===================================== =========================================
``iid``              (none)                                uniform random, equal-as-possible sizes
``shards``           ``shards_per_client``                 experiments-fedlmd.md §2 "Sharding"
``lda``              ``alpha``, ``min_size=10``,           experiments-fedlmd.md §2 "LDA / Dirichlet",
                     ``max_retries=None``                  experiments-fedict.md §3, DaFKD (min 100)
``client_dirichlet`` ``alpha``                             experiments-fedftg-dafkd.md §A (FedFTG/FedDyn)
``nway_kshot``       ``ways``, ``shots=100``, ``stdev=2``  spec/fedproto.md §9 (FedProto's MNIST setting)
``natural``          (none)                                the dataset's own clients (synthetic, npz_federation)
==================== ===================================== =========================================

Randomness: a scheme draws everything from ``np.random.default_rng(seed)`` -- one stream per call and never
NumPy's or Python's global state -- so the same labels, client count, seed and parameters always give the
same partition. ``seed`` may also be a ``np.random.Generator``; it is then used (and advanced) in place,
which is how :func:`make_partition` keeps the train and test split on a single stream.

The order of indices inside a client's array carries no meaning (training shuffles anyway).

Length (over the ~500-line guide of ARCHITECTURE.md): every partition scheme is registered here and shares the
size checks and the min-size resampling; each scheme is a section.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError, PartitionError
from ..registry import PARTITIONS

__all__ = [
    "Partition",
    "make_partition",
    "iid",
    "shards",
    "lda",
    "client_dirichlet",
    "natural",
    "class_counts",
    "partition_stats",
    "split_test_like_train",
]


# --------------------------------------------------------------------------------------------------
# Result type
# --------------------------------------------------------------------------------------------------
@dataclass
class Partition:
    """Per-client index sets.

    ``train[k]`` holds the int64 indices (into the train split) of client ``k``; ``test[k]`` its indices
    into the test split when per-client test sets were requested, else ``test`` is ``None``.
    """

    train: list[np.ndarray]
    test: list[np.ndarray] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.train)

    def sizes(self, split: str = "train") -> np.ndarray:
        """Number of samples per client (int64 array of length ``num_clients``) in ``split``."""
        if split == "train":
            parts = self.train
        elif split == "test":
            if self.test is None:
                raise ValueError("this partition has no per-client test sets (use per_client_test=True)")
            parts = self.test
        else:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        return np.array([len(p) for p in parts], dtype=np.int64)


# --------------------------------------------------------------------------------------------------
# Validation helpers (shared by the schemes, so that calling a registered function directly is as safe
# as going through make_partition)
# --------------------------------------------------------------------------------------------------
def _key(name: str) -> str:
    return f"partition.{name}"


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{_key(name)} must be an integer >= {low}, got {value!r}")
    if value < low:
        raise ConfigError(f"{_key(name)} must be an integer >= {low}, got {value}")
    return int(value)


def _check_alpha(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{_key('alpha')} must be a number > 0 (Dirichlet concentration), got {value!r}")
    alpha = float(value)
    if not (alpha > 0.0 and math.isfinite(alpha)):
        raise ConfigError(f"{_key('alpha')} must be a finite number > 0 (Dirichlet concentration), got {value}")
    return alpha


def _rng(seed: Any) -> np.random.Generator:
    # A Generator passes through unchanged (default_rng returns it as is), so make_partition can keep the
    # train and test split on one stream; anything else must be a plain non-negative integer.
    if isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ConfigError(f"{_key('seed')} must be a non-negative integer, got {seed!r}")
    return np.random.default_rng(int(seed))


def _as_labels(labels: Any, what: str = "train labels") -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_common(train_labels: Any, num_clients: Any) -> tuple[np.ndarray, int]:
    labels = _as_labels(train_labels)
    k = _check_int("num_clients", num_clients, 1)
    if k > labels.size:
        raise PartitionError(
            f"cannot split {labels.size} training samples among {k} clients: every client needs at least "
            f"one sample; use at most {labels.size} clients"
        )
    return labels, k


def _group(indices: np.ndarray, owner: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Split ``indices`` by ``owner`` (client id per index; negative = nobody), each client in random order.

    One global permutation followed by a stable sort by owner gives every client a uniformly shuffled list
    without a Python loop of K separate shuffles.
    """
    keep = owner >= 0
    indices, owner = indices[keep], owner[keep]
    perm = rng.permutation(indices.size)
    indices, owner = indices[perm], owner[perm]
    order = np.argsort(owner, kind="stable")
    bounds = np.cumsum(np.bincount(owner, minlength=num_clients))[:-1]
    return [part.astype(np.int64, copy=False) for part in np.split(indices[order], bounds)]


def _class_index_lists(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Sorted distinct labels and, per label, its sample indices in dataset order."""
    classes, inverse = np.unique(labels, return_inverse=True)
    order = np.argsort(inverse, kind="stable")  # stable: dataset order within each class
    bounds = np.cumsum(np.bincount(inverse, minlength=classes.size))[:-1]
    return classes, np.split(order.astype(np.int64), bounds)


# --------------------------------------------------------------------------------------------------
# Schemes
# --------------------------------------------------------------------------------------------------
@PARTITIONS.register("iid")
def iid(train_labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """IID: a uniform random permutation cut into ``num_clients`` pieces whose sizes differ by at most 1.

    The baseline "iid" column of the FedFTG and FedICT tables (experiments-fedftg-dafkd.md §A): labels are
    ignored, so every client's class mix follows the global one up to sampling noise.
    """
    labels, k = _check_common(train_labels, num_clients)
    rng = _rng(seed)
    perm = rng.permutation(labels.size).astype(np.int64)
    # array_split gives the first N mod K clients one extra sample: sizes differ by at most one.
    return list(np.array_split(perm, k))


@PARTITIONS.register("shards")
def shards(train_labels: np.ndarray, num_clients: int, seed: int, *, shards_per_client: int) -> list[np.ndarray]:
    """Label-balanced sharding (experiments-fedlmd.md §2 "Sharding", FedNTD's ``sharding_partition``).

    With ``s = shards_per_client``, K clients and C classes (the distinct labels present):

    1. ``I_c`` = indices of class c in dataset order; ``q = int(s*K/C)`` shards per class.
    2. ``I_c`` is cut into ``q`` contiguous equal shards from its first ``|I_c| - r`` indices
       (``r = |I_c| mod q``); the ``r`` left-over indices go one each to shards ``0..r-1``.
    3. The slot list (each class ``q`` times, ``s*K`` slots) is shuffled and read as K rows of s slots.
    4. Client by client, slot by slot, the client receives a uniformly drawn remaining shard of the slot's
       class. A client may receive two shards of one class, so it holds <= s distinct labels.

    Every sample is used exactly once. CIFAR-10, K = 100: shard sizes 250 (s=2), 166/167 (s=3), 100 (s=5),
    50 (s=10).

    Implementation notes (same distribution as the card, single RNG stream instead of Python ``random`` +
    NumPy): step 4 draws, per class, one random order of its shards up front and hands them out in slot
    order, which is the same as drawing uniformly among the remaining ones at each slot.
    Generalisation beyond the card: when ``s*K`` is not a multiple of C, ``q*C < s*K``; the
    ``s*K - q*C`` missing slots go to that many distinct, randomly chosen classes, which get ``q + 1``
    shards. The card's settings are all divisible, where nothing changes.

    Raises PartitionError when ``s*K > N`` (a shard needs at least one sample), when ``q == 0`` (fewer slots
    than classes: some class could not be given to anyone), or when a class has fewer samples than shards.
    """
    labels, k = _check_common(train_labels, num_clients)
    s = _check_int("shards_per_client", shards_per_client, 1)
    rng = _rng(seed)
    n = labels.size
    total_slots = s * k
    if total_slots > n:
        raise PartitionError(
            f"shards: {k} clients x {s} shards = {total_slots} shards but only {n} samples; every shard "
            f"needs at least one sample -- lower partition.shards_per_client or the number of clients"
        )
    classes, class_idx = _class_index_lists(labels)
    num_classes = classes.size
    q = total_slots // num_classes  # the card's int(s*K/C)
    if q == 0:
        raise PartitionError(
            f"shards: int(shards_per_client * num_clients / num_classes) = int({s}*{k}/{num_classes}) = 0 "
            f"shards per class, so some classes would be given to nobody; raise "
            f"partition.shards_per_client or the number of clients to at least {num_classes} slots in total"
        )
    shards_per_class = np.full(num_classes, q, dtype=np.int64)
    extra = total_slots - q * num_classes
    if extra:
        shards_per_class[rng.choice(num_classes, size=extra, replace=False)] += 1
    class_sizes = np.array([len(ix) for ix in class_idx], dtype=np.int64)
    short = np.flatnonzero(class_sizes < shards_per_class)
    if short.size:
        c = int(short[0])
        raise PartitionError(
            f"shards: class {classes[c]} has {class_sizes[c]} samples but needs {shards_per_class[c]} "
            f"non-empty shards; lower partition.shards_per_client or the number of clients"
        )

    # Step 2: shard j of class c = a contiguous block of size |I_c| // q_c, plus one leftover index for the
    # first r shards. Kept as lists of arrays (cheap views) until the clients are assembled.
    shard_lists: list[list[np.ndarray]] = []
    for idx, qc in zip(class_idx, shards_per_class):
        qc = int(qc)
        base = idx.size // qc
        r = idx.size - base * qc
        body = idx[: base * qc].reshape(qc, base)
        leftovers = idx[base * qc :]
        shard_lists.append(
            [np.concatenate([body[j], leftovers[j : j + 1]]) if j < r else body[j] for j in range(qc)]
        )

    # Step 3: slot labels, shuffled, K rows of s.
    slots = np.repeat(np.arange(num_classes), shards_per_class)
    rng.shuffle(slots)
    slots = slots.reshape(k, s)
    # Step 4: one random order of the shards of each class, consumed in slot order.
    shard_order = [rng.permutation(int(qc)) for qc in shards_per_class]
    next_shard = np.zeros(num_classes, dtype=np.int64)
    parts: list[np.ndarray] = []
    for row in slots:
        pieces = []
        for c in row:
            pieces.append(shard_lists[c][shard_order[c][next_shard[c]]])
            next_shard[c] += 1
        parts.append(np.concatenate(pieces).astype(np.int64, copy=False))
    return parts


# Work budget of the default retry limit, in Dirichlet components drawn (C*K per attempt): about 3e8 is
# 10-20 s of NumPy time, enough for the hardest setting of the papers (CIFAR-10, alpha=0.05, K=100,
# min_size=10 succeeds about once in 25,000 attempts) to fail with probability < 1e-5.
_LDA_DRAW_BUDGET = 300_000_000
# Attempts are simulated together in batches of at most this many Dirichlet components (16 MB of float64).
_LDA_BATCH_ELEMENTS = 1 << 21


def _lda_counts(
    class_sizes: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator, attempts: int
) -> np.ndarray:
    """``attempts`` independent LDA attempts: a B x C x K array of how many samples of class c client k gets.

    The attempts are simulated side by side (vectorised over the first axis) because at small alpha the
    card's settings need tens of thousands of them.
    """
    num_classes = class_sizes.size
    fair_share = class_sizes.sum() / num_clients  # N/K, real division as in the card
    # The Dirichlet vectors do not depend on the cap, so all of them are drawn in one call; the cap is
    # applied afterwards, class by class in label order, exactly as in the card's loop.
    draws = rng.dirichlet(np.full(num_clients, alpha), size=(attempts, num_classes))
    sizes = np.zeros((attempts, num_clients), dtype=np.int64)
    counts = np.empty((attempts, num_classes, num_clients), dtype=np.int64)
    for c in range(num_classes):
        q = draws[:, c, :]
        masked = np.where(sizes < fair_share, q, 0.0)  # clients that already hold N/K get nothing more
        total = masked.sum(axis=1, keepdims=True)
        # If every unfilled client's draw underflowed to exactly 0 (tiny alpha), keep the unmasked draw
        # (experiments-fedict.md §3) rather than divide by zero.
        q = np.where(total > 0, masked / np.where(total > 0, total, 1.0), q / q.sum(axis=1, keepdims=True))
        n_c = int(class_sizes[c])
        cum = np.cumsum(q, axis=1)
        # Dividing by the total makes every entry after the last client with mass exactly 1.0 (x / x), so
        # capped clients at the end get nothing, as in exact arithmetic; a bare float cumsum can end at
        # 0.9999999 and hand one straggler sample to a capped last client.
        cum /= cum[:, -1:]
        cuts = (cum * n_c).astype(np.int64)  # truncation, as the card
        cuts[:, -1] = n_c  # the card drops the last cut: the last client takes the rest
        np.minimum(cuts, n_c, out=cuts)
        counts[:, c, :] = np.diff(cuts, axis=1, prepend=0)
        sizes += counts[:, c, :]
    return counts


@PARTITIONS.register("lda")
def lda(
    train_labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    alpha: float,
    min_size: int = 10,
    max_retries: int | None = None,
) -> list[np.ndarray]:
    """Latent Dirichlet allocation with a fair-share cap (experiments-fedlmd.md §2 "LDA / Dirichlet").

    The ``noniid-labeldir`` partition of MOON/FedML, FedNTD's ``lda_partition`` and FedICT's "hetero"
    (experiments-fedict.md §3); DaFKD uses it with ``min_size=100`` (experiments-fedftg-dafkd.md §B)::

        repeat:
            for each class c (in label order):
                q ~ Dirichlet(alpha * 1_K)
                q_j = 0 for every client j already holding >= N/K samples;  q = q / sum(q)
                split the shuffled indices of class c at (cumsum(q) * |I_c|).astype(int)[:-1]
        until every client holds >= min_size samples      # a retry redraws everything
        shuffle each client's indices

    Sizes and label mixes are both unbalanced; smaller ``alpha`` gives fewer classes per client.

    ``max_retries`` bounds the number of attempts. The default (``None``) allows as many as fit a fixed
    amount of work, ``max(1000, 3e8 // (C*K))`` attempts (300,000 for C=10, K=100; 10-20 s at most): the
    card's hardest setting, CIFAR-10 with alpha=0.05, K=100, min_size=10, succeeds only about once in
    25,000 attempts (the original code simply loops until it does).

    Implementation notes (the accepted partition has the card's distribution): the retries continue the
    same RNG stream; attempts are simulated in vectorised batches (1, 2, 4, ... attempts) and the first
    success in order is taken. A failed attempt only needs the per-client counts, which depend on the
    Dirichlet draws alone, so the class shuffles are drawn once, for the accepted attempt; they are
    independent of the draws. When every client still below N/K drew exactly 0 (underflow at tiny
    alpha) the unmasked draw is used, as experiments-fedict.md §3 prescribes. The cumulative proportions
    are renormalised to end at exactly 1, so float round-off never gives a capped last client a straggler
    sample (the card's arithmetic, which the original float code follows only up to round-off).

    Never loops forever: ``min_size * K > N`` is rejected up front, and when all allowed attempts fail a
    PartitionError says how many failed and suggests what to change.
    """
    labels, k = _check_common(train_labels, num_clients)
    a = _check_alpha(alpha)
    m = _check_int("min_size", min_size, 0)
    rng = _rng(seed)
    n = labels.size
    if m * k > n:
        raise PartitionError(
            f"lda: {k} clients x min_size {m} = {m * k} samples needed but only {n} exist; lower "
            f"partition.min_size (at most {n // k}) or use fewer clients"
        )
    classes, class_idx = _class_index_lists(labels)
    class_sizes = np.array([len(ix) for ix in class_idx], dtype=np.int64)
    per_attempt = classes.size * k
    if max_retries is None:
        retries = max(1000, _LDA_DRAW_BUDGET // per_attempt)
    else:
        retries = _check_int("max_retries", max_retries, 1)

    batch_cap = max(1, _LDA_BATCH_ELEMENTS // per_attempt)
    done, batch, smallest, accepted = 0, 1, -1, None
    while done < retries:
        # Start with a single attempt (most settings succeed at once) and double the batch while failing.
        b = min(batch, batch_cap, retries - done)
        counts = _lda_counts(class_sizes, k, a, rng, b)
        mins = counts.sum(axis=1).min(axis=1)
        ok = np.flatnonzero(mins >= m)
        if ok.size:
            accepted = counts[ok[0]]
            break
        done += b
        smallest = int(mins[-1])
        batch *= 2
    if accepted is None:
        raise PartitionError(
            f"lda: all {retries} attempts left some client with fewer than partition.min_size={m} samples "
            f"(smallest client in the last attempt: {smallest}) for alpha={a}, {k} clients, {n} samples; "
            f"use a larger partition.alpha, fewer clients or a lower partition.min_size "
            f"(or raise partition.max_retries)"
        )

    # Accepted attempt: shuffle each class, cut it by the counts, then shuffle every client's list.
    indices = np.empty(n, dtype=np.int64)
    owner = np.empty(n, dtype=np.int64)
    pos = 0
    for c, idx in enumerate(class_idx):
        indices[pos : pos + idx.size] = rng.permutation(idx)
        owner[pos : pos + idx.size] = np.repeat(np.arange(k), accepted[c])
        pos += idx.size
    return _group(indices, owner, k, rng)


# Steps drawn per batch in client_dirichlet (and client ids per batch of its client order); big enough that
# early batches cover many assignments, small enough that little is thrown away after a class runs out.
_CD_CHUNK = 4096


def _first_limit_hit(groups: np.ndarray, limits: np.ndarray) -> int:
    """Position in ``groups`` of the first step at which some group reaches its limit, or ``groups.size``.

    Group g reaches its limit at its ``limits[g]``-th occurrence; found for all groups at once from a
    stable sort (the occurrences of g appear there in sequence order).
    """
    totals = np.bincount(groups, minlength=limits.size)
    hit = np.flatnonzero(totals >= limits)
    if hit.size == 0:
        return groups.size
    order = np.argsort(groups, kind="stable")
    starts = np.concatenate(([0], np.cumsum(totals)[:-1]))
    return int(order[starts[hit] + limits[hit] - 1].min())


def _client_order(client_sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The clients of the card's steps in order: at every step a uniformly random client that is not yet full.

    Drawing among the non-full clients is drawing among all clients and redrawing a full one, so the
    sequence is a stream of i.i.d. uniform client ids in which every occurrence of client k after its
    ``client_sizes[k]``-th is dropped. That is done in vectorised chunks: the rank of a draw among the
    occurrences of its client comes from one stable sort, and only ranks below the room left are kept.
    """
    num_clients = client_sizes.size
    room = client_sizes.astype(np.int64).copy()
    remaining = int(room.sum())
    pieces: list[np.ndarray] = []
    while remaining > 0:
        open_clients = int(np.count_nonzero(room))
        # About enough draws to fill the clients still open (a draw hits an open one with probability
        # open/K), at least a chunk, at most a few million ids in memory at once.
        size = int(min(max(_CD_CHUNK, remaining * num_clients // open_clients), 1 << 22))
        draws = rng.integers(num_clients, size=size)
        order = np.argsort(draws, kind="stable")
        totals = np.bincount(draws, minlength=num_clients)
        starts = np.cumsum(totals) - totals
        rank = np.empty(size, dtype=np.int64)
        rank[order] = np.arange(size) - starts[draws[order]]
        kept = draws[rank < room[draws]]
        pieces.append(kept)
        room -= np.bincount(kept, minlength=num_clients)
        remaining -= kept.size
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)


def _client_dirichlet_counts(
    class_sizes: np.ndarray, client_sizes: np.ndarray, priors: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """K x C counts of the FedFTG/FedDyn sequential assignment, simulated in batches.

    The card's process assigns one sample per step: a client uniformly among the non-full ones, then a class
    from that client's prior restricted to the classes not yet exhausted (redrawing = renormalising). Which
    client steps when does not depend on the classes, so the whole client order is drawn first
    (:func:`_client_order`). Given that order, the class draws between two exhaustion events are
    independent, each from its client's prior renormalised over the remaining classes; so each batch draws
    the classes of a run of steps at once, keeps the prefix up to and including the first step at which a
    class runs out, and discards the rest. The result has exactly the distribution of the one-at-a-time
    loop; the work is O(N C + K log K) in O(C + N/chunk) batches, never a pass over all clients per event
    (the earlier form rebuilt a K x C table at every client that filled up: 30 s for 10,000 MNIST clients).
    """
    num_clients, num_classes = priors.shape
    sequence = _client_order(client_sizes, rng)
    left = class_sizes.astype(np.int64).copy()
    flat_counts = np.zeros(num_clients * num_classes, dtype=np.int64)
    pos = 0
    while pos < sequence.size:
        open_classes = np.flatnonzero(left > 0)
        # No class can run out before step `safe`, so a batch at least that long is never wasted early on.
        steps = int(min(sequence.size - pos, max(int(left[open_classes].min()), _CD_CHUNK)))
        clients = sequence[pos : pos + steps]
        prior = priors[clients][:, open_classes]
        cdf = np.cumsum(prior, axis=1)
        mass = cdf[:, -1].copy()
        # A client whose prior puts no mass on any remaining class would make the card's redraw loop spin
        # forever (possible when tiny alpha underflows to exact zeros); such a client takes a uniformly
        # chosen remaining class instead.
        dead = mass <= 0
        if dead.any():
            cdf[dead] = np.arange(1, open_classes.size + 1, dtype=cdf.dtype)
            mass[dead] = open_classes.size
        u = rng.random(steps) * mass
        picked = np.minimum((cdf <= u[:, None]).sum(axis=1), open_classes.size - 1)
        first = min(_first_limit_hit(picked, left[open_classes]), steps - 1)
        classes = open_classes[picked[: first + 1]]
        flat_counts += np.bincount(clients[: first + 1] * num_classes + classes, minlength=flat_counts.size)
        left -= np.bincount(classes, minlength=num_classes)
        pos += first + 1
    return flat_counts.reshape(num_clients, num_classes)


@PARTITIONS.register("client_dirichlet")
def client_dirichlet(train_labels: np.ndarray, num_clients: int, seed: int, *, alpha: float) -> list[np.ndarray]:
    """Client-wise Dirichlet with equal client sizes (FedFTG / FedDyn code; experiments-fedftg-dafkd.md §A).

    Each client k draws a class prior ``p_k ~ Dirichlet(alpha * 1_C)`` and gets ``N/K`` samples. Samples are
    assigned one at a time: pick a uniformly random client that is not yet full, draw a class from its prior,
    redraw while that class is exhausted, give the client one (random) remaining sample of that class.
    Sizes are all equal; label mixes follow the priors until classes run out.

    Implementation notes: the sequential process is simulated in batches of i.i.d. steps between events
    (see :func:`_client_dirichlet_counts`); the counts have the distribution of the one-at-a-time loop, and
    which samples of a class a client receives is a uniform random choice as in the (shuffled) original.
    Deviations, both only where the original misbehaves: when K does not divide N the original drops the
    last ``N mod K`` samples; here that many randomly chosen clients get one extra sample, so every sample
    is used (sizes differ by at most one). A client whose prior has no mass left on any remaining class
    (exact zeros from tiny alpha) takes a uniformly random remaining class instead of looping forever.
    """
    labels, k = _check_common(train_labels, num_clients)  # rejects N/K < 1
    a = _check_alpha(alpha)
    rng = _rng(seed)
    n = labels.size
    classes, class_idx = _class_index_lists(labels)
    class_sizes = np.array([len(ix) for ix in class_idx], dtype=np.int64)
    priors = rng.dirichlet(np.full(classes.size, a), size=k)
    client_sizes = np.full(k, n // k, dtype=np.int64)
    if n % k:
        client_sizes[rng.choice(k, size=n % k, replace=False)] += 1
    counts = _client_dirichlet_counts(class_sizes, client_sizes, priors, rng)  # K x C

    indices = np.empty(n, dtype=np.int64)
    owner = np.empty(n, dtype=np.int64)
    pos = 0
    for c, idx in enumerate(class_idx):
        indices[pos : pos + idx.size] = rng.permutation(idx)
        owner[pos : pos + idx.size] = np.repeat(np.arange(k), counts[:, c])
        pos += idx.size
    return _group(indices, owner, k, rng)


@PARTITIONS.register("nway_kshot")
def nway_kshot(train_labels: np.ndarray, num_clients: int, seed: int, *, ways: int, shots: int = 100, stdev: int = 2) -> list[np.ndarray]:
    """FedProto's "n-way k-shot" label skew (spec/fedproto.md §9; the authors' ``mnist_noniid`` and the draws of
    their ``federated_main.py``): client k holds ``n_k`` classes drawn uniformly without replacement, each with
    ``k_k`` samples, every sample held by one client at most (the rest of the training set is unused).

    ``n_k`` is uniform on ``[max(2, ways − stdev), min(C − 1, ways + stdev)]`` (the code's ``randint(max(2, ways −
    stdev), min(C, ways + stdev + 1))``) and ``k_k`` uniform on ``[shots − stdev + 1, shots + stdev − 2]`` (its
    MNIST rule, ``randint(shots − stdev + 1, shots + stdev − 1)``: for shots 100 and stdev 2, 99 or 100).
    Within a class the holders take consecutive blocks of one random order of its samples (the code takes
    windows of a label-sorted index, ``i * 110`` apart).

    Raises ConfigError for a draw range that is empty and PartitionError when a class has fewer samples than its
    holders need.
    """
    labels, k = _check_common(train_labels, num_clients)
    ways = _check_int("ways", ways, 1)
    shots = _check_int("shots", shots, 1)
    stdev = _check_int("stdev", stdev, 0)
    rng = _rng(seed)
    classes, class_idx = _class_index_lists(labels)
    num_classes = classes.size
    ways_low, ways_high = max(2, ways - stdev), min(num_classes - 1, ways + stdev)
    shots_low, shots_high = shots - stdev + 1, shots + stdev - 2
    if ways_low > ways_high:
        raise ConfigError(
            f"{_key('ways')}: n-way draws from [max(2, ways - stdev), min(C - 1, ways + stdev)] = [{ways_low}, "
            f"{ways_high}] with {num_classes} classes, which is empty; lower partition.ways or raise partition.stdev"
        )
    if shots_low > shots_high or shots_low < 1:
        raise ConfigError(
            f"{_key('stdev')}: k-shot draws from [shots - stdev + 1, shots + stdev - 2] = [{shots_low}, {shots_high}] "
            "(FedProto's MNIST rule), which needs stdev >= 2 and shots >= stdev; got "
            f"shots={shots}, stdev={stdev}"
        )
    ways_drawn = rng.integers(ways_low, ways_high + 1, size=k)
    shots_drawn = rng.integers(shots_low, shots_high + 1, size=k)
    held = [np.sort(rng.choice(num_classes, size=int(n), replace=False)) for n in ways_drawn]
    indices = np.empty(labels.size, dtype=np.int64)
    owner = np.full(labels.size, -1, dtype=np.int64)
    pos = 0
    for c, idx in enumerate(class_idx):
        holders = [j for j in range(k) if c in held[j]]
        need = int(sum(shots_drawn[j] for j in holders))
        if need > idx.size:
            raise PartitionError(
                f"nway_kshot: class {classes[c]} has {idx.size} samples but its {len(holders)} holders need {need} "
                f"({shots_low}-{shots_high} each); lower partition.shots or the number of clients"
            )
        indices[pos : pos + idx.size] = rng.permutation(idx)
        owner[pos : pos + need] = np.repeat(np.array(holders, dtype=np.int64), [int(shots_drawn[j]) for j in holders])
        pos += idx.size
    return _group(indices, owner, k, rng)


@PARTITIONS.register("natural")
def natural(train_labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """The dataset's own clients: a dataset that makes its federation (synthetic, npz_federation) is not split by labels.

    The engine takes such a federation from the dataset itself (``engine.federation.build_federation``);
    called on plain labels, there is nothing natural to return.
    """
    raise PartitionError(
        "partition.scheme natural: these labels come from a dataset without clients of its own; only a dataset "
        "that makes its own clients (synthetic, npz_federation) has a natural partition -- use iid, shards, lda or client_dirichlet"
    )


# --------------------------------------------------------------------------------------------------
# Per-client test sets (FedICT)
# --------------------------------------------------------------------------------------------------
def split_test_like_train(
    train_parts: list[np.ndarray],
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Per-client test index sets whose class proportions follow each client's train proportions.

    experiments-fedict.md §3: for each class c, ``Q[c, k]`` is client k's share of class c, the shuffled
    test indices of class c are split at ``floor(cumsum(Q[c]) * |I'_c|)[:-1]``, and every client's list is
    shuffled at the end.

    Deviation: Q is the realised train share ``n_{k,c} / N_c`` rather than the capped Dirichlet draw of the
    attempt that produced the partition (which only exists for ``lda``); the two differ only by the
    truncation of the train cuts, i.e. by less than one sample per class per client. The cuts are computed
    in integers (``cumsum(n_{.,c}) * |I'_c| // N_c``), so a client with no train samples of class c gets no
    test samples of c exactly, without float round-off. Test samples of a class absent from the train split
    go to nobody (no client can be said to hold that class), so then the union is not the whole test set.
    """
    k = len(train_parts)
    train_labels = _as_labels(train_labels)
    test_labels = _as_labels(test_labels, "test labels")
    client_of = np.full(train_labels.size, -1, dtype=np.int64)
    for j, part in enumerate(train_parts):
        client_of[part] = j
    test_classes, test_idx = (
        _class_index_lists(test_labels) if test_labels.size else (np.empty(0, np.int64), [])
    )
    indices = np.empty(test_labels.size, dtype=np.int64)
    owner = np.full(test_labels.size, -1, dtype=np.int64)
    pos = 0
    for c, idx in zip(test_classes, test_idx):
        holders = client_of[train_labels == c]
        holders = holders[holders >= 0]  # samples left out of the train partition do not count
        n_kc = np.bincount(holders, minlength=k)
        n_c = int(n_kc.sum())
        m_c = idx.size
        indices[pos : pos + m_c] = rng.permutation(idx)
        if n_c > 0:
            cuts = np.cumsum(n_kc)[:-1] * m_c // n_c
            owner[pos : pos + m_c] = np.repeat(np.arange(k), np.diff(np.concatenate(([0], cuts, [m_c]))))
        pos += m_c
    return _group(indices, owner, k, rng)


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------
def _scheme_params(fn: Callable) -> tuple[list[str], list[str]]:
    """(accepted, required) keyword parameters of a scheme, read from its signature."""
    accepted, required = [], []
    for name, p in list(inspect.signature(fn).parameters.items())[3:]:
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
            accepted.append(name)
            if p.default is p.empty:
                required.append(name)
    return accepted, required


def make_partition(
    scheme: str,
    train_labels: Any,
    num_clients: int,
    seed: int,
    test_labels: Any = None,
    per_client_test: bool = False,
    **params: Any,
) -> Partition:
    """Build a :class:`Partition` with the registered scheme ``scheme`` (see the module docstring).

    Parameters are validated before anything is drawn: an unknown scheme or parameter, a missing required
    parameter or an out-of-range value raises :class:`~fedistill.errors.ConfigError` naming the
    ``partition.*`` key and the allowed values; a request no partition can satisfy raises
    :class:`~fedistill.errors.PartitionError`.

    With ``per_client_test=True`` the test split (``test_labels``) is divided among the clients as well, so
    that each client's test class mix follows its train class mix (:func:`split_test_like_train`). The train
    split and the test split come from one random stream seeded by ``seed``; the train part is identical to
    calling the scheme function directly with the same seed.
    """
    fn = PARTITIONS.get(scheme, key=_key("scheme"))
    accepted, required = _scheme_params(fn)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        allowed = ", ".join(accepted) if accepted else "none"
        raise ConfigError(
            f"{_key(unknown[0])}: unknown parameter for partition scheme {scheme!r}; accepted parameters: {allowed}"
        )
    missing = [name for name in required if name not in params]
    if missing:
        raise ConfigError(f"{_key(missing[0])} is required for partition scheme {scheme!r}")
    if per_client_test and test_labels is None:
        raise ConfigError(f"{_key('per_client_test')} needs the test labels (test_labels=None was given)")

    rng = _rng(seed)
    train = [np.asarray(p, dtype=np.int64) for p in fn(train_labels, num_clients, rng, **params)]
    test = split_test_like_train(train, train_labels, test_labels, rng) if per_client_test else None
    return Partition(train=train, test=test)


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------
def class_counts(partition_indices: list[np.ndarray], labels: Any, num_classes: int) -> np.ndarray:
    """K x C int64 matrix: entry (k, c) = number of samples of class c held by client k."""
    labels = _as_labels(labels, "labels")
    num_classes = int(num_classes)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{labels.min()}, {labels.max()}]")
    out = np.zeros((len(partition_indices), num_classes), dtype=np.int64)
    for k, part in enumerate(partition_indices):
        out[k] = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
    return out


def partition_stats(counts: Any) -> dict[str, float | int]:
    """Summary of a K x C class-count matrix (plain Python numbers, JSON-ready).

    Keys: ``clients``, ``samples``, ``size_min``, ``size_mean``, ``size_max``, ``size_std`` (population
    std), ``classes_mean``, ``classes_min``, ``classes_max`` (classes present per client),
    ``entropy_mean`` (mean per-client label entropy in nats) and ``dominant_fraction_mean`` (mean share of a
    client's largest class). The last two average over clients that hold at least one sample (0.0 if none
    does), since an empty client has no label distribution.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2:
        raise ValueError(f"counts must be a K x C matrix, got shape {counts.shape}")
    sizes = counts.sum(axis=1)
    present = (counts > 0).sum(axis=1)
    nonempty = counts[sizes > 0].astype(np.float64)
    if nonempty.shape[0]:
        p = nonempty / nonempty.sum(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            plogp = np.where(p > 0, p * np.log(p), 0.0)
        entropy = float((-plogp.sum(axis=1)).mean())
        dominant = float(p.max(axis=1).mean())
    else:
        entropy = dominant = 0.0
    empty = sizes.size == 0
    return {
        "clients": int(counts.shape[0]),
        "samples": int(sizes.sum()),
        "size_min": 0 if empty else int(sizes.min()),
        "size_mean": 0.0 if empty else float(sizes.mean()),
        "size_max": 0 if empty else int(sizes.max()),
        "size_std": 0.0 if empty else float(sizes.std()),
        "classes_mean": 0.0 if empty else float(present.mean()),
        "classes_min": 0 if empty else int(present.min()),
        "classes_max": 0 if empty else int(present.max()),
        "entropy_mean": entropy,
        "dominant_fraction_mean": dominant,
    }
