"""Scale (issue 15 target 3): client_dirichlet at 10,000 clients, bf16 client state, the synthetic dataset."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from conftest import small_config

from fedistill.config import build_config
from fedistill.data.partition import class_counts, client_dirichlet, make_partition
from fedistill.data.sources import load_dataset
from fedistill.data.synthetic import SyntheticClients, SyntheticSpec, load_synthetic
from fedistill.simulation import Simulation, build_federation
from fedistill.engine.state_store import DiskStateStore, MemoryStateStore, make_state_store
from fedistill.errors import ConfigError, PartitionError
from fedistill.models.flat import get_flat


# --------------------------------------------------------------------------------------------------
# client_dirichlet with many tiny clients (was 30 s for 10,000 MNIST clients)
# --------------------------------------------------------------------------------------------------
def test_client_dirichlet_ten_thousand_clients_of_six():
    labels = np.random.default_rng(0).integers(0, 10, 60_000)
    parts = client_dirichlet(labels, 10_000, 3, alpha=0.5)
    assert [len(p) for p in parts] == [6] * 10_000
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(60_000))
    counts = class_counts(parts, labels, 10)
    assert (counts.sum(axis=0) == np.bincount(labels, minlength=10)).all()
    # alpha = 0.5 skews the tiny clients: on average well under the 10 classes (about 3.6 of 6 samples)
    assert (counts > 0).sum(axis=1).mean() < 4.5
    assert all(np.array_equal(a, b) for a, b in zip(parts[:50], client_dirichlet(labels, 10_000, 3, alpha=0.5)[:50]))


# --------------------------------------------------------------------------------------------------
# run.client_state_dtype: bf16
# --------------------------------------------------------------------------------------------------
def test_bf16_disk_store_halves_the_bytes_and_round_trips_to_bf16_precision(tmp_path):
    x = torch.randn(100_000) * 3
    full, half = DiskStateStore(tmp_path / "fp32"), DiskStateStore(tmp_path / "bf16", dtype="bf16")
    state = {"c": x, "steps": torch.tensor([7]), "own_bf16": x[:4].to(torch.bfloat16), "note": 3}
    full.save(0, dict(state), 1)
    half.save(0, dict(state), 1)
    size = {name: sum(f.stat().st_size for f in (tmp_path / name).iterdir()) for name in ("fp32", "bf16")}
    assert size["bf16"] < 0.52 * size["fp32"]
    back = half.load(0)
    assert back["c"].dtype == torch.float32
    # exactly the nearest bfloat16 value, widened; so within a relative 2^-8 of the original
    assert torch.equal(back["c"], x.to(torch.bfloat16).to(torch.float32))
    assert ((back["c"] - x).abs() <= x.abs() * 2.0**-8).all()
    assert not torch.equal(back["c"], x)
    # only float32 entries are rounded; everything else comes back as it was
    assert back["steps"].dtype == torch.int64 and back["own_bf16"].dtype == torch.bfloat16 and back["note"] == 3
    assert set(back) == set(state)
    assert torch.equal(full.load(0)["c"], x)


def test_bf16_memory_store_keeps_bf16_and_hands_out_float32():
    store = MemoryStateStore("bf16")
    x = torch.randn(1000)
    store.save(4, {"c": x}, 1)
    assert store._states[4]["c"].dtype == torch.bfloat16
    assert torch.equal(store.load(4)["c"], x.to(torch.bfloat16).float())
    assert torch.equal(store[4]["c"], store.load(4)["c"]) and list(store) == [4]
    assert store.load(5) == {}


def test_bad_state_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="run.client_state_dtype"):
        small_config(**{"run.client_state_dtype": "fp16"})
    with pytest.raises(ConfigError, match="run.client_state_dtype: 'int8'"):
        make_state_store("memory", None, "int8")


def _scaffold(rounds, **run):
    run = {"checkpoint_every": 2, "threads": 1, **run}
    return small_config(rounds=rounds, algorithm="scaffold", **{f"run.{k}": v for k, v in run.items()})


@pytest.mark.parametrize("store", ["disk", "memory"])
def test_bf16_state_resumes_exactly(digits, tmp_path, store):
    """Checkpoint at round 2, crash after round 3, resume to 4: equal to an uninterrupted bf16 run."""
    cfg = _scaffold(4, client_state=store, client_state_dtype="bf16")
    full = Simulation(cfg, digits, run_dir=tmp_path / "full")
    full.run()
    crashed = Simulation(cfg, digits, run_dir=tmp_path / "crash")
    for rnd in (1, 2, 3):
        crashed.run_round(rnd)
    crashed.close()
    resumed = Simulation(cfg, digits, run_dir=tmp_path / "crash")
    resumed.run(resume=True)
    assert torch.equal(get_flat(full.server.model), get_flat(resumed.server.model))
    assert list(full.state.client_states) == list(resumed.state.client_states)
    for cid in full.state.client_states:
        assert torch.equal(full.state.client_states[cid]["scaffold_c"], resumed.state.client_states[cid]["scaffold_c"])
    if store == "memory":
        return
    # the rounding really happened (and changed the run, a little)
    fp32 = Simulation(_scaffold(4, client_state=store), digits, run_dir=tmp_path / "fp32")
    fp32.run()
    a, b = get_flat(full.server.model), get_flat(fp32.server.model)
    assert not torch.equal(a, b) and float((a - b).norm() / b.norm()) < 0.05


def test_resume_refuses_switching_the_state_dtype(digits, tmp_path):
    Simulation(_scaffold(2), digits, run_dir=tmp_path).run()
    with pytest.raises(ConfigError, match="client_state_dtype"):
        Simulation(_scaffold(4, client_state_dtype="bf16"), digits, run_dir=tmp_path).run(resume=True)


# --------------------------------------------------------------------------------------------------
# FedProx's Synthetic(alpha, beta)
# --------------------------------------------------------------------------------------------------
def test_synthetic_shapes_sizes_and_determinism():
    ds = load_synthetic(num_clients=40, seed=5, test_samples=500)
    sizes = ds.clients.sizes
    assert sizes.shape == (40,) and sizes.min() >= 50 and ds.clients.num_rows == sizes.sum()
    assert ds.input_shape == (1, 1, 60) and ds.num_classes == 10
    assert tuple(ds.train_x.shape) == (sizes.sum(), 1, 1, 60) and tuple(ds.train_y.shape) == (sizes.sum(),)
    assert tuple(ds.test_x.shape) == (500, 1, 1, 60) and ds.test_x.dtype == torch.float32
    rows = torch.arange(int(ds.clients.offsets[7]), int(ds.clients.offsets[8]))
    x, y = ds.train_x[rows], ds.train_y[rows]
    assert x.shape == (sizes[7], 1, 1, 60) and y.dtype == torch.int64 and 0 <= int(y.min()) and int(y.max()) < 10
    again = load_synthetic(num_clients=40, seed=5, test_samples=500)
    assert torch.equal(again.train_x[rows], x) and torch.equal(again.test_y, ds.test_y)
    other = load_synthetic(num_clients=40, seed=6, test_samples=500)
    assert not np.array_equal(other.clients.sizes, sizes)
    # client k is the same client in a larger federation (its streams depend on (seed, k) only)
    bigger = load_synthetic(num_clients=400, seed=5, test_samples=500)
    assert bigger.clients.sizes[7] == sizes[7] and torch.equal(bigger.train_y[rows], y)


def test_synthetic_sizes_follow_fedprox_lognormal():
    sizes = SyntheticSpec(num_clients=20_000, seed=1).sizes()
    # floor(lognormal(4, 2)) + 50: the median is floor(e^4) + 50 = 104; P(size >= 50 + e^6) = P(Z >= 1) = 0.159
    assert abs(np.median(sizes) - 104) <= 4
    assert abs((sizes >= 50 + np.exp(6)).mean() - 0.1587) < 0.015
    assert SyntheticSpec(num_clients=1000, max_samples=300).sizes().max() == 300


def test_synthetic_label_rule_and_covariance_by_independent_computation():
    spec = SyntheticSpec(num_clients=3, seed=2, alpha=0.7, beta=1.3)
    x, y = spec.client_samples(1, 40_000)
    weights, bias, mean = spec.client_model(1)
    logits = x.astype(np.float64) @ weights.T + bias
    soft = np.exp(logits - logits.max(axis=1, keepdims=True))
    soft /= soft.sum(axis=1, keepdims=True)
    assert np.array_equal(y, soft.argmax(axis=1))
    sigma = np.array([(j + 1) ** -1.2 for j in range(60)])
    var = ((x - mean) ** 2).mean(axis=0)  # around the true mean v_k
    assert np.allclose(var, sigma, rtol=0.05)  # sd of the estimate is sqrt(2/n) = 0.7 %
    assert np.all(np.abs(x.mean(axis=0) - mean) < 5 * np.sqrt(sigma / x.shape[0]))
    assert abs(np.corrcoef(x[:, 0], x[:, 1])[0, 1]) < 0.03  # diagonal: independent coordinates


def test_synthetic_prior_spreads_std_and_variance():
    def spreads(**kw):
        spec = SyntheticSpec(num_clients=600, seed=3, **kw)
        models = [spec.client_model(k) for k in range(600)]
        u = np.array([np.concatenate([w.ravel(), b]).mean() for w, b, _ in models])  # u_k + N(0, 1/610)
        shift = np.array([v.mean() for _, _, v in models])  # B_k + N(0, 1/60)
        return u.std(), shift.std()

    u, b = spreads(alpha=2.0, beta=0.5)
    assert abs(u - 2.0) < 0.2 and abs(b - np.sqrt(0.25 + 1 / 60)) < 0.06
    u, b = spreads(alpha=4.0, beta=0.0, spread="variance")  # variance 4: std 2
    assert abs(u - 2.0) < 0.2 and abs(b - np.sqrt(1 / 60)) < 0.02


def test_synthetic_alpha_leaves_the_data_unchanged_and_beta_skews_labels():
    # alpha shifts all ten logits by the same u_k (1'x + 1): the argmax, hence the data, cannot change.
    a = SyntheticSpec(num_clients=5, seed=4, alpha=0.0, beta=1.0)
    b = SyntheticSpec(num_clients=5, seed=4, alpha=3.0, beta=1.0)
    for k in range(5):
        xa, ya = a.client_samples(k, 300)
        xb, yb = b.client_samples(k, 300)
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)

    def dominant_share(beta):
        spec = SyntheticSpec(num_clients=60, seed=4, alpha=1.0, beta=beta)
        return np.mean([np.bincount(spec.client_samples(k, 400)[1], minlength=10).max() / 400 for k in range(60)])

    assert dominant_share(0.0) < dominant_share(1.0) < dominant_share(5.0)


def test_lazy_rows_gather_across_clients_evict_and_pickle():
    spec = SyntheticSpec(num_clients=6, seed=0, test_samples=10)
    clients = SyntheticClients(spec, cache_rows=1)  # keeps only the last client
    blocks = [spec.client_samples(k, int(clients.sizes[k])) for k in range(6)]
    all_x = np.concatenate([b[0] for b in blocks])
    all_y = np.concatenate([b[1] for b in blocks])
    rows = torch.tensor([int(clients.offsets[5]), 0, int(clients.offsets[2]) + 3, int(clients.offsets[1]) - 1])
    assert np.array_equal(clients.gather(rows, 0).numpy().reshape(4, 60), all_x[rows.numpy()])
    assert np.array_equal(clients.gather(rows, 1).numpy(), all_y[rows.numpy()])
    assert len(clients._cache) == 1
    copy = pickle.loads(pickle.dumps(clients))
    assert len(copy._cache) == 0 and np.array_equal(copy.gather(rows, 1).numpy(), all_y[rows.numpy()])
    with pytest.raises(IndexError):
        clients.gather(torch.tensor([clients.num_rows]), 0)


def test_synthetic_config_and_natural_federation():
    base = {"dataset": {"name": "synthetic"}, "partition": {"scheme": "natural", "num_clients": 12}, "clients_per_round": 4}
    cfg = build_config(base)
    assert cfg.model_name() == "logistic" and cfg.augmentations() == []
    assert cfg.resolved_dict()["dataset"]["synthetic"]["alpha"] == 1.0
    ds = load_dataset("synthetic", **cfg.dataset_options())
    fed = build_federation(cfg, ds)
    assert fed.num_clients == 12 and np.array_equal(fed.client_sizes(), ds.clients.sizes)
    assert torch.equal(fed.train_indices[3], torch.arange(int(ds.clients.offsets[3]), int(ds.clients.offsets[4])))
    counts = fed.class_counts()
    assert counts.shape == (12, 10) and np.array_equal(counts[[2, 5]], fed.class_counts_of([2, 5]))
    with pytest.raises(ConfigError, match="partition.scheme: dataset synthetic makes its own clients"):
        build_config({**base, "partition": {"scheme": "lda", "num_clients": 12}})
    with pytest.raises(ConfigError, match="partition.scheme: natural needs"):
        build_config({"partition": {"scheme": "natural"}})
    with pytest.raises(ConfigError, match="dataset.synthetic"):
        build_config({"dataset": {"synthetic": {"alpha": 0.5}}})
    with pytest.raises(ConfigError, match="dataset.synthetic.beta"):
        build_config(base, {"dataset.synthetic.beta": -1})
    with pytest.raises(ConfigError, match="max_samples .10. is below min_samples"):
        build_config(base, {"dataset.synthetic.max_samples": 10})
    with pytest.raises(PartitionError, match="natural"):
        make_partition("natural", np.zeros(10, dtype=np.int64), 2, 0)


def test_fedavg_on_synthetic_learns_in_two_rounds():
    cfg = build_config(
        {
            "dataset": {"name": "synthetic", "synthetic": {"max_samples": 200, "test_samples": 2000}},
            "partition": {"scheme": "natural", "num_clients": 10},
            "clients_per_round": 10,
            "rounds": 2,
            "local": {"epochs": 5, "batch_size": 10},
            "run": {"progress": False, "threads": 1},
        }
    )
    ds = load_dataset("synthetic", **cfg.dataset_options())
    majority = 100.0 * np.bincount(ds.test_y.numpy()).max() / len(ds.test_y)
    history = Simulation(cfg, ds).run()
    assert history[-1]["test_accuracy"] > majority + 10, (history[-1]["test_accuracy"], majority)
    assert sum(history[-1]["train_label_counts"]) == int(ds.clients.sizes.sum())


def test_synthetic_per_client_test_is_each_clients_own_held_out_share():
    """FedProx's evaluation (issue 27): client k's test split is the held-out samples drawn from client k,
    labelled by client k's own model, and the personal accuracy is the mean over the clients that have one."""
    cfg = build_config(
        {
            "dataset": {"name": "synthetic", "synthetic": {"max_samples": 200, "test_samples": 600}},
            "partition": {"scheme": "natural", "num_clients": 40, "per_client_test": True},
            "clients_per_round": 10, "rounds": 2, "local": {"epochs": 2, "batch_size": 10},
            "run": {"progress": False, "threads": 1},
        }
    )  # fmt: skip
    assert cfg.accuracy_metric() == "personal"
    ds = load_dataset("synthetic", **cfg.dataset_options())
    fed = build_federation(cfg, ds)
    shares = list(fed.test_indices)
    # the shares cover the held-out set once, in client order
    assert torch.equal(torch.cat(shares), torch.arange(len(ds.test_y)))
    spec = ds.clients.spec
    for k in (0, 7, 39):
        x = ds.test_x[shares[k]].reshape(-1, spec.dim).double().numpy()
        weights, bias, _ = spec.client_model(k)  # client k's own labeller, written out: argmax(W_k x + b_k)
        assert np.array_equal(ds.test_y[shares[k]].numpy(), np.argmax(x @ weights.T + bias, axis=1))
    # a client's expected share is 600 * n_k / N: the larger half of the clients holds more per client
    sizes, held = ds.clients.sizes, np.array([len(s) for s in shares])
    large = sizes >= np.median(sizes)
    assert held[large].mean() > 1.5 * held[~large].mean(), (sizes, held)
    sim = Simulation(cfg, ds)
    history = sim.run()
    # the card's metric written out: the global model's accuracy on each client's share, mean over non-empty shares
    with torch.inference_mode():
        right = (sim.server.model(ds.test_x).argmax(1) == ds.test_y).double()
    expected = np.mean([100.0 * float(right[ix].mean()) for ix in shares if ix.numel()])
    assert history[-1]["personal_accuracy"] == pytest.approx(expected, abs=1e-6)
    assert history[-1]["personal_accuracy"] != pytest.approx(history[-1]["test_accuracy"], abs=1e-9)  # not the pooled one


