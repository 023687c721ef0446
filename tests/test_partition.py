"""Invariants of the partition schemes (fedistill.data.partition).

Checked for every scheme: disjoint and complete index sets, the scheme's size law, determinism by seed,
and clear errors (PartitionError for impossible requests, ConfigError naming the key for bad values).
Scheme-specific checks follow the cards: shard sizes and <= s labels (experiments-fedlmd.md §2), the LDA cap
and min size (same section), equal sizes and the sequential-assignment law of the FedFTG client-wise
Dirichlet (experiments-fedftg-dafkd.md §A), and per-client test sets that follow the train class mix
(experiments-fedict.md §3).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedistill.data.partition as partition_module
from fedistill.data.partition import (
    Partition,
    class_counts,
    client_dirichlet,
    iid,
    lda,
    make_partition,
    partition_stats,
    shards,
)
from fedistill.errors import ConfigError, PartitionError
from fedistill.registry import PARTITIONS

# derandomize: the same examples on every run, so CI cannot fail on a draw a developer never saw.
PROPERTY = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

SCHEME_PARAMS = {
    "iid": {},
    "shards": {"shards_per_client": 2},
    "lda": {"alpha": 0.5, "min_size": 5},
    "client_dirichlet": {"alpha": 0.5},
}


def cifar_like(per_class: int = 5000, num_classes: int = 10, interleaved: bool = True) -> np.ndarray:
    """Synthetic label vector with ``per_class`` samples of each class (interleaved like a shuffled set)."""
    if interleaved:
        return np.tile(np.arange(num_classes), per_class).astype(np.int64)
    return np.repeat(np.arange(num_classes), per_class).astype(np.int64)


def random_labels(n: int, num_classes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, num_classes, size=n).astype(np.int64)


def assert_disjoint_complete(parts: list[np.ndarray], n: int) -> None:
    assert all(p.dtype == np.int64 and p.ndim == 1 for p in parts)
    allidx = np.concatenate(parts) if parts else np.empty(0, np.int64)
    assert allidx.size == n, "every index exactly once: total size"
    assert np.array_equal(np.sort(allidx), np.arange(n)), "union == all indices, no duplicates"


def same_parts(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------------------------------
# Registry, dataclass, entry point
# --------------------------------------------------------------------------------------------------
def test_registered_schemes():
    assert {"iid", "shards", "lda", "client_dirichlet"} <= set(PARTITIONS.names())
    for name in ("iid", "shards", "lda", "client_dirichlet"):
        assert PARTITIONS.describe(name)


def test_partition_dataclass_helpers():
    p = Partition(train=[np.array([0, 1, 2]), np.array([3])])
    assert p.num_clients == 2
    assert p.sizes().tolist() == [3, 1]
    assert p.test is None
    with pytest.raises(ValueError):
        p.sizes("test")
    q = Partition(train=p.train, test=[np.array([0]), np.array([], dtype=np.int64)])
    assert q.sizes("test").tolist() == [1, 0]


@pytest.mark.parametrize("scheme", sorted(SCHEME_PARAMS))
def test_make_partition_matches_direct_call(scheme):
    labels = random_labels(600, 6, seed=1)
    params = SCHEME_PARAMS[scheme]
    direct = PARTITIONS.get(scheme)(labels, 10, 7, **params)
    via = make_partition(scheme, labels, 10, 7, **params)
    assert isinstance(via, Partition) and via.test is None
    assert same_parts(direct, via.train)


@pytest.mark.parametrize("scheme", sorted(SCHEME_PARAMS))
def test_every_scheme_disjoint_complete_deterministic(scheme):
    labels = random_labels(1000, 5, seed=2)
    params = SCHEME_PARAMS[scheme]
    a = make_partition(scheme, labels, 10, 123, **params).train
    b = make_partition(scheme, labels, 10, 123, **params).train
    c = make_partition(scheme, labels, 10, 124, **params).train
    assert len(a) == 10
    assert_disjoint_complete(a, labels.size)
    assert same_parts(a, b), "same seed -> identical partition"
    assert not same_parts(a, c), "different seed -> different partition"


@pytest.mark.parametrize("scheme", sorted(SCHEME_PARAMS))
def test_no_global_rng_state_used(scheme):
    labels = random_labels(500, 5, seed=3)
    params = SCHEME_PARAMS[scheme]
    np.random.seed(0)
    state = np.random.get_state()[1].copy()
    a = make_partition(scheme, labels, 5, 11, **params).train
    assert np.array_equal(np.random.get_state()[1], state), "global NumPy RNG must not be touched"
    np.random.seed(999)
    b = make_partition(scheme, labels, 5, 11, **params).train
    assert same_parts(a, b)


@pytest.mark.parametrize("scheme", sorted(SCHEME_PARAMS))
def test_more_clients_than_samples_fails(scheme):
    labels = np.array([0, 1, 0, 1, 2], dtype=np.int64)
    params = dict(SCHEME_PARAMS[scheme])
    if scheme == "lda":
        params["min_size"] = 0
    with pytest.raises(PartitionError, match="6 clients"):
        make_partition(scheme, labels, 6, 0, **params)


def test_unknown_scheme_names_key_and_choices():
    with pytest.raises(ConfigError, match=r"partition\.scheme.*client_dirichlet.*iid.*lda.*shards"):
        make_partition("dirichlet_typo", np.zeros(10, np.int64), 2, 0)


@pytest.mark.parametrize(
    "scheme, params, key",
    [
        ("lda", {"alpha": 0.0}, "partition.alpha"),
        ("lda", {"alpha": -1.0}, "partition.alpha"),
        ("lda", {"alpha": float("nan")}, "partition.alpha"),
        ("lda", {"alpha": 1.0, "min_size": -1}, "partition.min_size"),
        ("lda", {"alpha": 1.0, "max_retries": 0}, "partition.max_retries"),
        ("client_dirichlet", {"alpha": 0}, "partition.alpha"),
        ("client_dirichlet", {"alpha": "0.5"}, "partition.alpha"),
        ("shards", {"shards_per_client": 0}, "partition.shards_per_client"),
        ("shards", {"shards_per_client": 1.5}, "partition.shards_per_client"),
    ],
)
def test_bad_values_raise_config_error_naming_key(scheme, params, key):
    labels = random_labels(200, 4, seed=0)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        make_partition(scheme, labels, 4, 0, **params)
    assert ">" in str(info.value), "the message states the allowed range"


def test_bad_num_clients_and_seed():
    labels = random_labels(50, 3, seed=0)
    for k in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match=r"partition\.num_clients"):
            make_partition("iid", labels, k, 0)
    with pytest.raises(ConfigError, match=r"partition\.seed"):
        make_partition("iid", labels, 2, -1)


def test_unknown_and_missing_params():
    labels = random_labels(100, 4, seed=0)
    with pytest.raises(ConfigError, match=r"partition\.beta.*accepted parameters: alpha, min_size, max_retries"):
        make_partition("lda", labels, 4, 0, alpha=1.0, beta=2.0)
    with pytest.raises(ConfigError, match=r"partition\.alpha.*accepted parameters: none"):
        make_partition("iid", labels, 4, 0, alpha=1.0)
    with pytest.raises(ConfigError, match=r"partition\.alpha.*required"):
        make_partition("client_dirichlet", labels, 4, 0)
    with pytest.raises(ConfigError, match=r"partition\.shards_per_client.*required"):
        make_partition("shards", labels, 4, 0)
    with pytest.raises(ConfigError, match=r"partition\.per_client_test"):
        make_partition("iid", labels, 4, 0, per_client_test=True)


def test_labels_must_be_integer_vector():
    with pytest.raises(ValueError):
        iid(np.zeros((4, 2), dtype=np.int64), 2, 0)
    with pytest.raises(ValueError):
        iid(np.array([0.0, 1.0, 2.0]), 2, 0)


# --------------------------------------------------------------------------------------------------
# iid
# --------------------------------------------------------------------------------------------------
@PROPERTY
@given(n=st.integers(1, 500), k=st.integers(1, 60), seed=st.integers(0, 2**32 - 1))
def test_iid_sizes_differ_by_at_most_one(n, k, seed):
    k = min(k, n)
    parts = iid(np.zeros(n, dtype=np.int64), k, seed)
    assert len(parts) == k
    assert_disjoint_complete(parts, n)
    sizes = np.array([len(p) for p in parts])
    assert sizes.max() - sizes.min() <= 1


# --------------------------------------------------------------------------------------------------
# shards (experiments-fedlmd.md §2)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("s, shard_sizes", [(2, {250}), (3, {166, 167}), (5, {100}), (10, {50})])
def test_shards_cifar10_shard_sizes(s, shard_sizes):
    labels = cifar_like(5000, 10)
    parts = shards(labels, 100, 19940817, shards_per_client=s)
    assert_disjoint_complete(parts, labels.size)
    q = int(s * 100 / 10)
    lo, hi = min(shard_sizes), max(shard_sizes)
    counts = class_counts(parts, labels, 10)
    assert ((counts > 0).sum(axis=1) <= s).all(), "at most s distinct labels per client"
    # Each client holds s shards: its size lies between s*smallest and s*largest shard.
    sizes = counts.sum(axis=1)
    assert sizes.min() >= s * lo and sizes.max() <= s * hi
    # Per (client, class): a sum of j whole shards of that class, 1 <= j <= s.
    for count in counts[counts > 0]:
        assert any(j * lo <= count <= j * hi for j in range(1, s + 1)), count
    # Every class is cut into exactly q shards, each handed out once.
    if lo == hi:
        assert (counts.sum(axis=0) // lo == q).all()
        assert (counts % lo == 0).all()


def test_shards_cifar10_s3_shard_multiset():
    # 5000 = 30 * 166 + 20: 20 shards of 167 and 10 of 166 per class. With the class-sorted label vector
    # each shard is a contiguous run of the class's indices, so each client's run lengths are its shards.
    labels = cifar_like(5000, 10, interleaved=False)
    parts = shards(labels, 100, 0, shards_per_client=3)
    assert_disjoint_complete(parts, labels.size)
    found = {c: [] for c in range(10)}
    class_start = np.arange(10) * 5000
    for p in parts:
        for c in np.unique(labels[p]):
            ranks = np.sort(p[labels[p] == c]) - class_start[c]  # position within I_c
            # Split into runs of consecutive ranks, allowing a leftover index (rank >= 4980) appended to a
            # shard: the 20 leftovers of I_c (ranks 4980..4999) go one each to shards 0..19.
            body, extra = ranks[ranks < 4980], ranks[ranks >= 4980]
            runs = np.split(body, np.flatnonzero(np.diff(body) != 1) + 1)
            for run in runs:
                if run.size == 0:
                    continue
                # a run may merge two adjacent shards of the same client; split by shard boundaries of 166
                starts = np.arange(run[0] - run[0] % 166, run[-1] + 1, 166)
                for st0 in starts:
                    piece = run[(run >= st0) & (run < st0 + 166)]
                    assert piece.size == 166 and piece[0] % 166 == 0, "shards are contiguous blocks"
                    j = piece[0] // 166
                    has_leftover = 4980 + j in set(extra.tolist())
                    assert has_leftover == (j < 20), "left-over index k goes to shard k"
                    found[int(c)].append(166 + int(has_leftover))
    for c in range(10):
        assert sorted(found[c]) == [166] * 10 + [167] * 20


@pytest.mark.parametrize("num_classes, per_class, s, size", [(100, 500, 10, 50)])
def test_shards_cifar100(num_classes, per_class, s, size):
    labels = cifar_like(per_class, num_classes)
    parts = shards(labels, 100, 1, shards_per_client=s)
    assert_disjoint_complete(parts, labels.size)
    counts = class_counts(parts, labels, num_classes)
    assert (counts % size == 0).all() and ((counts > 0).sum(axis=1) <= s).all()


def test_shards_impossible_requests():
    labels = cifar_like(10, 10)  # N = 100
    with pytest.raises(PartitionError, match="only 100 samples"):
        shards(labels, 60, 0, shards_per_client=2)  # 120 shards > 100 samples
    with pytest.raises(PartitionError, match="= 0"):
        shards(labels, 4, 0, shards_per_client=2)  # int(8/10) == 0 shards per class
    skewed = np.array([0] * 97 + [1] * 3, dtype=np.int64)
    with pytest.raises(PartitionError, match="class 1"):
        shards(skewed, 5, 0, shards_per_client=2)  # class 1 has 3 samples for 5 shards


@PROPERTY
@given(
    labels=st.lists(st.integers(0, 5), min_size=1, max_size=300),
    k=st.integers(1, 30),
    s=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_shards_property(labels, k, s, seed):
    y = np.array(labels, dtype=np.int64)
    try:
        parts = shards(y, k, seed, shards_per_client=s)
    except PartitionError:
        num_classes = np.unique(y).size
        q = s * k // num_classes
        need = q + (1 if s * k > q * num_classes else 0)  # shards of the classes that get the most
        per_class = np.bincount(y)[np.unique(y)]
        assert s * k > y.size or q == 0 or (per_class < need).any()
        return
    assert len(parts) == k
    assert_disjoint_complete(parts, y.size)
    for p in parts:
        assert 1 <= np.unique(y[p]).size <= s
    assert same_parts(parts, shards(y, k, seed, shards_per_client=s))


def test_shards_non_divisible_slots_use_every_sample():
    labels = cifar_like(30, 10)  # s*K = 14 slots for 10 classes: q = 1, 4 classes get a second shard
    parts = shards(labels, 7, 5, shards_per_client=2)
    assert_disjoint_complete(parts, labels.size)
    counts = class_counts(parts, labels, 10)
    assert ((counts > 0).sum(axis=1) <= 2).all()


# --------------------------------------------------------------------------------------------------
# lda (experiments-fedlmd.md §2, experiments-fedict.md §3)
# --------------------------------------------------------------------------------------------------
def literal_lda_attempt(class_sizes: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """The card's pseudo-code for one attempt on given Dirichlet draws (C x K), written as a plain loop.

    One documented change to the card's float arithmetic: the cumulative proportions are divided by their
    last value, so that they end at exactly 1 (see ``lda``'s docstring).
    """
    num_classes, k = draws.shape
    n = class_sizes.sum()
    sizes = [0] * k
    counts = np.zeros((num_classes, k), dtype=np.int64)
    for c in range(num_classes):
        q = np.array([draws[c, j] * (sizes[j] < n / k) for j in range(k)])
        q = q / q.sum()
        cum = np.cumsum(q)
        cum = cum / cum[-1]
        cuts = (cum * class_sizes[c]).astype(int)[:-1]
        pieces = np.split(np.arange(class_sizes[c]), cuts)
        for j in range(k):
            counts[c, j] = len(pieces[j])
            sizes[j] += len(pieces[j])
    return counts


@pytest.mark.parametrize("alpha", [0.05, 0.3, 2.0])
def test_lda_attempt_follows_card_cap_and_truncation(alpha):
    class_sizes = np.array([500, 320, 77, 1000, 3], dtype=np.int64)
    k, attempts = 12, 8
    draws = np.random.default_rng(5).dirichlet(np.full(k, alpha), size=(attempts, class_sizes.size))
    got = partition_module._lda_counts(class_sizes, k, alpha, np.random.default_rng(5), attempts)
    for b in range(attempts):
        assert np.array_equal(got[b], literal_lda_attempt(class_sizes, draws[b]))


def test_lda_cap_clients_at_fair_share_get_nothing_more():
    class_sizes = np.full(10, 600, dtype=np.int64)
    counts = partition_module._lda_counts(class_sizes, 20, 0.1, np.random.default_rng(0), 50)
    fair = class_sizes.sum() / 20
    before = np.cumsum(counts, axis=1) - counts  # per attempt, client sizes before each class
    capped = before >= fair
    assert capped.any()
    assert (counts[capped] == 0).all()
    assert (counts.sum(axis=2) == class_sizes).all()


@PROPERTY
@given(
    labels=st.lists(st.integers(0, 4), min_size=20, max_size=400),
    k=st.integers(1, 10),
    alpha=st.sampled_from([0.1, 0.5, 1.0, 10.0]),
    min_size=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_lda_property(labels, k, alpha, min_size, seed):
    y = np.array(labels, dtype=np.int64)
    try:
        parts = lda(y, k, seed, alpha=alpha, min_size=min_size, max_retries=200)
    except PartitionError as err:
        # Either impossible up front (k * min_size > N) or the retry budget ran out; both say so.
        impossible = k * min_size > y.size
        assert ("samples needed" in str(err)) if impossible else ("200 attempts" in str(err))
        return
    assert len(parts) == k
    assert_disjoint_complete(parts, y.size)
    assert min(len(p) for p in parts) >= min_size
    assert same_parts(parts, lda(y, k, seed, alpha=alpha, min_size=min_size, max_retries=200))


def test_lda_min_size_and_determinism_cifar_like():
    labels = cifar_like(500, 10)
    a = lda(labels, 20, 3, alpha=0.3)
    assert_disjoint_complete(a, labels.size)
    assert min(len(p) for p in a) >= 10
    assert same_parts(a, lda(labels, 20, 3, alpha=0.3))
    assert not same_parts(a, lda(labels, 20, 4, alpha=0.3))
    b = lda(labels, 20, 3, alpha=0.3, min_size=100)  # DaFKD's variant
    assert min(len(p) for p in b) >= 100


def test_lda_smaller_alpha_more_skew():
    labels = cifar_like(600, 10)

    def mean_classes(alpha):
        vals = [
            partition_stats(class_counts(lda(labels, 20, s, alpha=alpha, min_size=1), labels, 10))
            for s in range(4)
        ]
        return np.mean([v["classes_mean"] for v in vals]), np.mean([v["entropy_mean"] for v in vals])

    c_lo, h_lo = mean_classes(0.1)
    c_mid, h_mid = mean_classes(1.0)
    c_hi, h_hi = mean_classes(100.0)
    assert c_lo < c_mid < c_hi
    assert h_lo < h_mid < h_hi


def test_lda_impossible_requests_fail_fast():
    labels = cifar_like(10, 10)  # N = 100
    with pytest.raises(PartitionError, match="min_size"):
        lda(labels, 11, 0, alpha=1.0)  # 11 * 10 > 100, rejected before any attempt
    with pytest.raises(PartitionError, match=r"all 25 attempts.*larger partition\.alpha.*fewer clients"):
        lda(labels, 10, 0, alpha=0.01, min_size=10, max_retries=25)  # needs exactly 10 each
    with pytest.raises(PartitionError):
        lda(labels, 101, 0, alpha=1.0, min_size=0)


def test_lda_default_retry_limit_is_bounded(monkeypatch):
    # The default limit is a work budget, at least 1000 attempts; shrink the budget so the floor applies.
    monkeypatch.setattr(partition_module, "_LDA_DRAW_BUDGET", 1)
    labels = cifar_like(10, 10)
    with pytest.raises(PartitionError, match="all 1000 attempts"):
        lda(labels, 10, 0, alpha=0.01, min_size=10)


def test_lda_tiny_alpha_no_nan():
    labels = random_labels(2000, 10, seed=9)
    parts = lda(labels, 30, 0, alpha=1e-4, min_size=0)
    assert_disjoint_complete(parts, labels.size)


# --------------------------------------------------------------------------------------------------
# client_dirichlet (experiments-fedftg-dafkd.md §A)
# --------------------------------------------------------------------------------------------------
def test_client_dirichlet_equal_sizes_cifar_like():
    labels = cifar_like(500, 10)
    parts = client_dirichlet(labels, 100, 1024, alpha=0.3)
    assert_disjoint_complete(parts, labels.size)
    assert {len(p) for p in parts} == {50}
    assert same_parts(parts, client_dirichlet(labels, 100, 1024, alpha=0.3))
    assert not same_parts(parts, client_dirichlet(labels, 100, 1025, alpha=0.3))


@PROPERTY
@given(
    labels=st.lists(st.integers(0, 6), min_size=1, max_size=400),
    k=st.integers(1, 40),
    alpha=st.sampled_from([0.01, 0.1, 0.6, 5.0]),
    seed=st.integers(0, 10_000),
)
def test_client_dirichlet_property(labels, k, alpha, seed):
    y = np.array(labels, dtype=np.int64)
    k = min(k, y.size)
    parts = client_dirichlet(y, k, seed, alpha=alpha)
    assert len(parts) == k
    assert_disjoint_complete(parts, y.size)
    sizes = np.array([len(p) for p in parts])
    assert sizes.max() - sizes.min() <= 1
    if y.size % k == 0:
        assert (sizes == y.size // k).all()


def test_client_dirichlet_smaller_alpha_more_skew():
    labels = cifar_like(300, 10)

    def dominant(alpha):
        return np.mean(
            [
                partition_stats(class_counts(client_dirichlet(labels, 30, s, alpha=alpha), labels, 10))[
                    "dominant_fraction_mean"
                ]
                for s in range(3)
            ]
        )

    assert dominant(0.05) > dominant(0.6) > dominant(100.0)


def literal_sequential_counts(class_sizes, client_sizes, priors, rng):
    """The card's one-sample-at-a-time loop (random non-full client, class from prior, redraw if empty)."""
    room, left = client_sizes.copy(), class_sizes.copy()
    counts = np.zeros(priors.shape, dtype=np.int64)
    cdf = np.cumsum(priors, axis=1)
    while room.sum() > 0:
        k = rng.integers(len(room))
        if room[k] == 0:
            continue
        while True:
            c = int(np.searchsorted(cdf[k], rng.random(), side="right"))
            c = min(c, len(left) - 1)
            if left[c] > 0:
                break
        room[k] -= 1
        left[c] -= 1
        counts[k, c] += 1
    return counts


@pytest.mark.parametrize("chunk", [1, 4096])
def test_client_dirichlet_batched_matches_sequential_law(monkeypatch, chunk):
    # The batched simulation must have the distribution of the one-at-a-time loop: compare the mean
    # count matrix over many runs on a small case where exhaustion and full clients both matter.
    monkeypatch.setattr(partition_module, "_CD_CHUNK", chunk)
    class_sizes = np.array([6, 4, 2], dtype=np.int64)
    client_sizes = np.array([4, 4, 4], dtype=np.int64)
    priors = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.2, 0.7, 0.1]])
    runs = 1500
    rng = np.random.default_rng(0)
    ref = np.array([literal_sequential_counts(class_sizes, client_sizes, priors, rng) for _ in range(runs)])
    got = np.array(
        [partition_module._client_dirichlet_counts(class_sizes, client_sizes, priors, rng) for _ in range(runs)]
    )
    for c in got:
        assert (c.sum(axis=1) == client_sizes).all() and (c.sum(axis=0) == class_sizes).all()
    se = np.sqrt(ref.var(axis=0) / runs + got.var(axis=0) / runs) + 1e-9
    z = np.abs(ref.mean(axis=0) - got.mean(axis=0)) / se
    assert z.max() < 4.5, (ref.mean(axis=0), got.mean(axis=0))


