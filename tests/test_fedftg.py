"""FedFTG invariants (spec/fedftg.md §7), its generators, and the server-refiner hook end to end on digits."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_learns, assert_resume_is_exact, assert_same_rounds, small_config
from torch import nn

from fedistill.algorithms.fedftg import GENERATOR_KEY, FedFTGParams, TeacherEnsemble, server_fine_tune
from fedistill.engine.seeding import FEDFTG, make_generator
from fedistill.engine.simulation import Simulation
from fedistill.errors import ConfigError
from fedistill.losses import (
    class_ensemble_weights,
    customized_label_distribution,
    diversity_loss,
    ensemble_distribution,
    model_discrepancy,
    soft_cross_entropy,
    stratified_labels,
    weighted_classification_loss,
)
from fedistill.models import build_generator
from fedistill.models.flat import get_flat
from fedistill.registry import GENERATORS

M = 10


def random_counts(gen: torch.Generator, k: int = 5, m: int = M) -> torch.Tensor:
    """Label-skewed (K, M) counts with many zeros, including whole classes nobody holds."""
    counts = torch.randint(0, 40, (k, m), generator=gen)
    counts[torch.rand(k, m, generator=gen) < 0.5] = 0
    counts[:, -1] = 0  # a trailing class nobody holds (the float-cumsum trap of ambiguity 7)
    counts[0, 0] += 1  # a positive total
    return counts


# -- label statistics (Eqs. 9-10, StratifiedLabels) ------------------------------------------------
def test_ensemble_weights_sum_to_one_over_holders_and_vanish_without_samples():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        counts = random_counts(gen)
        alpha = class_ensemble_weights(counts)
        pooled = counts.sum(0)
        held = pooled > 0
        assert torch.allclose(alpha[:, held].sum(0), torch.ones(int(held.sum())), atol=1e-6)
        assert bool((alpha >= 0).all())
        assert bool((alpha[:, held][counts[:, held] == 0] == 0).all())
        # Zero-count rule: a class nobody holds gets 1/|S_t| from everyone.
        assert torch.equal(alpha[:, ~held], torch.full_like(alpha[:, ~held], 1.0 / counts.shape[0]))
    # By hand: classes 0 and 1 split 3:1 and 0:2.
    alpha = class_ensemble_weights(torch.tensor([[3, 0], [1, 2]]))
    assert torch.allclose(alpha, torch.tensor([[0.75, 0.0], [0.25, 1.0]]))


def test_label_distribution_and_stratified_labels():
    gen = torch.Generator().manual_seed(1)
    for trial in range(60):
        counts = random_counts(gen)
        p = customized_label_distribution(counts)
        assert abs(float(p.sum()) - 1.0) < 1e-12
        assert torch.equal(p == 0, counts.sum(0) == 0)
        n = [1, 7, 50, 500, 499][trial % 5]
        labels = stratified_labels(n, counts.sum(0), gen)
        assert labels.shape == (n,) and labels.dtype == torch.int64
        got = torch.bincount(labels, minlength=M).double()
        assert bool((got[p == 0] == 0).all()), "a class no selected client holds was drawn"
        assert bool(((got - n * p).abs() < 1).all())
    # Integer edges: 3 labels over counts (1, 1, 1, 0) give one of each held class, never the last.
    assert sorted(stratified_labels(3, torch.tensor([1, 1, 1, 0])).tolist()) == [0, 1, 2]


# -- the student's loss (card §3 (d)) ----------------------------------------------------------------
def test_ensemble_rows_sum_to_one_and_the_kl_mixture_has_the_soft_ce_gradient():
    gen = torch.Generator().manual_seed(2)
    k, b = 4, 12
    counts = random_counts(gen, k=k)
    y = stratified_labels(b, counts.sum(0), gen)
    alpha = class_ensemble_weights(counts)[:, y].T  # (B, K)
    teacher_logits = torch.randn(k, b, M, generator=gen) * 2
    p_bar = ensemble_distribution(teacher_logits, alpha)
    assert torch.allclose(p_bar.sum(1), torch.ones(b), atol=1e-6)
    student = (torch.randn(b, M, generator=gen) * 2).requires_grad_(True)
    for reduction, norm in (("code", b * M), ("batchmean", b)):
        (g_ce,) = torch.autograd.grad(soft_cross_entropy(student, p_bar, reduction), student)
        log_q = torch.log_softmax(student, 1)
        kl = 0.0
        for j in range(k):
            log_p = torch.log_softmax(teacher_logits[j], 1)
            kl = kl + (alpha[:, j : j + 1] * log_p.exp() * (log_p - log_q)).sum()
        (g_kl,) = torch.autograd.grad(kl / norm, student)
        assert torch.allclose(g_ce, g_kl, atol=1e-6)
        # The logit gradient is (q − p̄)/norm, an independent form.
        assert torch.allclose(g_ce, (torch.softmax(student, 1) - p_bar).detach() / norm, atol=1e-6)


def test_teachers_equal_to_the_student_give_zero_discrepancy_and_zero_student_gradient():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(8, M, generator=gen) * 2).requires_grad_(True)
    same = logits.detach().expand(3, 8, M)
    p_bar = ensemble_distribution(same, torch.full((8, 3), 1 / 3))
    (g,) = torch.autograd.grad(soft_cross_entropy(logits, p_bar), logits)
    assert float(g.abs().max()) < 1e-7
    for metric in ("l1_logits", "mse", "kl"):
        assert abs(float(model_discrepancy(logits.detach(), logits.detach(), torch.ones(8), metric))) < 1e-6


def test_generator_terms_by_hand():
    gen = torch.Generator().manual_seed(4)
    s, t = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    w = torch.rand(6, generator=gen)
    y = torch.randint(0, 4, (6,), generator=gen)
    l1 = sum(float(w[b]) * sum(abs(float(s[b, c] - t[b, c])) for c in range(4)) / 4 for b in range(6)) / 6
    assert abs(float(model_discrepancy(s, t, w, "l1_logits")) - l1) < 1e-6
    mse = sum(float(w[b]) * sum(float(s[b, c] - t[b, c]) ** 2 for c in range(4)) / 4 for b in range(6)) / 6
    assert abs(float(model_discrepancy(s, t, w, "mse")) - mse) < 1e-6
    ce = [-float(torch.log_softmax(t[b], 0)[y[b]]) for b in range(6)]
    per_sample = sum(float(w[b]) * ce[b] for b in range(6)) / 6
    assert abs(float(weighted_classification_loss(t, y, w, "per_sample")) - per_sample) < 1e-6
    scalar = float(w.mean()) * sum(ce) / 6
    assert abs(float(weighted_classification_loss(t, y, w, "batch_scalar")) - scalar) < 1e-6
    # L1 on logits: the gradient reaches only the student's side (the teacher is a stop-gradient).
    sg, tg = s.clone().requires_grad_(True), t.clone().requires_grad_(True)
    model_discrepancy(sg, tg, w, "l1_logits").backward()
    assert sg.grad is not None and float(sg.grad.abs().max()) > 0
    assert tg.grad is None or float(tg.grad.abs().max()) == 0.0


def test_diversity_loss_range_identity_and_scaling():
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(6, 16, generator=gen)
    same = torch.randn(1, 1, 4, 4, generator=gen).expand(6, 1, 4, 4)
    assert float(diversity_loss(same, z)) == 1.0
    x = torch.randn(6, 1, 4, 4, generator=gen)
    value = float(diversity_loss(x, z))
    assert 0.0 < value < 1.0
    assert float(diversity_loss(2.0 * x, z)) < value
    # By hand: exp(−mean_ij (1/P)|x_i − x_j|_1 · (1/d)|z_i − z_j|²).
    total = sum(
        float((x[i] - x[j]).abs().sum()) / 16 * float((z[i] - z[j]).pow(2).sum()) / 16 for i in range(6) for j in range(6)
    )
    assert abs(value - float(torch.exp(torch.tensor(-total / 36)))) < 1e-6


# -- generators --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, shape, classes, noise, expected",
    [
        ("cgenerator", (3, 32, 32), 10, 100, 682_499),
        ("cgenerator", (3, 32, 32), 100, 256, 1_690_115),
        ("generator", (3, 32, 32), 10, 100, 1_051_139),
        ("generator", (1, 28, 28), 10, 100, 856_065),
    ],
)
def test_generator_parameter_counts_match_the_card(name, shape, classes, noise, expected):
    g = build_generator(name, shape, classes, noise_dim=noise)
    assert sum(p.numel() for p in g.parameters()) == expected


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32)])
def test_generator_shapes_standardised_channels_and_label_dependence(shape):
    torch.manual_seed(0)
    g = build_generator("cgenerator", shape, M, noise_dim=16, ngf=8).train()
    z = torch.randn(64, 16)
    y = torch.randint(0, M, (64,))
    x = g(z, y)
    assert x.shape == (64, *shape)
    mean, var = x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), unbiased=False)
    assert torch.allclose(mean, torch.zeros_like(mean), atol=1e-4)
    assert torch.allclose(var, torch.ones_like(var), atol=1e-2)
    assert not torch.allclose(g(z, (y + 1) % M), x)
    u = build_generator("generator", shape, M, noise_dim=16, ngf=8)
    assert u(z).shape == (64, *shape)


def test_generators_have_their_own_registry_and_refuse_odd_sizes():
    assert {"cgenerator", "generator"} <= set(GENERATORS.names())
    from fedistill.registry import MODELS

    assert "cgenerator" not in MODELS
    for shape in [(3, 30, 30), (3, 32, 28)]:
        with pytest.raises(ConfigError, match="multiple of 4"):
            build_generator("cgenerator", shape, M)


# -- the fine-tune on tiny linear models: signs and normalisers against hand computations --------
SHAPE = (1, 4, 4)  # the smallest generator output: 16 features for a linear classifier


def linear_model(seed: int, m: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, m))


def tiny_setup(counts: torch.Tensor, seed: int = 0):
    m = counts.shape[1]
    student = linear_model(seed, m)
    teachers_models = [linear_model(seed + 1 + k, m) for k in range(counts.shape[0])]
    ensemble = TeacherEnsemble().load(student, [get_flat(t) for t in teachers_models], torch.device("cpu"))
    torch.manual_seed(seed + 100)
    generator = build_generator("cgenerator", SHAPE, m, noise_dim=8, ngf=4)
    return student, teachers_models, ensemble, generator


def replay_batch(params: FedFTGParams, counts: torch.Tensor, seed: int):
    """The (y, z) of the first iteration, drawn as server_fine_tune draws them (labels first, then z)."""
    rng = make_generator(seed, FEDFTG, 1)
    labels = stratified_labels(params.iterations * params.batch_size, counts.sum(0), rng)
    z = torch.randn(params.batch_size, params.noise_dim, generator=rng)
    return labels[: params.batch_size], z


@pytest.mark.parametrize("reduction", ["code", "batchmean"])
def test_one_student_step_matches_a_hand_computed_sgd_update(reduction):
    counts = torch.tensor([[5, 0, 2], [1, 4, 2]])
    p = FedFTGParams(
        iterations=1, generator_steps=0, student_steps=1, batch_size=6, noise_dim=8, student_lr=0.5,
        student_weight_decay=0.01, student_reduction=reduction,
    )  # fmt: skip
    student, teachers, ensemble, generator = tiny_setup(counts)
    w0, b0 = student[1].weight.detach().clone().double(), student[1].bias.detach().clone().double()
    y, z = replay_batch(p, counts, seed=7)
    with torch.no_grad():
        x = generator.eval()(z, y).flatten(1).double()
    # Hand: α^{k,y} = n_k^y / Σ_i n_i^y; p̄ = Σ_k α σ(W_k x + b_k); dL/dlogits = (q − p̄)/norm.
    alpha = counts.double() / counts.double().sum(0)
    p_bar = sum(
        alpha[k, y][:, None] * torch.softmax(x @ t[1].weight.double().T + t[1].bias.double(), 1)
        for k, t in enumerate(teachers)
    )
    q = torch.softmax(x @ w0.T + b0, 1)
    norm = 6 * 3 if reduction == "code" else 6
    g = (q - p_bar) / norm
    w1 = w0 - 0.5 * (g.T @ x + 0.01 * w0)
    b1 = b0 - 0.5 * (g.sum(0) + 0.01 * b0)
    server_fine_tune(student, generator, ensemble, counts, p, rng=make_generator(7, FEDFTG, 1))
    assert torch.allclose(student[1].weight.double(), w1, atol=1e-6)
    assert torch.allclose(student[1].bias.double(), b1, atol=1e-6)


@torch.no_grad()
def _generator_terms(generator, student, teacher, y, z, alpha_k):
    generator.train()  # as in the generator phase: batch statistics
    x = generator(z, y)
    md = model_discrepancy(student(x), teacher(x), alpha_k)
    cls = weighted_classification_loss(teacher(x), y, alpha_k)
    return float(md), float(cls), float(diversity_loss(x, z))


@pytest.mark.parametrize(
    "switches, term, direction",
    [
        ({"lambda_cls": 0.0, "lambda_dis": 0.0}, 0, +1),  # the generator maximises L_md (hard samples)
        ({"lambda_cls": 1.0, "lambda_dis": 0.0, "hard_sample_mining": False}, 1, -1),  # it minimises L_cls
        ({"lambda_cls": 0.0, "lambda_dis": 1.0, "hard_sample_mining": False}, 2, -1),  # and L_dis
    ],
)
def test_one_generator_step_moves_each_term_the_cards_way(switches, term, direction):
    counts = torch.tensor([[5, 1, 2]])
    p = FedFTGParams(
        iterations=1, generator_steps=1, student_steps=0, batch_size=8, noise_dim=8, generator_lr=1e-4, **switches
    )
    student, teachers, ensemble, generator = tiny_setup(counts, seed=3)
    y, z = replay_batch(p, counts, seed=11)
    alpha_k = torch.ones(8)  # one teacher: α = 1 for every held class
    before = _generator_terms(copy.deepcopy(generator), student, teachers[0], y, z, alpha_k)
    server_fine_tune(student, generator, ensemble, counts, p, rng=make_generator(11, FEDFTG, 1))
    after = _generator_terms(copy.deepcopy(generator), student, teachers[0], y, z, alpha_k)
    assert direction * (after[term] - before[term]) > 0, (before, after)


def test_fine_tune_leaves_teachers_and_uploads_unchanged():
    counts = torch.tensor([[5, 1, 2], [0, 3, 3]])
    student, teachers, _, generator = tiny_setup(counts, seed=5)
    uploads = [get_flat(t) for t in teachers]
    kept = [u.clone() for u in uploads]
    ensemble = TeacherEnsemble().load(student, uploads, torch.device("cpu"))
    p = FedFTGParams(iterations=2, batch_size=8, noise_dim=8, md_metric_gen="kl")
    before = get_flat(student)
    stacked = {name: t.clone() for name, t in ensemble.stacked.items()}
    server_fine_tune(student, generator, ensemble, counts, p, rng=make_generator(0, FEDFTG, 1))
    assert all(torch.equal(u, k) for u, k in zip(uploads, kept))
    assert not torch.equal(get_flat(student), before)
    # What the fine-tune actually evaluates: the ensemble's stacked views of the uploads, never trained.
    assert stacked and all(torch.equal(ensemble.stacked[n], t) for n, t in stacked.items())
    assert all(not t.requires_grad and t.grad is None for t in ensemble.stacked.values())


@pytest.mark.parametrize("name,vmapped", [("resnet8", False), ("mlp", True)])
def test_batched_teacher_pass_equals_one_module_per_teacher(name, vmapped):
    """Both ways of evaluating the ensemble (a loop for convolutional models, where vmap's grouped
    convolutions are slow; one vmapped pass for an MLP) give each teacher's own module's logits."""
    from fedistill.models import build_model

    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        model = build_model(name, (1, 8, 8), M)
        for buf in model.buffers():
            if buf.is_floating_point():
                buf.add_(0.3 * torch.rand_like(buf))  # BatchNorm statistics that differ per teacher
        models.append(model.eval())
    ensemble = TeacherEnsemble().load(models[0], [get_flat(m) for m in models], torch.device("cpu"))
    x = torch.randn(5, 1, 8, 8)
    expected = torch.stack([m(x) for m in models])
    assert torch.allclose(ensemble.all_logits(x), expected, atol=1e-5)
    assert ensemble._batched_ok is vmapped
    assert torch.allclose(ensemble.logits(2, x), expected[2], atol=1e-5)


# -- the algorithm in the simulation -----------------------------------------------------------------
# Few iterations and a narrower generator keep the end-to-end runs to seconds on a CPU.
FAST_FTG = {"iterations": 2, "batch_size": 32, "generator_width": 16}
FAST = {f"algorithm.{k}": v for k, v in FAST_FTG.items()}


def test_zero_iterations_is_the_base_method_bit_for_bit_and_leaves_the_generator(digits):
    """FedFTG only refines after the aggregation; it brings its card's uniform mean over S_t along (ambiguity 11),
    so the base method with that mean is what it must equal."""
    off = {"fedftg": {"iterations": 0}}
    for base in ("fedavg", "scaffold"):
        uniform = {"algorithm.weighting": "uniform"}
        assert_same_rounds(small_config(algorithm=base, **uniform), small_config(algorithm=base, **{"algorithm.plus": off}), digits)
    sim = Simulation(small_config(algorithm="fedftg", **{"algorithm.iterations": 0}), digits)
    initial = sim.server.state[GENERATOR_KEY].clone()
    row = sim.run_round(1)
    assert torch.equal(sim.server.state[GENERATOR_KEY], initial)
    assert "fedftg_refine_seconds" not in row


def test_refine_changes_the_model_before_the_base_methods_server_state(digits):
    sim = Simulation(small_config(algorithm="scaffold", **{"algorithm.plus": {"fedftg": FAST_FTG}}), digits)
    scaffold = sim.algorithm.parts[0]
    seen = []
    original = scaffold.after_aggregate

    def spy(server, info, replies, cids):
        seen.append(get_flat(server.model))
        return original(server, info, replies, cids)

    scaffold.after_aggregate = spy
    initial = sim.server.state[GENERATOR_KEY].clone()
    row = sim.run_round(1)
    assert torch.equal(seen[0], get_flat(sim.server.model))  # SCAFFOLD saw the fine-tuned model
    assert not torch.equal(sim.server.state[GENERATOR_KEY], initial)  # the generator was trained and kept
    assert row["fedftg_refine_seconds"] > 0 and "fedftg_md" in row and "fedftg_student_loss" in row


def test_label_counts_add_m_integers_per_client_to_the_upload(digits):
    a = Simulation(small_config(algorithm="fedavg"), digits).run_round(1)
    b = Simulation(small_config(algorithm="fedftg", **FAST), digits).run_round(1)
    assert b["bytes_up"] == a["bytes_up"] + 3 * M * 8
    assert b["bytes_down"] == a["bytes_down"]


def test_resume_equals_uninterrupted_generator_included(digits, tmp_path):
    assert_resume_is_exact(digits, tmp_path, "fedftg", server_keys=(GENERATOR_KEY,), **FAST)


def test_fedftg_learns_on_label_skewed_digits(digits):
    assert_learns(digits, "fedftg", **FAST)


def test_scaffold_plus_fedftg_learns_on_label_skewed_digits(digits):
    # lr 0.03, not the 0.05 of the other runs: at 0.05 this 10-client run diverged in round 12 with one
    # intra-op thread (train loss 8 -> 1e2 -> 2e5; the suite's xdist workers use one) and reached 92 % with
    # two, the two differing only in the summation order of their kernels. At 0.03 both learn (89-90 %).
    assert_learns(digits, "scaffold", **{"local.lr": 0.03, "algorithm.plus": {"fedftg": FAST_FTG}})


@pytest.mark.parametrize("base", ["fednova", "fedavgm", "fedprox", "feddyn", "moon", "fedlmd"])
def test_fedftg_combines_with_other_methods(digits, base):
    overrides = {"algorithm.plus": {"fedftg": {**FAST_FTG, "iterations": 1}}}
    row = Simulation(small_config(algorithm=base, rounds=1, **overrides), digits).run_round(1)
    assert row["fedftg_refine_seconds"] > 0 and row["test_accuracy"] is not None


def test_bf16_fine_tune_runs(digits):
    cfg = small_config(algorithm="fedftg", rounds=1, **{**FAST, "run.precision": "bf16"})
    sim = Simulation(cfg, digits)
    sim.run_round(1)
    assert bool(torch.isfinite(get_flat(sim.server.model)).all())


def test_feature_level_tunes_only_the_last_layer_on_generated_features(digits):
    """FedFTG(F) (Table 5): the generator emits penultimate features; the extractor is left as aggregated."""
    sim = Simulation(small_config(algorithm="fedftg", **FAST, **{"algorithm.level": "feature"}), digits)
    vectors = {}

    def aggregated(server, info, replies, cids):
        vectors["before"] = get_flat(server.model)
        return real_refine(server, info, replies, cids)

    real_refine = sim.algorithm.refine
    sim.algorithm.refine = aggregated
    row = sim.run_round(1)
    after = get_flat(sim.server.model)
    head = sum(p.numel() for p in sim.server.model.classifier.parameters())
    # The flat vector ends with the classifier: everything before it is untouched, the head moved.
    assert torch.equal(after[:-head], vectors["before"][:-head])
    assert not torch.equal(after[-head:], vectors["before"][-head:])
    generator = sim.algorithm._generator.load(sim.server)
    out = generator(torch.randn(4, 100), torch.tensor([0, 1, 2, 3]))
    assert out.shape == (4, sim.server.model.feature_dim)
    assert "fedftg_md" in row and "fedftg_student_loss" in row


def test_feature_level_learns_on_label_skewed_digits(digits):
    assert_learns(digits, "fedftg", **{"algorithm.level": "feature", "algorithm.iterations": 2})


def test_cli_runs_fedftg_alone_and_as_an_ingredient(tmp_path):
    from fedistill.cli import main

    fast = ["--rounds", "1", "--clients", "4", "--clients-per-round", "2", "--epochs", "1", "--no-progress"]
    for name, extra in (("alone", ["--set", "algorithm.name=fedftg", "--set", "algorithm.iterations=1"]),
                        ("plus", ["--set", "algorithm.plus=fedftg"])):  # fmt: skip
        assert main(["run", *fast, "--out", str(tmp_path), "--name", name, "--set", "run.workers=1", *extra]) == 0
        assert "fedftg_refine_seconds" in (tmp_path / name / "metrics.jsonl").read_text()


def test_aggregation_is_the_plain_mean_over_the_round_clients_unless_set(digits):
    """Card ambiguity 11: ω ← mean_{k∈S_t} ω_k by default (not |D_k|-weighted), standalone and added to a method;
    ``weighting: samples`` is the code's FedAvg path. The mean is written out here from the replies."""
    from fedistill.algorithms.build import make_algorithm

    assert make_algorithm(small_config(algorithm="fedftg")).params.weighting == "uniform"
    assert make_algorithm(small_config(algorithm="fedavg", **{"algorithm.plus": {"fedftg": {}}})).params.weighting == "uniform"
    explicit = small_config(algorithm="fedftg", **{"algorithm.weighting": "samples"})
    assert make_algorithm(explicit).params.weighting == "samples"
    sim = Simulation(small_config(algorithm="fedftg", **{"algorithm.iterations": 0}), digits)
    info = sim.round_info(1)
    replies = {c: sim.client_runtime.update(c, info, sim.server_runtime.broadcast(info, c), {}) for c in sim.server_runtime.select_clients(1)}
    assert len({int(r["num_samples"]) for r in replies.values()}) > 1  # unequal sizes, so the weighting shows
    expected = torch.stack([r["weights"].double() for r in replies.values()]).mean(0)
    sim.algorithm.aggregate(sim.server, info, replies)
    assert torch.allclose(get_flat(sim.server.model).double(), expected, atol=1e-6)