def test_personal_metrics_of_contiguous_ranges_equal_the_per_client_ones():
    """The 100,000-client path (one cumulative sum) gives what one index tensor per client gives; empty shares
    are left out. Hand case: client 0 holds [1, 0] (50 %), client 1 nothing, client 2 [1, 1, 1] (100 %)."""
    from fedistill.engine.summary import personal_metrics, personal_metrics_of_ranges

    correct = torch.tensor([True, False, True, True, True])
    row = personal_metrics_of_ranges(correct, np.array([0, 2, 2, 5]))
    assert row["personal_clients"] == [0, 2] and row["personal_accuracies"] == [50.0, 100.0]
    assert row["personal_accuracy"] == 75.0
    g = torch.Generator().manual_seed(0)
    correct = torch.rand(1000, generator=g) < 0.6
    offsets = np.concatenate([[0], np.sort(torch.randint(0, 1001, (99,), generator=g).numpy()), [1000]])
    by_client = {k: correct[offsets[k] : offsets[k + 1]] for k in range(100)}
    fast, slow = personal_metrics_of_ranges(correct, offsets), personal_metrics(by_client)
    assert fast.keys() == slow.keys() and fast["personal_clients"] == slow["personal_clients"]
    assert len(fast["personal_clients"]) < 100  # some shares are empty
    for key in fast:
        assert fast[key] == pytest.approx(slow[key], abs=1e-9), key