def test_client_dirichlet_zero_prior_mass_does_not_hang():
    # A client whose prior has no mass on the remaining classes takes a uniform remaining class.
    class_sizes = np.array([2, 2], dtype=np.int64)
    client_sizes = np.array([2, 2], dtype=np.int64)
    priors = np.array([[1.0, 0.0], [1.0, 0.0]])
    counts = partition_module._client_dirichlet_counts(class_sizes, client_sizes, priors, np.random.default_rng(0))
    assert counts.sum(axis=0).tolist() == [2, 2] and counts.sum(axis=1).tolist() == [2, 2]


# --------------------------------------------------------------------------------------------------
# Per-client test sets (experiments-fedict.md §3)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["lda", "client_dirichlet", "shards"])
def test_per_client_test_follows_train_mix(scheme):
    train = cifar_like(400, 10)
    test = cifar_like(4000, 10)  # large test set: proportions should match closely
    params = {"lda": {"alpha": 0.5}, "client_dirichlet": {"alpha": 0.5}, "shards": {"shards_per_client": 2}}[scheme]
    p = make_partition(scheme, train, 10, 0, test_labels=test, per_client_test=True, **params)
    assert p.test is not None and len(p.test) == 10
    assert_disjoint_complete(p.train, train.size)
    assert_disjoint_complete(p.test, test.size)
    tr = class_counts(p.train, train, 10)
    te = class_counts(p.test, test, 10)
    assert ((tr == 0) <= (te == 0)).all(), "no test samples of a class the client has no train samples of"
    l1 = np.abs(tr / tr.sum(1, keepdims=True) - te / te.sum(1, keepdims=True)).sum(axis=1)
    assert l1.max() < 0.01
    # Train part is the same as without test sets (one stream, train drawn first).
    assert same_parts(p.train, make_partition(scheme, train, 10, 0, **params).train)


