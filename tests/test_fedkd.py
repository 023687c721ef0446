"""FedKD (``fedkd``): a private mentor and a shared mentee distil into each other, the mentee travelling as
truncated SVD factors (spec/fedkd.md §8). Expected values are the card's numbers (ranks, bytes, the schedule, the
loss) written out on tiny tensors, or what the test computes from the clients' messages: a ≥ for the strict >, an
energy of σ for σ², a rank per slice for the pooled one, a detached S, a weighted mean fails."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_resume_bitwise, hetero_config, own_model_accuracies, shared_model_accuracies

from fedistill.algorithms.build import make_algorithm
from fedistill.algorithms.fedkd import PREFIX, compress, compressed_items, reconstruct, svd_rank
from fedistill.config import build_config
from fedistill.losses import adaptive_mutual_losses
from fedistill.models.flat import get_flat, set_flat
from fedistill.protocol import Message
from fedistill.simulation import Simulation

THREE = ["digits_cnn", "resnet8", "logistic"]


def nbytes(items: dict) -> int:
    return Message(items).nbytes()


def test_the_rank_rule_energy_and_bytes_on_a_diagonal_matrix():
    """Invariant 1: W = diag(3, 2, 1, 0.5): E = 0.95 keeps r = 3 (0.9825 > 0.95, 0.9123 is not), 4·3·9 = 108 B;
    E = 0.99 needs all four, so HtFLlib's rule sends rank 0 (zeros, 0 B) and the fixed rule the raw matrix."""
    w = torch.diag(torch.tensor([3.0, 2.0, 1.0, 0.5]))
    items, r = compress("w", w, 0.95, "htfllib")
    assert r == 3 and nbytes(items) == 4 * 3 * (4 + 4 + 1)
    kept = torch.diag(torch.tensor([3.0, 2.0, 1.0, 0.0]))
    torch.testing.assert_close(reconstruct(items, "w"), kept, atol=1e-6, rtol=0)
    items, r = compress("w", w, 0.99, "htfllib")
    assert r == 0 and nbytes(items) == 0 and torch.equal(reconstruct(items, "w"), torch.zeros(4, 4))
    items, r = compress("w", w, 0.99, "fixed")
    assert r is None and torch.equal(reconstruct(items, "w"), w) and nbytes(items) == 64
    squared = torch.tensor([9.0, 4.0, 1.0, 0.25])
    assert svd_rank(squared, 0.9123, "htfllib") == 3 and svd_rank(squared, 0.9, "htfllib") == 2
    assert svd_rank(torch.tensor([3.0, 1.0]), 0.75, "htfllib") == 0  # 3/4 is not strictly above 0.75
    assert svd_rank(torch.tensor([3.0, 1.0]), 0.75, "fixed") == 1  # the fixed rule takes ≥