def test_synthetic_iid_shares_one_labeller_and_learns_at_a_thousand_clients():
    spec = SyntheticSpec(num_clients=1000, iid=True)
    w3, b3, v3 = spec.client_model(3)
    w9, b9, v9 = spec.client_model(999)
    assert np.array_equal(w3, w9) and np.array_equal(b3, b9) and not v3.any() and not v9.any()
    assert not np.array_equal(w3, SyntheticSpec(num_clients=1000).client_model(3)[0])  # the non-IID clients differ
    x, y = spec.client_samples(5, 400)
    assert np.array_equal(y, np.argmax(x.astype(np.float64) @ w3.T + b3, axis=1))  # the shared rule, written out
    assert abs(float(x.mean())) < 0.1  # centred inputs (v = 0)
    cfg = build_config(
        {
            "dataset": {"name": "synthetic", "synthetic": {"iid": True, "max_samples": 100, "test_samples": 2000}},
            "partition": {"scheme": "natural", "num_clients": 1000}, "clients_per_round": 10, "rounds": 3,
            "local": {"epochs": 10, "batch_size": 10, "lr": 0.01, "momentum": 0.0}, "run": {"progress": False, "threads": 1},
        }
    )  # fmt: skip
    ds = load_dataset("synthetic", **cfg.dataset_options())
    majority = 100.0 * np.bincount(ds.test_y.numpy()).max() / len(ds.test_y)
    history = Simulation(cfg, ds).run()
    assert history[-1]["test_accuracy"] > majority + 12, (history[-1]["test_accuracy"], majority)