@PROPERTY
@given(
    train=st.lists(st.integers(0, 4), min_size=10, max_size=300),
    test=st.lists(st.integers(0, 4), min_size=0, max_size=300),
    k=st.integers(1, 8),
    seed=st.integers(0, 10_000),
)
def test_per_client_test_property(train, test, k, seed):
    y, yt = np.array(train, dtype=np.int64), np.array(test, dtype=np.int64)
    k = min(k, y.size)
    p = make_partition("client_dirichlet", y, k, seed, test_labels=yt, per_client_test=True, alpha=0.5)
    tr = class_counts(p.train, y, 5)
    te = class_counts(p.test, yt, 5)
    # Disjoint; complete over the test samples whose class exists in the train split.
    got = np.concatenate(p.test)
    assert np.unique(got).size == got.size
    expected = np.flatnonzero(np.isin(yt, y))
    assert np.array_equal(np.sort(got), expected)
    # FedICT: test count of (k, c) is within one sample of n_{k,c} / N_c * |I'_c|.
    n_c = tr.sum(axis=0)
    m_c = np.bincount(yt, minlength=5)
    ideal = np.divide(tr * m_c, n_c, out=np.zeros(tr.shape), where=n_c > 0)
    assert (np.abs(te - ideal) < 1).all()
    assert (te[tr == 0] == 0).all()
    again = make_partition("client_dirichlet", y, k, seed, test_labels=yt, per_client_test=True, alpha=0.5)
    assert same_parts(p.test, again.test)


