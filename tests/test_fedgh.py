"""FedGH (``fedgh``): class prototypes up, a global header trained on them by the server down, replacing every
client's head (spec/fedgh.md §8). Expected values come from the card's formulas on tiny tensors or from what the
test reads off the clients itself; a wrong sign, a sum for a mean, a count weighting or a skipped replacement fails."""

from __future__ import annotations

import pytest
import torch
from conftest import hetero_config, own_models, without_timings

from fedistill.algorithms.build import make_algorithm
from fedistill.config import build_config
from fedistill.engine.seeding import FEDGH, make_generator
from fedistill.models.flat import get_flat, set_flat
from fedistill.protocol import ClassRows, Message, RoundInfo, ServerContext
from fedistill.simulation import Simulation

THREE = ["digits_cnn", "resnet8", "logistic"]  # three families, each with a 64-wide feature on 8x8 digits


def upload(rows: dict[int, list[float]], counts: dict[int, int]) -> Message:
    classes = sorted(rows)
    table = ClassRows(torch.tensor(classes), torch.tensor([rows[c] for c in classes]), torch.tensor([counts[c] for c in classes]))
    return Message(table.items())


def server_round(params: dict, replies: dict[int, Message], header: torch.Tensor, d: int, c: int, batch: int = 10):
    """One server update of ``header`` (flat W then b) on ``replies``; returns the broadcast header (W, b)."""
    algorithm = make_algorithm(build_config({"algorithm": {"name": "fedgh", "server_batch_size": batch, **params}}))
    server = ServerContext(model=torch.nn.Module(), state={}, generator=torch.Generator(), num_classes=c, feature_dim=d, seed=7)
    algorithm.init_server(server)
    server.state["header"] = header.clone()
    algorithm.aggregate(server, RoundInfo(1, 0.01), replies)
    sent = algorithm.broadcast(server, RoundInfo(2, 0.01), 0)["header"]
    return sent[: d * c].reshape(c, d), sent[d * c :]


def test_one_server_step_by_hand():
    """Invariant 2: W = 0, b = 0, U = {([1,0],0), ([0,1],1)}, one batch, η_s = 1: the gradient of the mean CE is
    (1/2)[[−½, ½], [½, −½]], so W ← [[0.25, −0.25], [−0.25, 0.25]], b unchanged. A flipped sign or a sum fails."""
    replies = {0: upload({0: [1, 0], 1: [0, 1]}, {0: 5, 1: 3})}
    w, b = server_round({"server_lr": 1.0}, replies, torch.zeros(6), d=2, c=2)
    assert w.tolist() == [[0.25, -0.25], [-0.25, 0.25]] and b.tolist() == [0.0, 0.0]


def test_the_header_after_one_server_epoch_is_hand_written_sgd_on_the_shuffled_rows():
    """GH4 with several batches: rows of two clients stacked in client-id order, permuted by the round's FedGH
    stream, batches of 2 (the last partial kept), per batch W -= η·(softmax − onehot)ᵀ p / |b| and b -= η·mean
    (softmax − onehot), every row once whatever its count (invariant 3: doubling the counts changes nothing)."""
    g = torch.Generator().manual_seed(3)
    a = {0: torch.randn(3, generator=g).tolist(), 2: torch.randn(3, generator=g).tolist()}
    bb = {0: torch.randn(3, generator=g).tolist(), 1: torch.randn(3, generator=g).tolist(), 3: torch.randn(3, generator=g).tolist()}
    start = torch.randn(4 * 3 + 4, generator=g)
    replies = {0: upload(a, {0: 4, 2: 1}), 1: upload(bb, {0: 2, 1: 2, 3: 9})}
    w, b = server_round({"server_lr": 0.5}, replies, start, d=3, c=4, batch=2)
    rows = torch.tensor([a[0], a[2], bb[0], bb[1], bb[3]], dtype=torch.float64)
    labels = torch.tensor([0, 2, 0, 1, 3])
    W, B = start[:12].reshape(4, 3).double(), start[12:].double()
    order = torch.randperm(5, generator=make_generator(7, FEDGH, 1))
    for s in range(0, 5, 2):
        ix = order[s : s + 2]
        err = torch.softmax(rows[ix] @ W.T + B, 1) - torch.nn.functional.one_hot(labels[ix], 4).double()
        W, B = W - 0.5 * err.T @ rows[ix] / len(ix), B - 0.5 * err.mean(0)
    torch.testing.assert_close(w.double(), W, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.double(), B, rtol=1e-5, atol=1e-6)
    doubled = {0: upload(a, {0: 8, 2: 2}), 1: upload(bb, {0: 4, 1: 4, 3: 18})}
    w2, b2 = server_round({"server_lr": 0.5}, doubled, start, d=3, c=4, batch=2)
    assert torch.equal(w, w2) and torch.equal(b, b2)


def test_a_server_step_lowers_the_header_loss_and_zero_epochs_leave_it():
    """Sign: one step on the rows lowers their mean CE; invariant 6: E_s = 0 leaves the header as it was."""
    g = torch.Generator().manual_seed(5)
    rows = {c: torch.randn(4, generator=g).tolist() for c in range(3)}
    start = torch.randn(4 * 3 + 3, generator=g)
    ce = lambda w, b: float(torch.nn.functional.cross_entropy(torch.tensor([rows[c] for c in range(3)]) @ w.T + b, torch.arange(3)))  # noqa: E731
    w, b = server_round({"server_lr": 0.1}, {0: upload(rows, {0: 1, 1: 1, 2: 1})}, start, d=4, c=3)
    assert ce(w, b) < ce(start[:12].reshape(3, 4), start[12:])
    w0, b0 = server_round({"server_epochs": 0}, {0: upload(rows, {0: 1, 1: 1, 2: 1})}, start, d=4, c=3)
    assert torch.equal(torch.cat([w0.flatten(), b0]), start)


