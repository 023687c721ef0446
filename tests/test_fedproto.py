"""FedProto (``fedproto``): class prototypes up, their mean down, features pulled towards it, nearest-prototype
inference (spec/fedproto.md §8). Expected values come from the card's formulas on tiny tensors or from what the
test reads off the clients itself; a wrong sign, weighting, divisor or aggregation fails a test."""

from __future__ import annotations

import pytest
import torch
from conftest import hetero_config, own_models, without_timings

from fedistill.algorithms.build import make_algorithm
from fedistill.class_losses import nearest_prototype_scores, prototype_regulariser
from fedistill.config import build_config
from fedistill.errors import ConfigError
from fedistill.models.flat import set_flat
from fedistill.protocol import ClassRows, Message, RoundInfo, ServerContext
from fedistill.simulation import Simulation

THREE = ["digits_cnn", "resnet8", "logistic"]  # three families, each with a 64-wide feature on 8x8 digits


def upload(rows: dict[int, list[float]], counts: dict[int, int]) -> Message:
    classes = sorted(rows)
    table = ClassRows(torch.tensor(classes), torch.tensor([rows[c] for c in classes]), torch.tensor([counts[c] for c in classes]))
    return Message(table.items())


def global_prototypes(params: dict, replies: dict[int, Message]) -> dict[int, list[float]]:
    algorithm = make_algorithm(build_config({"algorithm": {"name": "fedproto", **params}}))
    server = ServerContext(model=torch.nn.Module(), state={}, generator=torch.Generator(), num_classes=3)
    algorithm.aggregate(server, RoundInfo(1, 0.01), replies)
    rows = ClassRows.read(algorithm.broadcast(server, RoundInfo(2, 0.01), 0))
    return {int(c): r.tolist() for c, r in zip(rows.classes, rows.rows)}


def test_the_global_prototype_is_the_unweighted_mean_of_the_holders():
    """Invariant 1: A {0: [1,1] (n 1), 1: [0,4] (n 2)}, B {0: [3,−1] (n 99)} give G = {0: [2,0], 1: [0,4]}; the
    count-weighted mean (proto_weighting: count, the paper's P4) gives [2.98, −0.98] for class 0."""
    replies = {0: upload({0: [1, 1], 1: [0, 4]}, {0: 1, 1: 2}), 1: upload({0: [3, -1]}, {0: 99})}
    assert global_prototypes({}, replies) == {0: [2, 0], 1: [0, 4]}
    weighted = global_prototypes({"proto_weighting": "count"}, replies)
    assert weighted[0] == pytest.approx([(1 + 3 * 99) / 100, (1 - 99) / 100]) and weighted[1] == [0, 4]


def test_the_regulariser_value_by_hand_with_its_divisor():
    """Invariant 4: r = [[1,0],[0,0]], y = [0,1], G = {0: [0,0]}, λ = 10, d = 2, |b| = 2: 10·1/(2·2) = 2.5 (5.0 if
    the divisor were |b| alone, or if the row without a prototype were dropped from it)."""
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    prototypes, present = ClassRows(torch.tensor([0]), torch.tensor([[0.0, 0.0]])).dense(3)
    assert 10 * float(prototype_regulariser(r, torch.tensor([0, 1]), prototypes, present)) == pytest.approx(2.5)


def test_a_step_on_the_regulariser_pulls_each_feature_towards_its_prototype_and_not_the_prototype():
    """Invariants 5 and 8: one SGD step on the term alone shrinks every distance to the label's prototype; the
    prototypes get no gradient and stay as they were."""
    r = torch.tensor([[1.0, 2.0], [-3.0, 0.5], [0.0, 4.0]], requires_grad=True)
    y = torch.tensor([0, 2, 2])
    prototypes, present = ClassRows(torch.tensor([0, 2]), torch.tensor([[0.0, 0.0], [1.0, 1.0]])).dense(3)
    before, distance = prototypes.clone(), lambda: (r.detach() - prototypes[y]).norm(dim=1)  # noqa: E731
    start = distance()
    prototype_regulariser(r, y, prototypes, present).backward()
    with torch.no_grad():
        r -= 1.0 * r.grad
    assert bool((distance() < start).all())
    assert prototypes.grad is None and torch.equal(prototypes, before)


def test_nearest_prototype_inference_never_predicts_a_class_without_one():
    """Invariant 7: G = {0: [0,0], 2: [10,10]}, features [[1,1],[9,9],[6,6]] → [0, 2, 2]; class 1 has no prototype."""
    prototypes, present = ClassRows(torch.tensor([0, 2]), torch.tensor([[0.0, 0.0], [10.0, 10.0]])).dense(3)
    scores = nearest_prototype_scores(torch.tensor([[1.0, 1.0], [9.0, 9.0], [6.0, 6.0]]), prototypes, present)
    assert scores.argmax(1).tolist() == [0, 2, 2] and bool((scores[:, 1] == float("-inf")).all())