def test_per_client_test_drops_classes_missing_from_train():
    train = np.array([0, 0, 1, 1, 0, 1], dtype=np.int64)
    test = np.array([0, 1, 2, 2, 0], dtype=np.int64)
    p = make_partition("iid", train, 2, 0, test_labels=test, per_client_test=True)
    got = np.sort(np.concatenate(p.test))
    assert got.tolist() == [0, 1, 4]


# --------------------------------------------------------------------------------------------------
# class_counts / partition_stats
# --------------------------------------------------------------------------------------------------
def test_class_counts_and_stats_known_values():
    labels = np.array([0, 0, 1, 2, 1, 1], dtype=np.int64)
    parts = [np.array([0, 1]), np.array([2, 4, 3]), np.array([5]), np.array([], dtype=np.int64)]
    counts = class_counts(parts, labels, 3)
    assert counts.tolist() == [[2, 0, 0], [0, 2, 1], [0, 1, 0], [0, 0, 0]]
    st_ = partition_stats(counts)
    assert st_["clients"] == 4 and st_["samples"] == 6
    assert st_["size_min"] == 0 and st_["size_max"] == 3 and st_["size_mean"] == pytest.approx(1.5)
    assert st_["size_std"] == pytest.approx(np.std([2, 3, 1, 0]))
    assert st_["classes_mean"] == pytest.approx(1.0) and st_["classes_min"] == 0 and st_["classes_max"] == 2
    h = -(2 / 3 * np.log(2 / 3) + 1 / 3 * np.log(1 / 3))
    assert st_["entropy_mean"] == pytest.approx(h / 3)  # over the three non-empty clients
    assert st_["dominant_fraction_mean"] == pytest.approx((1 + 2 / 3 + 1) / 3)
    assert all(isinstance(v, (int, float)) for v in st_.values())


