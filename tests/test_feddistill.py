"""FD (``fd``, FedDistill): per-class mean logits up, their average down, distillation towards it (spec/fd.md §8).

Every expected value is computed here from the card's formulas on tiny tensors, or from the uploads the test reads
itself; a wrong sign, weighting, divisor or aggregation fails a test. (tests/test_fd.py is FedGKT's family.)
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import hetero_config, own_models, without_timings

from fedistill.algorithms.build import make_algorithm
from fedistill.class_losses import class_table_distillation
from fedistill.config import build_config
from fedistill.protocol import ClassRows, Message, RoundInfo, ServerContext
from fedistill.simulation import Simulation

THREE = ["digits_cnn", "mlp", "resnet8"]  # three families; FD needs only the shared label space
LIGHT = ["digits_cnn", "mlp", "logistic"]  # the same without BatchNorm, where three architectures are not the point


def fd_config(algorithm="fd", clients=THREE, **overrides):
    """hetero_config at the card's lr 0.01: HtFLlib's raw-logit target is unbounded below, and at small_config's 0.05
    a client's loss runs off to −inf within three rounds (spec/fd.md ambiguity 1)."""
    return hetero_config(algorithm, clients=clients, **{"local.lr": 0.01, **overrides})


def upload(rows: dict[int, list[float]], counts: dict[int, int]) -> Message:
    classes = sorted(rows)
    table = ClassRows(torch.tensor(classes), torch.tensor([rows[c] for c in classes]), torch.tensor([counts[c] for c in classes]))
    return Message(table.items())


def server_after(params: dict, replies: dict[int, Message], num_classes: int = 3):
    algorithm = make_algorithm(build_config({"algorithm": {"name": "fd", **params}}))
    server = ServerContext(model=torch.nn.Module(), state={}, generator=torch.Generator(), num_classes=num_classes)
    algorithm.aggregate(server, RoundInfo(1, 0.01), replies)
    return algorithm, server


def table_of(msg: Message) -> dict[int, list[float]]:
    rows = ClassRows.read(msg)
    return {} if rows is None else {int(c): r.tolist() for c, r in zip(rows.classes, rows.rows)}


# The card's uploads (invariant 1): A {0: [1,0,0] (n 1), 2: [0,0,3] (n 5)}, B {0: [3,0,0] (n 100)}, C {1: [0,2,0]}.
A = upload({0: [1, 0, 0], 2: [0, 0, 3]}, {0: 1, 2: 5})
B = upload({0: [3, 0, 0]}, {0: 100})
C = upload({1: [0, 2, 0]}, {1: 7})


def test_the_teacher_of_a_class_is_the_unweighted_mean_of_its_holders_own_row_included():
    """Invariant 1: T = {0: [2,0,0], 1: [0,2,0], 2: [0,0,3]} for every client, nothing else; a count-weighted mean
    would give [2.98,0,0] for class 0 (that is the teacher_weighting: count switch)."""
    algorithm, server = server_after({}, {0: A, 1: B, 2: C})
    for cid in (0, 1, 2, 7):  # the same table for every client, one that did not take part included
        assert table_of(algorithm.broadcast(server, RoundInfo(2, 0.01), cid)) == {0: [2, 0, 0], 1: [0, 2, 0], 2: [0, 0, 3]}
    algorithm, server = server_after({"teacher_weighting": "count"}, {0: A, 1: B, 2: C})
    assert table_of(algorithm.broadcast(server, RoundInfo(2, 0.01), 0))[0] == pytest.approx([(1 * 1 + 3 * 100) / 101, 0, 0])
    # rebuilt from the round's uploads only (ambiguity 7): a round where only C uploads leaves C's class alone
    algorithm.aggregate(server, RoundInfo(2, 0.01), {2: C})
    assert table_of(algorithm.broadcast(server, RoundInfo(3, 0.01), 0)) == {1: [0, 2, 0]}