def test_the_upload_is_the_mean_feature_of_each_held_class_and_the_loss_is_p1(digits):
    """Invariants 2-4 end to end: with lr = 0 and no dropout/BN the prototype of c is the mean of f_k(x) over D_k^c,
    its count E·|D_k^c|; only the client's own classes travel, |C_k|·(4d + 16) bytes; ``after_training`` gives the
    same rows (eval mode, the model did not move) with counts |D_k^c|. The reported loss is the mean over samples
    of CE + λ·‖r − P̄^y‖²/d for the classes with a received prototype (P1), and the prototypes are left as sent."""
    for timing, epochs in (("training", 2), ("after_training", 1)):
        algorithm = {"name": "fedproto", "proto_timing": timing}
        cfg = hetero_config(algorithm, clients=["digits_cnn"], **{"local.lr": 0.0, "local.epochs": epochs})
        sim = Simulation(cfg, digits)
        runtime = sim.client_runtime
        model = runtime.worker_for("digits_cnn")
        with torch.no_grad():
            x, y = runtime.pipeline.clean_batch(sim.federation.train_indices[2])
            features, logits = model.extract(x), model(x)
        held = sorted(set(y.tolist()))
        received = torch.rand(2, 64, generator=torch.Generator().manual_seed(1))
        sent = Message(ClassRows(torch.tensor(held[:2]), received).items())
        reply = runtime.algorithm.local_update(runtime.context(2, 1, {}), RoundInfo(1, 0.0), sent)
        assert torch.equal(sent["rows"], received)
        rows = ClassRows.read(reply)
        assert rows.classes.tolist() == held
        assert reply.nbytes() == len(rows) * (4 * 64 + 16)  # |C_k|·(4d + 16), the training loss uncounted
        for c, row, n in zip(held, rows.rows, rows.counts.tolist()):
            assert n == epochs * int((y == c).sum())
            torch.testing.assert_close(row, features[y == c].mean(0), rtol=1e-5, atol=1e-5)
        pull = torch.zeros(len(y))
        for prototype, c in zip(received, held[:2]):
            pull[y == c] = ((features[y == c] - prototype) ** 2).sum(1) / 64
        expected = torch.nn.functional.cross_entropy(logits, y, reduction="none") + 10.0 * pull
        assert reply["metric.train_loss"] == pytest.approx(float(expected.double().mean()), rel=1e-5)


def test_lambda_zero_with_the_head_is_local_only_bit_for_bit(digits):
    """Invariant 6: λ = 0 and inference: head train exactly local_only's models and score them the same."""
    local = Simulation(hetero_config("local_only", clients=THREE), digits)
    local_rows = local.run()
    silent = Simulation(hetero_config({"name": "fedproto", "lam": 0.0, "inference": "head"}, clients=THREE), digits)
    silent_rows = silent.run()
    assert all(torch.equal(own_models(local)[c], own_models(silent)[c]) for c in range(3))
    assert [r["personal_accuracies"] for r in local_rows] == [r["personal_accuracies"] for r in silent_rows]


def test_three_architectures_bytes_and_the_nearest_prototype_accuracy(digits):
    """One run of three architectures (a common 64-wide feature): bytes up Σ_k |C_k|·(4d + 16), down 0 then
    |S|·|G|·(4d + 8); and the personal accuracy is each client's trained model scored by the nearest new global
    prototype on its own test split, recomputed here from the client states and the server's prototypes."""
    sim = Simulation(hetero_config("fedproto", clients=THREE), digits)
    history = sim.run()
    d, fed = 64, sim.federation
    held = [int(torch.unique(digits.train_y[ix]).numel()) for ix in fed.train_indices]
    union = int(torch.unique(torch.cat([digits.train_y[ix] for ix in fed.train_indices])).numel())
    assert [r["bytes_up"] for r in history] == [sum(h * (4 * d + 16) for h in held)] * 2
    assert [r["bytes_down"] for r in history] == [0, 3 * union * (4 * d + 8)]
    assert all(r["test_accuracy"] is None for r in history)
    prototypes, present = ClassRows(sim.server.state["prototype_classes"], sim.server.state["prototype_rows"]).dense(10)
    accuracies = []
    for cid, name in enumerate(THREE):
        model = sim.client_runtime.worker_for(name)
        set_flat(model, own_models(sim)[cid])
        model.eval()
        with torch.no_grad():
            x, y = next(sim.client_runtime.pipeline.test_batches_of(fed.test_indices[cid], 10_000))
            r = model.extract(x)
        nearest = ((r[:, None, :] - prototypes[None]) ** 2).sum(2).masked_fill(~present, float("inf")).argmin(1)
        accuracies.append(100.0 * float((nearest == y).double().mean()))
    assert history[-1]["personal_accuracies"] == pytest.approx(accuracies)
    assert history[-1]["personal_accuracy"] > 0


def test_clients_whose_features_differ_in_width_are_refused_in_one_line(digits):
    expected = r"^model\.clients: fedproto uploads class prototypes .* one feature dimension; got \{'digits_cnn': 64, 'mlp': 200\}"
    with pytest.raises(ConfigError, match=expected) as err:
        Simulation(hetero_config("fedproto", clients=["digits_cnn", "mlp"]), digits)
    assert "\n" not in str(err.value)


def test_resume_after_a_kill_is_bitwise(digits, tmp_path):
    straight = Simulation(hetero_config("fedproto", clients=THREE, rounds=3), digits, run_dir=tmp_path / "a")
    full = straight.run()
    Simulation(hetero_config("fedproto", clients=THREE, rounds=2), digits, run_dir=tmp_path / "b").run()
    resumed = Simulation(hetero_config("fedproto", clients=THREE, rounds=3), digits, run_dir=tmp_path / "b")
    history = resumed.run(resume=True)
    assert without_timings(history) == without_timings(full)
    a, b = own_models(straight), own_models(resumed)
    assert all(torch.equal(a[cid], b[cid]) for cid in range(3))
    for key in ("prototype_classes", "prototype_rows"):
        assert torch.equal(straight.server.state[key], resumed.server.state[key])