def test_class_counts_rejects_out_of_range_labels():
    with pytest.raises(ValueError):
        class_counts([np.array([0])], np.array([3]), 3)


def test_stats_iid_vs_uniform():
    labels = cifar_like(100, 10)
    stats = partition_stats(class_counts(iid(labels, 10, 0), labels, 10))
    assert stats["classes_min"] == 10
    assert stats["entropy_mean"] > 0.95 * np.log(10)
    assert stats["size_std"] == 0.0


# ------------------------------------------------------------------------------------------- nway_kshot
def test_nway_kshot_draws_fedprotos_ways_and_shots_and_never_shares_a_sample():
    """FedProto's MNIST setting, ways 3, shots 100, stdev 2 (spec/fedproto.md §9): every client holds n_k classes
    with n_k in [max(2, 3 - 2), min(10 - 1, 3 + 2)] = [2, 5] (each value drawn over 100 clients) and exactly k_k of
    each, k_k in [100 - 2 + 1, 100 + 2 - 2] = {99, 100}; no sample is held twice; the rest of the set is unused."""
    labels = np.repeat(np.arange(10), 7000)
    parts = partition_module.nway_kshot(labels, 100, 3, ways=3, shots=100, stdev=2)
    counts = class_counts(parts, labels, 10)
    held = (counts > 0).sum(1)
    assert set(held.tolist()) == {2, 3, 4, 5}
    for row in counts:
        assert len(set(row[row > 0].tolist())) == 1 and int(row[row > 0][0]) in (99, 100)
    everything = np.concatenate(parts)
    assert np.unique(everything).size == everything.size < labels.size