def test_exclude_self_is_the_mean_of_the_other_holders():
    """Invariant 2: A's teacher for class 0 is B's row, A gets no row for class 2 (its only holder); B's is A's."""
    algorithm, server = server_after({"exclude_self": True}, {0: A, 1: B, 2: C})
    assert table_of(algorithm.broadcast(server, RoundInfo(2, 0.01), 0)) == {0: [3, 0, 0], 1: [0, 2, 0]}
    assert table_of(algorithm.broadcast(server, RoundInfo(2, 0.01), 1)) == {0: [1, 0, 0], 1: [0, 2, 0], 2: [0, 0, 3]}


def test_the_distillation_value_by_hand():
    """Invariant 4: z = [[1,2,0],[0,0,0]], y = [0,1], teacher {0: [2,−1,0]}, none for 1: the KD part is
    (1/2)·−(2·log σ(z_0)_0 − 1·log σ(z_0)_1); the second row adds 0 but counts in the divisor 2. With a probability
    teacher [0.7,0.2,0.1] for class 0 it is the ordinary soft-target cross-entropy."""
    z = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    y = torch.tensor([0, 1])
    log_norm = math.log(math.e**1 + math.e**2 + 1)
    log_s0, log_s1 = 1 - log_norm, 2 - log_norm
    table, present = ClassRows(torch.tensor([0]), torch.tensor([[2.0, -1.0, 0.0]])).dense(3)
    assert float(class_table_distillation(z, y, table, present)) == pytest.approx(0.5 * -(2 * log_s0 - 1 * log_s1), rel=1e-6)
    probs, present = ClassRows(torch.tensor([0]), torch.tensor([[0.7, 0.2, 0.1]])).dense(3)
    expected = 0.5 * -(0.7 * log_s0 + 0.2 * log_s1 + 0.1 * (0 - log_norm))
    assert float(class_table_distillation(z, y, probs, present)) == pytest.approx(expected, rel=1e-6)


def test_a_step_on_the_distillation_term_moves_the_logits_towards_a_probability_teacher():
    """Invariant 5 (sign): one SGD step on the term alone raises Σ_j t_j log σ(z)_j; the teacher gets no gradient."""
    z = torch.tensor([[0.5, -1.0, 2.0], [1.0, 1.0, 0.0]], requires_grad=True)
    y = torch.tensor([0, 0])
    table, present = ClassRows(torch.tensor([0]), torch.tensor([[0.6, 0.3, 0.1]])).dense(3)
    before = table.clone()

    def fit() -> float:
        return float((table[y] * torch.log_softmax(z.detach(), 1)).sum())

    start = fit()
    class_table_distillation(z, y, table, present).backward()
    with torch.no_grad():
        z -= 0.5 * z.grad
    assert fit() > start
    assert table.grad is None and torch.equal(table, before)  # invariant 7


@pytest.mark.parametrize("teacher", ["logits", "softmax", "probs"])
def test_the_upload_is_the_mean_of_the_recorded_outputs_and_the_loss_is_fd1(digits, teacher):
    """Invariants 3 and 4 end to end: with lr = 0 (the model does not move) and no dropout/BN, client k's row of
    class c is the mean of its model's logits (``probs``: softmax probabilities) over its class-c samples and its
    count is E·|D_k^c| (two epochs); the reported loss is the mean over samples of CE + λ·(−Σ_j t_j log σ(z)_j),
    t the received row as given (``softmax``: its softmax), 0 for a class without one. The teacher is untouched."""
    cfg = fd_config(algorithm={"name": "fd", "teacher": teacher, "lam": 0.5}, clients=["mlp"], **{"local.lr": 0.0, "local.epochs": 2})
    sim = Simulation(cfg, digits)
    runtime = sim.client_runtime
    indices = sim.federation.train_indices[1]
    model = runtime.worker_for("mlp")
    with torch.no_grad():
        x, y = runtime.pipeline.clean_batch(indices)
        logits = model(x)
    held = sorted(set(y.tolist()))
    rows = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    sent = Message(ClassRows(torch.tensor(held[:2]), rows).items())  # a teacher for two of the held classes only
    kept = {k: v.clone() for k, v in sent.tensors().items()}
    reply = runtime.algorithm.local_update(runtime.context(1, 1, {}), RoundInfo(1, 0.0), sent)
    assert all(torch.equal(sent[k], v) for k, v in kept.items())
    uploaded = ClassRows.read(reply)
    assert uploaded.classes.tolist() == held  # only held classes travel
    recorded = logits.softmax(1) if teacher == "probs" else logits
    for c, row, n in zip(held, uploaded.rows, uploaded.counts.tolist()):
        assert n == 2 * int((y == c).sum())
        torch.testing.assert_close(row, recorded[y == c].mean(0), rtol=1e-5, atol=1e-6)
    targets = rows.softmax(1) if teacher == "softmax" else rows
    kd = torch.zeros(len(y))
    for t, c in zip(targets, held[:2]):
        kd[y == c] = -(t * logits[y == c].log_softmax(1)).sum(1)
    expected = torch.nn.functional.cross_entropy(logits, y, reduction="none") + 0.5 * kd
    assert reply["metric.train_loss"] == pytest.approx(float(expected.double().mean()), rel=1e-5)


