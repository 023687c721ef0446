"""FedTGP (``fedtgp``): class prototypes up, trainable global prototypes learned by the server with the
adaptive-margin contrastive loss down, nearest-prototype inference (spec/fedtgp.md §8). Expected values come from
the card's formulas on tiny tensors, written out here; a margin on the wrong class, a flipped distance, a
count-weighted mean or a wrong timing fails a test."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import hetero_config, own_models, without_timings

from fedistill.algorithms.build import make_algorithm
from fedistill.algorithms.fedtgp import PrototypeGenerator
from fedistill.class_losses import adaptive_margin, margin_contrastive_loss, mean_over_holders
from fedistill.config import build_config
from fedistill.models.flat import set_flat
from fedistill.protocol import ClassRows, Message, RoundInfo, ServerContext
from fedistill.simulation import Simulation

THREE = ["digits_cnn", "resnet8", "logistic"]  # three families, each with a 64-wide feature on 8x8 digits


def upload(rows: dict[int, list[float]], counts: dict[int, int] | None = None) -> Message:
    classes = sorted(rows)
    n = torch.tensor([(counts or {}).get(c, 1) for c in classes])
    return Message(ClassRows(torch.tensor(classes), torch.tensor([rows[c] for c in classes], dtype=torch.float32), n).items())


def margin_of(replies: dict[int, Message], tau: float, classes: int = 4) -> float:
    """δ the way the server makes it: unweighted class means of the uploads (T3), then T4-T5."""
    listed = [(r.classes, r.rows, r.counts) for r in (ClassRows.read(m) for m in replies.values())]
    return adaptive_margin(*mean_over_holders(listed, classes), tau)


def test_the_margin_is_the_largest_nearest_class_gap_capped_by_tau():
    """Invariant 1: Q = {0: [0], 1: [3], 2: [10]}: gaps (3, 3, 7), δ = 7 with τ = 100 and 5 with τ = 5; class 0
    uploaded as [−1] and [1] by two clients averages to [0] whatever their counts (1 and 100); a class nobody
    uploaded changes nothing; a single uploaded class gives δ = τ."""
    three = {0: upload({0: [0.0], 1: [3.0]}), 1: upload({2: [10.0]})}
    assert margin_of(three, 100.0) == 7.0 and margin_of(three, 5.0) == 5.0
    split = {0: upload({0: [-1.0], 1: [3.0]}, {0: 1}), 1: upload({0: [1.0], 2: [10.0]}, {0: 100})}
    assert margin_of(split, 100.0) == 7.0  # Q^0 = [0]
    split_far = {0: upload({0: [-1.0], 1: [3.0]}, {0: 1}), 1: upload({0: [9.0], 2: [10.0]}, {0: 100})}
    assert margin_of(split_far, 100.0) == 6.0  # unweighted Q^0 = [4]: gaps (1, 1, 6); count-weighted [8.9] would give 5.9
    assert margin_of(three, 100.0, classes=6) == 7.0  # classes 3-5 absent
    assert margin_of({0: upload({2: [10.0]})}, 42.0) == 42.0


def test_the_contrastive_loss_by_hand():
    """Invariants 2-3: P̂ = {0: [0], 1: [2]}, row [0.5] of class 0: D = (0.5, 1.5); δ = 1 gives log 2, δ = 0 gives
    −log(e^{−0.5} / (e^{−0.5} + e^{−1.5})); the loss grows with δ. A margin on the other class or a flipped D fails."""
    prototypes, row, label = torch.tensor([[0.0], [2.0]]), torch.tensor([[0.5]]), torch.tensor([0])
    assert float(margin_contrastive_loss(row, label, prototypes, 1.0)) == pytest.approx(math.log(2))
    by_hand = -math.log(math.exp(-0.5) / (math.exp(-0.5) + math.exp(-1.5)))
    assert float(margin_contrastive_loss(row, label, prototypes, 0.0)) == pytest.approx(by_hand)
    values = [float(margin_contrastive_loss(row, label, prototypes, m)) for m in (0.0, 0.5, 1.0, 3.0)]
    assert values == sorted(values) and len(set(values)) == 4


def test_a_row_on_its_prototype_has_a_finite_loss_and_gradient():
    """Invariant 9 (A4): no NaN from the root of a zero distance."""
    prototypes = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    loss = margin_contrastive_loss(torch.tensor([[1.0, 2.0]]), torch.tensor([0]), prototypes, 2.0)
    loss.backward()
    assert math.isfinite(float(loss.detach())) and bool(torch.isfinite(prototypes.grad).all())


def server(params: dict, d: int, c: int) -> tuple:
    algorithm = make_algorithm(build_config({"algorithm": {"name": "fedtgp", **params}}))
    ctx = ServerContext(model=torch.nn.Module(), state={}, generator=torch.Generator(), num_classes=c, feature_dim=d, seed=3)
    algorithm.init_server(ctx)
    return algorithm, ctx


def test_the_generator_shapes_and_no_prototypes_before_the_first_update():
    """Invariant 5: G(0..C−1) is C × d with C·d + d·h + h + h·d + d parameters; round 1 broadcasts nothing."""
    g = PrototypeGenerator(10, 64, 32)
    assert tuple(g().shape) == (10, 64) and sum(p.numel() for p in g.parameters()) == 10 * 64 + 64 * 32 + 32 + 32 * 64 + 64
    algorithm, ctx = server({}, d=8, c=5)
    assert len(algorithm.broadcast(ctx, RoundInfo(1, 0.01), 0)) == 0


def test_server_training_separates_the_classes_and_lowers_the_loss():
    """Invariant 4: a round of T7 on rows of two classes lowers the contrastive loss at the round's δ and moves
    P̂^0 and P̂^1 apart; every class gets a prototype (C rows with ids down, C·(4d + 8) bytes)."""
    algorithm, ctx = server({"server_epochs": 20, "server_lr": 0.05}, d=4, c=3)
    g = torch.Generator().manual_seed(0)
    rows = {0: (torch.randn(4, generator=g) + 2).tolist(), 1: (torch.randn(4, generator=g) - 2).tolist()}
    replies = {0: upload(rows), 1: upload({0: (torch.tensor(rows[0]) + 0.1).tolist()})}
    generator = PrototypeGenerator(3, 4, 4)
    set_flat(generator, ctx.state["tgp_generator"])
    with torch.no_grad():
        before = generator()
    margin = margin_of(replies, 100.0, classes=3)
    x = torch.tensor([rows[0], rows[1], (torch.tensor(rows[0]) + 0.1).tolist()])
    y = torch.tensor([0, 1, 0])
    metrics = algorithm.aggregate(ctx, RoundInfo(1, 0.01), replies)
    assert metrics["margin"] == pytest.approx(margin)
    sent = algorithm.broadcast(ctx, RoundInfo(2, 0.01), 0)
    after = ClassRows.read(sent)
    assert after.classes.tolist() == [0, 1, 2] and sent.nbytes() == 3 * (4 * 4 + 8)
    assert float(margin_contrastive_loss(x, y, after.rows, margin)) < float(margin_contrastive_loss(x, y, before, margin))
    assert float((after.rows[0] - after.rows[1]).norm()) > float((before[0] - before[1]).norm())


@pytest.mark.parametrize("timing", ["round_start", "after_training"])
def test_the_upload_is_the_eval_mean_of_the_model_of_its_timing(digits, timing):
    """Invariant 6: with round_start the rows are the eval-mode class means of the model passed into the round,
    with after_training those of the trained model; the two differ (lr > 0). Bytes |C_k|·(4d + 16)."""
    cfg = hetero_config({"name": "fedtgp", "proto_timing": timing}, clients=["resnet8"], **{"local.lr": 0.05})
    sim = Simulation(cfg, digits)
    runtime = sim.client_runtime
    model = runtime.worker_for("resnet8")
    client = runtime.context(0, 1, {})
    x, y = runtime.pipeline.clean_batch(sim.federation.train_indices[0])

    def means() -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            f = model.extract(x)
        return torch.stack([f[y == c].mean(0) for c in sorted(set(y.tolist()))])

    set_flat(model, client.initial_weights)
    start = means()
    reply = runtime.algorithm.local_update(client, RoundInfo(1, 0.05), Message())
    trained = means()
    rows = ClassRows.read(reply)
    assert rows.classes.tolist() == sorted(set(y.tolist())) and reply.nbytes() == len(rows) * (4 * 64 + 16)
    expected, other = (start, trained) if timing == "round_start" else (trained, start)
    torch.testing.assert_close(rows.rows, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(rows.rows, other, rtol=1e-4, atol=1e-5)


def test_lambda_zero_with_the_head_is_local_only_bit_for_bit(digits):
    """Invariant 7: λ = 0 and inference: head train exactly local_only's models and score them the same."""
    local = Simulation(hetero_config("local_only", clients=THREE), digits)
    local_rows = local.run()
    silent = Simulation(hetero_config({"name": "fedtgp", "lam": 0.0, "inference": "head", "server_epochs": 2}, clients=THREE), digits)
    silent_rows = silent.run()
    assert all(torch.equal(own_models(local)[c], own_models(silent)[c]) for c in range(3))
    assert [r["personal_accuracies"] for r in local_rows] == [r["personal_accuracies"] for r in silent_rows]


