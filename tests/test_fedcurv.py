"""FedCurv invariants from spec/fedcurv.md §7."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import assert_learns, assert_resume_is_exact, assert_same_rounds, global_vectors

from fedistill.algorithms.fedcurv import fisher_diagonal
from fedistill.models.flat import flat_parameters
from fedistill.simulation import Simulation
from fedistill.losses import curvature_penalty


def test_lambda_zero_is_fedavg_and_round_one_is_fedavg_for_any_lambda(make_config, digits):
    assert_same_rounds(make_config(algorithm="fedavg"), make_config(**{"algorithm.name": "fedcurv", "algorithm.lam": 0.0}), digits)
    avg = global_vectors(make_config(algorithm="fedavg"), digits, 2)
    big = global_vectors(make_config(**{"algorithm.name": "fedcurv", "algorithm.lam": 5.0}), digits, 2)
    assert torch.equal(avg[0], big[0]) and not torch.equal(avg[1], big[1])


def test_fisher_is_nonnegative_and_v_is_u_times_w(make_config, digits):
    sim = Simulation(make_config(algorithm="fedcurv"), digits)
    info = sim.round_info(1)
    reply = sim.client_runtime.update(0, info, sim.server_runtime.broadcast(info, 0), {})
    u, v = reply["fisher_u"], reply["fisher_v"]
    assert bool((u >= 0).all()) and float(u.max()) > 0
    assert torch.equal(v, u * flat_parameters(sim.client_runtime.worker))


def test_fisher_pass_budget(make_config, digits):
    sim = Simulation(make_config(algorithm="fedcurv", **{"local.batch_size": 10}), digits)
    ctx = sim.client_runtime.context(0, 1, {})
    n = ctx.num_samples
    _, all_batches = fisher_diagonal(ctx, 10, budget=10 * n)
    assert all_batches == -(-n // 10)  # s >= n_k: every batch exactly once
    _, few = fisher_diagonal(ctx, 10, budget=25)
    assert few == 3  # stops after the first batch past 25 samples


def test_expanded_penalty_differs_from_explicit_by_a_constant_and_has_the_stated_gradient():
    torch.manual_seed(0)
    us = [torch.rand(6) for _ in range(3)]
    ws = [torch.randn(6) for _ in range(3)]
    p = sum(us)
    q = sum(u * w for u, w in zip(us, ws))
    lam = 0.7

    def explicit(w):
        return lam * sum(((w - wj) * uj * (w - wj)).sum() for uj, wj in zip(us, ws))

    w1, w2 = torch.randn(6), torch.randn(6)
    d_expanded = curvature_penalty([w1], [p], [q], lam) - curvature_penalty([w2], [p], [q], lam)
    assert torch.allclose(d_expanded, explicit(w1) - explicit(w2), rtol=1e-5)
    w = torch.randn(6, requires_grad=True)
    (grad,) = torch.autograd.grad(curvature_penalty([w], [p], [q], lam), [w])
    assert torch.allclose(grad, 2 * lam * (p * w.detach() - q), atol=1e-6)
    w_star = (q / p).requires_grad_(True)
    (g_star,) = torch.autograd.grad(curvature_penalty([w_star], [p], [q], lam), [w_star])
    assert float(g_star.abs().max()) < 1e-5


def test_p_excludes_the_clients_own_fisher_and_sums_are_untouched(make_config, digits):
    sim = Simulation(make_config(algorithm="fedcurv"), digits)
    sim.run_round(1)
    state = sim.server.state
    U = state["fedcurv_U"].clone()
    info = sim.round_info(2)
    stored = sorted(state["fedcurv_u"])
    inside, outside = stored[0], next(c for c in range(sim.federation.num_clients) if c not in stored)
    assert torch.allclose(sim.server_runtime.broadcast(info, inside)["fisher_p"], U - state["fedcurv_u"][inside])
    assert torch.equal(sim.server_runtime.broadcast(info, outside)["fisher_p"], U)
    assert torch.equal(state["fedcurv_U"], U)


def test_fedcurv_resumes_exactly_and_learns(digits, tmp_path):
    assert_resume_is_exact(digits, tmp_path, "fedcurv", server_keys=("fedcurv_U", "fedcurv_V"))
    assert_learns(digits, "fedcurv")


# -- fisher="per_sample" (card ambiguity 3) -------------------------------------------------------------
def _fisher_by_hand(ctx, batch_size, budget):
    """The card's per-sample estimator written as a loop: one backward pass per sample of the same batches."""
    model = ctx.model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    acc = [torch.zeros_like(p) for p in params]
    seen = 0
    for x, y in ctx.data.epoch_batches(ctx.train_indices, batch_size, ctx.generator):
        for i in range(y.shape[0]):
            grads = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params)
            for a, g in zip(acc, grads):
                a += g * g
        seen += int(y.shape[0])
        if seen > budget:
            break
    model.train()
    return torch.cat([a.reshape(-1) for a in acc]) / seen


def test_per_sample_fisher_equals_a_loop_over_single_examples(make_config, digits):
    sim = Simulation(make_config(algorithm="fedcurv"), digits)
    expected = _fisher_by_hand(sim.client_runtime.context(0, 1, {}), 10, budget=25)
    u, batches = fisher_diagonal(sim.client_runtime.context(0, 1, {}), 10, budget=25, estimator="per_sample")
    assert batches == 3 and u.shape == expected.shape
    assert torch.allclose(u, expected, rtol=1e-4, atol=1e-9)
    # With full batches, Jensen per batch: mean_i g_i² >= (mean_i g_i)², so the per-sample estimate dominates.
    batch_u, _ = fisher_diagonal(sim.client_runtime.context(0, 1, {}), 10, budget=25)
    assert bool((u >= batch_u - 1e-9).all()) and float(u.sum()) > 2 * float(batch_u.sum())