def test_run_directory_counts_only_the_first_generated_clients(tmp_path, digits):
    """Counting a generated federation's labels generates every client (65 s at 100,000): the run directory
    records the first 1,000 and says so; a stored partition is always counted whole."""
    import io

    from rich.console import Console

    from fedistill.runner import run_experiment

    base = {"dataset": {"name": "synthetic"}, "partition": {"scheme": "natural", "num_clients": 1_200}, "clients_per_round": 2}
    cfg = build_config(base, {"rounds": 1, "model.name": "logistic", "local.epochs": 1, "run.out_dir": str(tmp_path),
                              "run.progress": False, "dataset.synthetic.test_samples": 200})  # fmt: skip
    fed = build_federation(cfg, load_synthetic(num_clients=1_200, seed=cfg.seed, test_samples=200))
    counts, partial = fed.report_counts(limit=30)
    assert partial and counts.shape == (30, 10)
    assert np.array_equal(counts, fed.class_counts_of(range(30)))
    assert np.array_equal(counts.sum(axis=1), fed.client_sizes()[:30])

    out = io.StringIO()
    run_experiment(cfg, console=Console(file=out, width=200))
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = (run / "partition_counts.csv").read_text().splitlines()
    assert len(rows) == 1 + 1_000 and rows[-1].startswith("999,")
    assert "first 1,000 of the 1,200 generated clients" in out.getvalue()
    assert (run / "partition.png").stat().st_size > 0

    stored = build_federation(small_config(**{"partition.num_clients": 40}), digits)
    counts, partial = stored.report_counts(limit=10)
    assert not partial and counts.shape[0] == 40