def test_a_rotated_matrix_keeps_its_leading_components():
    """The SVD, not the diagonal, decides: W = Q diag(3, 2, 1) Pᵀ at E = 0.9 keeps r = 2 (13/14 > 0.9) and
    reconstructs to W minus its last component; 4·2·(3 + 3 + 1) bytes."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    p, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    w = (q * torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)) @ p.T
    items, r = compress("w", w.float(), 0.9, "htfllib")
    assert r == 2 and nbytes(items) == 4 * 2 * 7
    expected = w - torch.outer(q[:, 2], p[:, 2])
    torch.testing.assert_close(reconstruct(items, "w").double(), expected, atol=1e-5, rtol=0)


def test_a_kernel_is_cut_per_slice_at_one_pooled_rank():
    """Invariant 3: slices diag(2, 1) and diag(1, 1) pool to energies 5 and 2 of 7: E = 0.7 gives r = 1, factors
    (2,1,2,1), (2,1,1), (2,1,1,2), 4·2·1·1·5 = 40 B, each slice keeping its own leading component; E = 0.95: r = 0."""
    w = torch.zeros(2, 1, 2, 2)
    w[0, 0], w[1, 0] = torch.diag(torch.tensor([2.0, 1.0])), torch.eye(2)
    items, r = compress("k", w, 0.7, "htfllib")
    assert r == 1 and nbytes(items) == 40
    assert [tuple(items[f"{PREFIX}k.{x}"].shape) for x in "USV"] == [(2, 1, 2, 1), (2, 1, 1), (2, 1, 1, 2)]
    back = reconstruct(items, "k")
    torch.testing.assert_close(back[0, 0], torch.diag(torch.tensor([2.0, 0.0])), atol=1e-6, rtol=0)
    assert float(back[1, 0].abs().sum()) == pytest.approx(1.0, abs=1e-6)  # one unit component of the identity
    assert compress("k", w, 0.95, "htfllib")[1] == 0


def test_vectors_one_row_matrices_and_zero_tensors_travel_raw():
    for tensor in (torch.randn(5), torch.randn(1, 7), torch.zeros(3, 3)):
        items, r = compress("t", tensor, 0.95, "htfllib")
        assert r is None and list(items) == [PREFIX + "t"] and torch.equal(items[PREFIX + "t"], tensor)


def test_the_schedule():
    """Invariant 4: T_s = 0.95, T_e = 0.98, R = 20: E_0 = 0.95, E_10 = 0.965, E_19 = 0.9785; paper: 0.9515, 0.98."""
    params = make_algorithm(build_config({"algorithm": {"name": "fedkd", "schedule_rounds": 20}})).params
    assert [params.energy(t + 1) for t in (0, 10, 19)] == pytest.approx([0.95, 0.965, 0.9785])
    paper = make_algorithm(build_config({"algorithm": {"name": "fedkd", "schedule_rounds": 20, "variant": "paper"}})).params
    assert [paper.energy(1), paper.energy(20)] == pytest.approx([0.9515, 0.98])
    assert make_algorithm(build_config({"rounds": 7, "algorithm": {"name": "fedkd"}})).params.schedule_rounds == 7


def test_the_loss_value_by_hand():
    """Invariant 5: y = 0, z = [0, 0], u = [ln 3, 0], r = [1, 0], W_h r̃ = [0, 1]: L_sum = 3.159931."""
    z, u = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])
    r, mapped, y = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([0])
    ce_p, ce_g = math.log(2.0), -math.log(0.75)
    kl_qp = (0.75 * math.log(1.5) + 0.25 * math.log(0.5)) / 2
    kl_pq = (0.5 * math.log(2 / 3) + 0.5 * math.log(2.0)) / 2
    expected = ce_p + ce_g + (kl_qp + kl_pq + 2 * 1.0) / (ce_p + ce_g)
    assert expected == pytest.approx(3.159931, abs=1e-6)
    assert float(adaptive_mutual_losses(z, u, r, mapped, y)) == pytest.approx(expected, abs=1e-6)
    assert float(adaptive_mutual_losses(z, u, r, mapped, y, detach_peers=True)) == pytest.approx(expected, abs=1e-6)


def test_the_gradient_through_s_by_default_and_the_own_terms_with_detach():
    """Invariant 6 on tiny linear models: the default mentor gradient is that of the whole sum (S included);
    with detach_peers it is ∇_θ [CE_p + (KL̄(q ‖ p) + MSĒ(r, W_h r̃))/S] with S, q and r̃ constant."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 3, generator=g), torch.tensor([0, 1, 2, 1, 0])
    a, b = torch.randn(3, 3, generator=g), torch.randn(3, 3, generator=g)  # mentor: r = x a, z = r; mentee likewise

    def mentor_grad(detach):
        wa = a.clone().requires_grad_()
        r, rm = x @ wa, x @ b
        adaptive_mutual_losses(r, rm, r, rm, y, detach_peers=detach).backward()
        return wa.grad

    def card_own_terms():
        wa = a.clone().requires_grad_()
        r, rm = x @ wa, x @ b
        s = float((torch.nn.functional.cross_entropy(r, y) + torch.nn.functional.cross_entropy(rm, y)).detach())
        log_p, q = torch.log_softmax(r, 1), torch.softmax(rm, 1)
        kl = (q * (torch.log(q) - log_p)).sum() / (5 * 3)
        (torch.nn.functional.cross_entropy(r, y) + (kl + ((r - rm) ** 2).mean()) / s).backward()
        return wa.grad

    def card_whole_sum():
        wa = a.clone().requires_grad_()
        r, rm = x @ wa, x @ b
        s = torch.nn.functional.cross_entropy(r, y) + torch.nn.functional.cross_entropy(rm, y)
        p, q = torch.softmax(r, 1), torch.softmax(rm, 1)
        kls = ((q * (q.log() - p.log())).sum() + (p * (p.log() - q.log())).sum()) / (5 * 3)
        (s + (kls + 2 * ((r - rm) ** 2).mean()) / s).backward()
        return wa.grad

    torch.testing.assert_close(mentor_grad(False), card_whole_sum())
    torch.testing.assert_close(mentor_grad(True), card_own_terms())