def test_three_architectures_bytes_and_the_nearest_prototype_accuracy(digits):
    """One run of three architectures: bytes up Σ_k |C_k|·(4d + 16), down 0 then |S|·C·(4d + 8); the personal
    accuracy is each client's trained model scored by the nearest of the server's new prototypes G(0..C−1) over all
    ten classes, recomputed here from the client states and the server's generator."""
    sim = Simulation(hetero_config({"name": "fedtgp", "server_epochs": 5}, clients=THREE), digits)
    history = sim.run()
    d, fed = 64, sim.federation
    held = [int(torch.unique(digits.train_y[ix]).numel()) for ix in fed.train_indices]
    assert [r["bytes_up"] for r in history] == [sum(h * (4 * d + 16) for h in held)] * 2
    assert [r["bytes_down"] for r in history] == [0, 3 * 10 * (4 * d + 8)]
    generator = PrototypeGenerator(10, d, d)
    set_flat(generator, sim.server.state["tgp_generator"])
    with torch.no_grad():
        prototypes = generator()
    accuracies = []
    for cid, name in enumerate(THREE):
        model = sim.client_runtime.worker_for(name)
        set_flat(model, own_models(sim)[cid])
        model.eval()
        with torch.no_grad():
            x, y = next(sim.client_runtime.pipeline.test_batches_of(fed.test_indices[cid], 10_000))
            nearest = ((model.extract(x)[:, None, :] - prototypes[None]) ** 2).sum(2).argmin(1)
        accuracies.append(100.0 * float((nearest == y).double().mean()))
    assert history[-1]["personal_accuracies"] == pytest.approx(accuracies)
    assert history[-1]["personal_accuracy"] > 0


