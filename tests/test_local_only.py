"""Local (``local_only``): every client trains alone, nothing travels (spec/local-alone.md §7's invariants)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import hetero_config, own_models, without_timings

from fedistill.data.dataset import Dataset
from fedistill.data.pipeline import TensorPipeline
from fedistill.engine.seeding import CLIENT, INIT, make_generator
from fedistill.models.flat import get_flat
from fedistill.simulation import Simulation, build_model_for

THREE = ["digits_cnn", "mlp", "resnet8"]


def test_nothing_travels_and_accuracy_is_each_clients_own_with_the_htfllib_defaults(digits):
    """Invariant 1: 0 bytes both ways in every round (the training loss is an uncounted report); no global model,
    the personal accuracy of every client; the method fills HtFLlib's plain SGD where the user set nothing."""
    cfg = hetero_config("local_only", clients=THREE)
    assert (cfg.local.momentum, cfg.local.weight_decay, cfg.local.lr_decay, cfg.partition.per_client_test) == (0.0, 0.0, 1.0, True)
    sim = Simulation(cfg, digits)
    history = sim.run()
    assert [(r["bytes_up"], r["bytes_down"]) for r in history] == [(0, 0), (0, 0)]
    assert all(r["test_accuracy"] is None and r["personal_clients"] == [0, 1, 2] for r in history)
    assert all(0.0 < r["personal_accuracy"] <= 100.0 and r["train_loss"] > 0 for r in history)
    assert sim.server.state == {}


def test_a_client_never_changes_through_the_federation(digits):
    """Invariants 2 and 4: blanking client 2's images (its data, not the partition) leaves clients 0 and 1 bitwise
    where they were; client 2 itself moves. Any aggregation leaking between clients fails this."""
    cfg = hetero_config("local_only", clients=THREE)
    plain = Simulation(cfg, digits)
    plain.run()
    x = digits.train_x.clone()
    x[plain.federation.train_indices[2]] = 0
    blanked = Dataset(digits.name, x, digits.train_y, digits.test_x, digits.test_y, digits.num_classes, digits.mean, digits.std)
    other = Simulation(cfg, blanked)
    other.run()
    a, b = own_models(plain), own_models(other)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[2], b[2])


def test_a_clients_model_is_plain_sgd_on_its_own_batches(digits):
    """Invariant 3: after two rounds client 1's model equals two epochs of hand-written SGD (w ← w − η∇ mean CE)
    over the same per-(seed, round, client) batch order, from its architecture's seeded initial weights."""
    cfg = hetero_config("local_only", clients=THREE)
    sim = Simulation(cfg, digits)
    sim.run()
    cid, name = 1, THREE[1]
    model = build_model_for(cfg, digits, (INIT,), name)
    pipeline = TensorPipeline(digits)
    indices = sim.federation.train_indices[cid]
    model.train()
    for rnd in (1, 2):
        for x, y in pipeline.epoch_batches(indices, cfg.local.batch_size, make_generator(cfg.seed, CLIENT, rnd, cid)):
            loss = F.cross_entropy(model(x), y)
            grads = torch.autograd.grad(loss, list(model.parameters()))
            with torch.no_grad():
                for param, grad in zip(model.parameters(), grads):
                    param.add_(grad, alpha=-cfg.local.lr)  # w ← w − η g (card Eq. L1)
    torch.testing.assert_close(own_models(sim)[cid], get_flat(model), rtol=1e-5, atol=1e-6)


def test_resume_after_a_kill_is_bitwise_with_three_architectures(digits, tmp_path):
    """Invariants 5 and 6: three architectures train; two rounds, a checkpoint, one more equal three straight."""
    straight = Simulation(hetero_config("local_only", clients=THREE, rounds=3), digits, run_dir=tmp_path / "a")
    full = straight.run()
    Simulation(hetero_config("local_only", clients=THREE, rounds=2), digits, run_dir=tmp_path / "b").run()
    resumed = Simulation(hetero_config("local_only", clients=THREE, rounds=3), digits, run_dir=tmp_path / "b")
    history = resumed.run(resume=True)
    assert without_timings(history) == without_timings(full)
    a, b = own_models(straight), own_models(resumed)
    assert sorted(a) == [0, 1, 2] and all(torch.equal(a[c], b[c]) for c in a)


def test_one_architecture_for_all_runs_too(digits):
    history = Simulation(hetero_config("local_only", rounds=1), digits).run()
    assert history[0]["personal_accuracy"] > 0 and history[0]["bytes_up"] == 0


def test_a_users_own_settings_win_over_the_methods_defaults(digits):
    """The method fills HtFLlib's plain SGD only where the user left a key unset (card §2: with momentum, the
    buffer starts anew each round: nothing but the model is kept)."""
    cfg = hetero_config("local_only", rounds=1, **{"local.momentum": 0.9, "local.weight_decay": 1e-4})
    assert (cfg.local.momentum, cfg.local.weight_decay) == (0.9, 1e-4)
    sim = Simulation(cfg, digits)
    sim.run()
    assert set(sim.server_runtime.client_store.load(0)) == {"model"}


def test_the_summary_counts_each_client_architectures_parameters_where_the_server_keeps_no_model(digits):
    """summary.json's model_parameters is the server model's (0 here: Local keeps none), so the clients' own sizes go
    beside it, by architecture: logistic regression on 8x8 digits is 64·10 + 10 = 650 weights."""
    from fedistill.runner import model_parameters

    cfg = hetero_config("local_only", clients=["digits_cnn", "logistic", "digits_cnn"])
    sim = Simulation(cfg, digits)
    sizes = model_parameters(cfg, digits, sim.server.model, 3)
    cnn = build_model_for(cfg, digits, (INIT,), "digits_cnn")
    by_hand = sum(p.numel() for p in cnn.parameters()) + sum(b.numel() for b in cnn.buffers() if b.is_floating_point())
    assert sizes == {"model_parameters": 0, "client_model_parameters": {"digits_cnn": by_hand, "logistic": 650}}
    same = hetero_config("fedavg")  # one architecture everywhere, kept by the server: no second count
    assert model_parameters(same, digits, Simulation(same, digits).server.model, 3).keys() == {"model_parameters"}