def test_lambda_zero_and_the_first_round_are_local_only_bit_for_bit(digits):
    """Invariant 6: λ = 0 trains exactly local_only's models; with λ = 1 the first round (no teacher yet) is
    local_only's too, and the second is not (the teacher pulls)."""
    local = Simulation(fd_config("local_only", clients=LIGHT), digits)
    local.run()
    silent = Simulation(fd_config({"name": "fd", "lam": 0.0}, clients=LIGHT), digits)
    silent.run()
    assert all(torch.equal(own_models(local)[c], own_models(silent)[c]) for c in range(3))
    fd = Simulation(fd_config(clients=LIGHT), digits)
    fd.run_round(1)
    first = Simulation(fd_config("local_only", clients=LIGHT, rounds=1), digits)
    assert first.run()[0]["train_loss"] == fd.state.history[0]["train_loss"]
    assert all(torch.equal(own_models(first)[c], own_models(fd)[c]) for c in range(3))
    fd.run_round(2)
    assert not any(torch.equal(own_models(local)[c], own_models(fd)[c]) for c in range(3))


def test_bytes_are_the_held_classes_rows_ids_and_counts_with_three_architectures(digits):
    """Invariant 8 and §5: up Σ_k |C_k|·(4C + 16), down 0 then Σ_k |G|·(4C + 8), from the clients' own labels;
    a dense C × C upload (or a counted training loss) fails it. Three architectures train side by side."""
    sim = Simulation(fd_config(), digits)
    history = sim.run()
    c = digits.num_classes
    held = [int(torch.unique(digits.train_y[ix]).numel()) for ix in sim.federation.train_indices]
    union = int(torch.unique(torch.cat([digits.train_y[ix] for ix in sim.federation.train_indices])).numel())
    assert [r["bytes_up"] for r in history] == [sum(h * (4 * c + 16) for h in held)] * 2
    assert [r["bytes_down"] for r in history] == [0, 3 * union * (4 * c + 8)]
    assert [r["teacher_classes"] for r in history] == [union, union]
    assert all(r["test_accuracy"] is None and 0 < r["personal_accuracy"] <= 100 for r in history)


def test_resume_after_a_kill_is_bitwise(digits, tmp_path):
    straight = Simulation(fd_config(rounds=3), digits, run_dir=tmp_path / "a")
    full = straight.run()
    Simulation(fd_config(rounds=2), digits, run_dir=tmp_path / "b").run()
    resumed = Simulation(fd_config(rounds=3), digits, run_dir=tmp_path / "b")
    history = resumed.run(resume=True)
    assert without_timings(history) == without_timings(full)
    a, b = own_models(straight), own_models(resumed)
    assert all(torch.equal(a[cid], b[cid]) for cid in range(3))
    for key in ("teacher_classes", "teacher_rows"):
        assert torch.equal(straight.server.state[key], resumed.server.state[key])


def test_fd_cannot_be_combined_with_weight_averaging_parts():
    from fedistill.errors import ConfigError

    with pytest.raises(ConfigError, match="not a parameter-averaging method"):
        make_algorithm(build_config({"algorithm": {"name": "fd", "plus": ["fedprox"]}}))