def test_resume_after_a_kill_is_bitwise(digits, tmp_path):
    algorithm = {"name": "fedtgp", "server_epochs": 5}
    straight = Simulation(hetero_config(algorithm, clients=THREE, rounds=3), digits, run_dir=tmp_path / "a")
    full = straight.run()
    Simulation(hetero_config(algorithm, clients=THREE, rounds=2), digits, run_dir=tmp_path / "b").run()
    resumed = Simulation(hetero_config(algorithm, clients=THREE, rounds=3), digits, run_dir=tmp_path / "b")
    history = resumed.run(resume=True)
    assert without_timings(history) == without_timings(full)
    a, b = own_models(straight), own_models(resumed)
    assert all(torch.equal(a[cid], b[cid]) for cid in range(3))
    assert torch.equal(straight.server.state["tgp_generator"], resumed.server.state["tgp_generator"])


def test_the_client_term_pulls_features_towards_the_received_prototypes(digits):
    """Sign of T1: with λ > 0 one client round on a model whose features start far from the received prototypes
    ends nearer them than the same round with λ = 0."""
    def distance(lam: float) -> float:
        cfg = hetero_config({"name": "fedtgp", "lam": lam}, clients=["digits_cnn"], **{"local.lr": 0.05, "local.epochs": 3})
        sim = Simulation(cfg, digits)
        runtime = sim.client_runtime
        prototypes = torch.zeros(10, 64)
        runtime.algorithm.local_update(runtime.context(0, 1, {}), RoundInfo(1, 0.05), Message(ClassRows(torch.arange(10), prototypes).items()))
        model = runtime.worker_for("digits_cnn")
        model.eval()
        x, _ = runtime.pipeline.clean_batch(sim.federation.train_indices[0])
        with torch.no_grad():
            return float(model.extract(x).pow(2).sum(1).mean())
    assert distance(1.0) < distance(0.0)