@pytest.mark.parametrize("architecture", ["digits_cnn", "resnet8"])
def test_the_client_head_is_the_header_and_the_upload_the_eval_mean_of_its_classes(digits, architecture):
    """Invariants 1, 4, 5 on one client with lr = 0: its head after the round is the broadcast header bit for bit;
    the prototype of c is the eval-mode mean of f_k over D_k^c with count |D_k^c|; only its classes travel,
    |C_k|·(4d + 16) bytes; the reported loss is plain CE of the model with the header. On ResNet-8 (BatchNorm) the
    round's training still moves the running statistics, and the means are those of eval mode, not of the batch
    statistics a train-mode pass would use."""
    cfg = hetero_config("fedgh", clients=[architecture], **{"local.lr": 0.0})
    sim = Simulation(cfg, digits)
    runtime = sim.client_runtime
    model = runtime.worker_for(architecture)
    header = torch.randn(64 * 10 + 10, generator=torch.Generator().manual_seed(2))
    reply = runtime.algorithm.local_update(runtime.context(1, 1, {}), RoundInfo(1, 0.0), Message(header=header))
    model.eval()
    with torch.no_grad():
        x, y = runtime.pipeline.clean_batch(sim.federation.train_indices[1])
        features, logits = model.extract(x), model(x)
    assert torch.equal(get_flat(model.classifier), header)
    rows = ClassRows.read(reply)
    held = sorted(set(y.tolist()))
    assert rows.classes.tolist() == held and reply.nbytes() == len(held) * (4 * 64 + 16)
    for c, row, n in zip(held, rows.rows, rows.counts.tolist()):
        assert n == int((y == c).sum())
        torch.testing.assert_close(row, features[y == c].mean(0), rtol=1e-5, atol=1e-5)
    if architecture == "digits_cnn":  # no BatchNorm: lr = 0 leaves the model as the loss saw it
        assert reply["metric.train_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-3)
    else:  # train-mode features (batch statistics) are another thing: the test tells them apart
        model.train()
        with torch.no_grad():
            batch_stats = model.extract(x)
        model.eval()
        assert not torch.allclose(rows.rows[0], batch_stats[y == held[0]].mean(0), rtol=1e-3, atol=1e-3)


def test_evaluation_uses_the_global_header_not_the_trained_head(digits):
    """Invariant 7: assembled with a zero header, every prediction is class 0 whatever the client's trained head."""
    sim = Simulation(hetero_config("fedgh", clients=THREE), digits)
    sim.run()
    runtime = sim.client_runtime
    client = runtime.context(0, 3, sim.server_runtime.client_store.load(0))
    runtime.algorithm.assemble_personal_model(client, Message(header=torch.zeros(64 * 10 + 10)))
    with torch.no_grad():
        x, _ = runtime.pipeline.clean_batch(sim.federation.test_indices[0])
        predictor = runtime.algorithm.personal_predictor(client)
        predictor.eval()
        assert bool((predictor(x).argmax(1) == 0).all())


def test_three_architectures_bytes_and_the_header_accuracy(digits):
    """One run of three architectures: bytes up Σ_k |C_k|·(4d + 16), down |S|·4(dC + C) every round; the personal
    accuracy is each client's trained extractor with the server's new header on its own test split."""
    sim = Simulation(hetero_config("fedgh", clients=THREE), digits)
    history = sim.run()
    d, fed = 64, sim.federation
    held = [int(torch.unique(digits.train_y[ix]).numel()) for ix in fed.train_indices]
    assert [r["bytes_up"] for r in history] == [sum(h * (4 * d + 16) for h in held)] * 2
    assert [r["bytes_down"] for r in history] == [3 * 4 * (d * 10 + 10)] * 2
    header = sim.server.state["header"]
    accuracies = []
    for cid, name in enumerate(THREE):
        model = sim.client_runtime.worker_for(name)
        set_flat(model, own_models(sim)[cid])
        set_flat(model.classifier, header)
        model.eval()
        with torch.no_grad():
            x, y = next(sim.client_runtime.pipeline.test_batches_of(fed.test_indices[cid], 10_000))
            accuracies.append(100.0 * float((model(x).argmax(1) == y).double().mean()))
    assert history[-1]["personal_accuracies"] == pytest.approx(accuracies)
    assert history[-1]["personal_accuracy"] > 0


def test_resume_after_a_kill_is_bitwise(digits, tmp_path):
    straight = Simulation(hetero_config("fedgh", clients=THREE, rounds=3), digits, run_dir=tmp_path / "a")
    full = straight.run()
    Simulation(hetero_config("fedgh", clients=THREE, rounds=2), digits, run_dir=tmp_path / "b").run()
    resumed = Simulation(hetero_config("fedgh", clients=THREE, rounds=3), digits, run_dir=tmp_path / "b")
    history = resumed.run(resume=True)
    assert without_timings(history) == without_timings(full)
    a, b = own_models(straight), own_models(resumed)
    assert all(torch.equal(a[cid], b[cid]) for cid in range(3))
    assert torch.equal(straight.server.state["header"], resumed.server.state["header"])