def test_per_sample_fisher_chunks_give_the_same_estimate(make_config, digits, monkeypatch):
    import fedistill.algorithms.fedcurv as fedcurv

    sim = Simulation(make_config(algorithm="fedcurv"), digits)
    whole, _ = fisher_diagonal(sim.client_runtime.context(0, 1, {}), 16, budget=40, estimator="per_sample")
    size = flat_parameters(sim.client_runtime.worker).numel()
    monkeypatch.setattr(fedcurv, "PER_SAMPLE_FLOATS", 3 * size)  # chunks of 3 samples
    chunked, _ = fisher_diagonal(sim.client_runtime.context(0, 1, {}), 16, budget=40, estimator="per_sample")
    assert torch.allclose(whole, chunked, rtol=1e-5, atol=1e-10)


def test_fedcurv_runs_with_the_per_sample_fisher(make_config, digits):
    cfg = make_config(**{"algorithm.name": "fedcurv", "algorithm.fisher": "per_sample", "rounds": 2})
    sim = Simulation(cfg, digits)
    sim.run()
    for u, v in zip(sim.server.state["fedcurv_u"].values(), sim.server.state["fedcurv_v"].values()):
        assert bool((u >= 0).all()) and float(u.max()) > 0 and torch.isfinite(v).all()
    assert sim.algorithm.params.fisher == "per_sample"


# -- own_stats="client": the server keeps only the sums (card §2, compact) ----------------------------
def test_client_kept_statistics_give_the_same_training_as_server_kept(make_config, digits):
    common = {"algorithm.name": "fedcurv", "algorithm.lam": 50.0, "rounds": 4}
    server = global_vectors(make_config(**common), digits, 4)
    client = global_vectors(make_config(**common, **{"algorithm.own_stats": "client"}), digits, 4)
    plain = global_vectors(make_config(rounds=4), digits, 4)
    for a, b in zip(server, client):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(server[-1], plain[-1], atol=1e-4)  # the penalty did act


def test_client_kept_statistics_keep_the_server_at_two_vectors(make_config, digits):
    cfg = make_config(**{"algorithm.name": "fedcurv", "algorithm.own_stats": "client", "rounds": 3})
    sim = Simulation(cfg, digits)
    sim.run()
    assert set(sim.server.state) == {"fedcurv_U", "fedcurv_V"}
    # U is the sum of every client's latest u_k, which each client holds itself.
    held = [s["fedcurv_u"].double() for s in sim.state.client_states.values()]
    assert len(held) >= 3
    assert torch.allclose(sim.server.state["fedcurv_U"], torch.stack(held).sum(0), atol=1e-9)
    # Same bytes as the server-kept mode: 2|w| of statistics each way.
    server_mode = Simulation(make_config(**{"algorithm.name": "fedcurv", "rounds": 1}), digits).run()[0]
    client_mode = Simulation(make_config(**{"algorithm.name": "fedcurv", "algorithm.own_stats": "client", "rounds": 1}), digits).run()[0]
    assert (server_mode["bytes_down"], server_mode["bytes_up"]) == (client_mode["bytes_down"], client_mode["bytes_up"])


def test_client_kept_statistics_stay_summed_when_states_are_stored_in_bf16(make_config, digits):
    """With bf16 client states each client uploads the change of the u_k it keeps (rounded), so U stays the sum
    of the held u_k: formed from the unrounded u_k, U drifted from it by 7e-3 in 4 rounds (max U about 3.7)."""
    cfg = make_config(**{"algorithm.name": "fedcurv", "algorithm.own_stats": "client", "rounds": 4, "run.client_state_dtype": "bf16"})
    sim = Simulation(cfg, digits)
    sim.run()
    held = torch.stack([s["fedcurv_u"].double() for s in sim.state.client_states.values()]).sum(0)
    assert float((sim.server.state["fedcurv_U"] - held).abs().max()) < 1e-6


def test_others_fisher_sum_is_clamped_at_zero():
    """P_k = Σ_{j≠k} u_j ≥ 0 (card §3): a float difference a rounding below zero is cut to 0 (λ P w² must not
    turn concave); Q_k keeps its sign."""
    from test_independent_expectations import Linear, hand_client, method

    algo = method("fedcurv", own_stats="client")
    client = hand_client([((1.0,), 0)], 2, Linear(1, 2), state={"fedcurv_u": torch.tensor([1.0, 2.0]), "fedcurv_v": torch.tensor([1.0, -1.0])})
    p, q = algo._others(client, {"fisher_sum_u": torch.tensor([1.0 - 1e-7, 5.0]), "fisher_sum_v": torch.tensor([0.5, -4.0])})
    assert p.tolist() == [0.0, 3.0]
    assert q.tolist() == [-0.5, -3.0]


def test_client_kept_statistics_resume_exactly(digits, tmp_path):
    assert_resume_is_exact(
        digits, tmp_path, "fedcurv", server_keys=("fedcurv_U", "fedcurv_V"), client_keys=("fedcurv_u", "fedcurv_v"),
        **{"algorithm.own_stats": "client"},
    )  # fmt: skip