def test_compress_none_is_the_plain_mean_and_every_client_gets_it(digits):
    """Invariants 7-8: without compression the server's mentee is the plain mean of the uploaded mentees, and
    after the next broadcast every selected client trains from it."""
    sim = Simulation(hetero_config({"name": "fedkd", "compress": "none"}, clients=THREE, rounds=1), digits)
    replies = {}
    original = sim.server_runtime.algorithm.aggregate

    def spy(server, info, got):
        replies.update(got)
        return original(server, info, got)

    sim.server_runtime.algorithm.aggregate = spy
    sim.run()
    names = [n for n, _ in sim.client_runtime.shared_worker.named_parameters()]
    sent = sim.server.state["mentee_sent"]
    for name in names:
        mean = torch.stack([replies[c][PREFIX + name].double() for c in sorted(replies)]).mean(0).float()
        assert torch.equal(sent[PREFIX + name], mean)


def test_three_architectures_bytes_from_the_ranks_and_the_mentor_evaluated(digits):
    """Invariants 2 and 10: each upload's bytes are Σ_W B(W) from the ranks in it (4r(m + n + 1), 4·O·I·r·(kh +
    kw + 1), raw 4·numel); the first broadcast is the raw mentee; the personal accuracy is each client's mentor."""
    sim = Simulation(hetero_config("fedkd", clients=THREE, rounds=2), digits)
    uploads = []
    original = sim.server_runtime.algorithm.aggregate
    sim.server_runtime.algorithm.aggregate = lambda server, info, got: (uploads.append(dict(got)), original(server, info, got))[1]
    history = sim.run()
    mentee = sim.client_runtime.shared_worker
    for round_uploads, row in zip(uploads, history):
        total = 0
        for reply in round_uploads.values():
            for name, param in mentee.named_parameters():
                if PREFIX + name in reply:
                    total += 4 * param.numel()
                    continue
                u = reply[f"{PREFIX}{name}.U"]
                r, m, n = u.shape[-1], param.shape[-2], param.shape[-1]
                slices = param.numel() // (m * n)
                total += 4 * slices * r * (m + n + 1)
        assert row["bytes_up"] == total
    assert history[0]["bytes_down"] == 3 * 4 * sum(p.numel() for p in mentee.parameters())
    assert history[-1]["personal_accuracies"] == pytest.approx(own_model_accuracies(sim, THREE))


def test_updates_with_no_movement_leave_the_mentee_and_parameters_recompress_it(digits):
    """Invariant 9: lr = 0 and mentee lr ≈ 0 (no client moves): with compress="updates" the zero updates travel raw
    and the global mentee is unchanged bitwise; with the default it becomes its own SVD reconstruction."""
    base = {"local.lr": 0.0, "rounds": 1}
    sim = Simulation(hetero_config({"name": "fedkd", "compress": "updates", "mentee_lr": 1e-30}, clients=THREE, **base), digits)
    start = sim.server.state["mentee"].clone()
    sim.run()
    assert torch.equal(sim.server.state["mentee"], start)
    sim = Simulation(hetero_config({"name": "fedkd", "mentee_lr": 1e-30}, clients=THREE, **base), digits)
    sim.run()
    mentee = sim.client_runtime.shared_worker
    set_flat(mentee, start)
    for _ in range(2):  # the clients' compression, then the server's of their (equal) mean
        items, _ = compressed_items(dict(mentee.named_parameters()), 0.95, "htfllib")
        with torch.no_grad():
            for name, p in mentee.named_parameters():
                p.copy_(reconstruct(items, name))
    torch.testing.assert_close(sim.server.state["mentee"], get_flat(mentee), atol=1e-5, rtol=0)
    assert not torch.equal(sim.server.state["mentee"], start)


def test_resume_after_a_kill_is_bitwise(digits, tmp_path):
    assert_resume_bitwise(digits, tmp_path, "fedkd", THREE, "mentee", **{"algorithm.schedule_rounds": 3})


def test_eval_model_mentee_scores_the_broadcast_mentee_on_each_clients_split(digits):
    """eval_model="mentee": the personal accuracy is the mentee rebuilt from the server's compressed mean (the
    server's global: its reconstruction) on each client's own test split."""
    sim = Simulation(hetero_config({"name": "fedkd", "eval_model": "mentee"}, clients=THREE), digits)
    history = sim.run()
    assert history[-1]["personal_accuracies"] == pytest.approx(shared_model_accuracies(sim, "mentee"))