def test_nway_kshot_refuses_an_empty_draw_or_too_few_samples_in_one_line():
    labels = np.repeat(np.arange(10), 700)
    with pytest.raises(ConfigError, match="partition.stdev: k-shot draws from .* which needs stdev >= 2"):
        partition_module.nway_kshot(labels, 5, 0, ways=3, shots=100, stdev=1)
    with pytest.raises(PartitionError, match="holders need .* lower partition.shots or the number of clients"):
        partition_module.nway_kshot(labels, 40, 0, ways=5, shots=100, stdev=2)
    with pytest.raises(ConfigError, match="partition.ways"):
        partition_module.nway_kshot(np.repeat(np.arange(2), 700), 2, 0, ways=3, shots=100, stdev=2)


def test_nway_kshot_from_the_config_and_its_keys_refused_elsewhere():
    """partition.ways / shots / stdev reach the scheme through the run's config (a run's clients hold 2-5 classes of
    99 or 100 images of the digits); ways is required by nway_kshot and refused by the other schemes, in one line."""
    from conftest import _digits, small_config

    from fedistill.engine.federation import build_federation

    cfg = small_config(**{"partition.scheme": "nway_kshot", "partition.ways": 3, "partition.shots": 12, "partition.stdev": 2,
                          "partition.num_clients": 5, "partition.alpha": None})  # fmt: skip
    federation = build_federation(cfg, _digits())
    counts = class_counts([ix.numpy() for ix in federation.train_indices], _digits().train_y.numpy(), 10)
    assert all(2 <= int((row > 0).sum()) <= 5 and set(row[row > 0].tolist()) <= {11, 12} for row in counts)
    with pytest.raises(ConfigError, match="partition.ways: required by the nway_kshot scheme"):
        small_config(**{"partition.scheme": "nway_kshot", "partition.alpha": None})
    with pytest.raises(ConfigError, match="partition.shots: only used by the nway_kshot scheme, not lda"):
        small_config(**{"partition.shots": 10})
