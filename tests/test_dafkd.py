"""DaFKD invariants from spec/dafkd.md §7, its losses written out by hand, and end-to-end behaviour."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_learns, assert_resume_is_exact, small_config

from fedistill.algorithms.aggregate import aggregation_weights, weighted_mean
from fedistill.algorithms.build import make_algorithm
from fedistill.algorithms.dafkd import DISCRIMINATOR_KEY, GENERATOR_KEY, DaFKDParams, distil, distillation_target, output_map
from fedistill.simulation import Simulation
from fedistill.errors import ConfigError
from fedistill.losses import (
    discriminator_loss,
    domain_aware_distillation,
    domain_aware_teacher,
    domain_log_importance,
    generator_adversarial_loss,
    interpolation_gradient_penalty,
    prior_corrected_target,
    scale_matched_logits,
)
from fedistill.models import build_model
from fedistill.models.flat import get_flat, num_flat, set_flat
from fedistill.models.generators import build_generator

DAFKD = {"algorithm.name": "dafkd"}
# Small server and generator work for the digits tests: 64 samples, 2 epochs, a narrow DCGAN. Distillation lr
# 1e-4 (the code's): under Adam, the server's optimiser then, the paper's 1e-2 knocked the 8x8 CNN back by 10-20
# points a round. Under the SGD server step of issue 61 (the default since) 1e-4 leaves the aggregate almost where
# it is (two importances' runs 3e-8 apart after four rounds): the tests of what the server step does set their own
# lr (test_server_step_moves_the_average_to_the_teachers_...).
# The joint step on the run's local SGD throughout (the default profile's before issue 42's seeds 6-7).
SGD_JOINT_STEP = {"algorithm.client_optimizer": "sgd", "algorithm.client_lr": None, "algorithm.client_weight_decay": None}
QUICK = {
    "algorithm.distill_samples": 64,
    "algorithm.distill_epochs": 2,
    "algorithm.distill_lr": 1e-4,
    "algorithm.noise_dim": 16,
    "algorithm.generator_width": 16,
}

# Issue 42's one-class clients on small data: 10 shards of the sorted digits, one per client, so clients 0-5 each
# hold a single digit; one round of 15 epochs with the discriminator trained in every epoch and no server step.
ONE_DIGIT_CLIENTS_ONE_ROUND = {
    **DAFKD, **QUICK, "rounds": 1, "partition.scheme": "shards", "partition.alpha": None,
    "partition.num_clients": 10, "partition.shards_per_client": 1, "local.epochs": 15,
    "local.weight_decay": 0.0, "algorithm.gan_epochs": None, "algorithm.distill_epochs": 0,
}  # fmt: skip


def _round(sim, rnd, states=None):
    """Broadcast and run the clients of one round by hand; returns (info, {cid: reply}).

    ``states`` (cid -> client state dict) is used and filled when given; else every client starts fresh."""
    info = sim.round_info(rnd)
    replies = {}
    for cid in sim.server_runtime.select_clients(rnd):
        state = states.setdefault(cid, {}) if states is not None else {}
        replies[cid] = sim.client_runtime.update(cid, info, sim.server_runtime.broadcast(info, cid), state)
    return info, replies


# -- losses ---------------------------------------------------------------------------------------------


def test_importance_is_a_distribution_over_clients_even_when_every_score_underflows():
    logits = torch.tensor([[2.0, -300.0, 0.5], [-1.0, -200.0, 0.5], [0.0, -250.0, 0.5]])  # (K=3, N=3)
    alpha = domain_log_importance(logits).exp()
    assert torch.isfinite(alpha).all() and bool((alpha >= 0).all())
    assert torch.allclose(alpha.sum(dim=0), torch.ones(3))
    # Column 0 by hand: α_k = f_k / Σ_j f_j with f = sigmoid.
    f = [1 / (1 + math.exp(-v)) for v in (2.0, -1.0, 0.0)]
    assert torch.allclose(alpha[:, 0], torch.tensor([v / sum(f) for v in f]), atol=1e-6)
    # Column 1: every f underflows; f_k ≈ e^{ℓ_k}, so α is the softmax of the logits.
    assert torch.allclose(alpha[:, 1], torch.softmax(torch.tensor([-300.0, -200.0, -250.0]), 0), atol=1e-6)
    # Column 2: identical discriminators give uniform weights.
    assert torch.allclose(alpha[:, 2], torch.full((3,), 1 / 3))


def test_teacher_mixture_written_out_in_probability_and_logit_space():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, 5, generator=gen)  # K, N, M
    disc = torch.randn(3, 4, generator=gen)
    T = 2.0
    f = torch.sigmoid(disc)
    alpha = f / f.sum(dim=0)
    probs = sum(alpha[k].unsqueeze(1) * torch.softmax(z[k] / T, dim=1) for k in range(3))
    log_q = domain_aware_teacher(z, domain_log_importance(disc), T, "probs")
    assert torch.allclose(log_q.exp(), probs, atol=1e-6)
    assert torch.allclose(log_q.exp().sum(dim=1), torch.ones(4))
    mixed_logits = sum(alpha[k].unsqueeze(1) * z[k] for k in range(3))
    log_q = domain_aware_teacher(z, domain_log_importance(disc), T, "logits")
    assert torch.allclose(log_q.exp(), torch.softmax(mixed_logits / T, dim=1), atol=1e-6)


def test_a_confident_discriminator_selects_its_teacher_and_uniform_is_the_plain_ensemble():
    z = torch.randn(3, 6, 4)
    confident = torch.full((3, 6), -50.0)
    confident[1] = 50.0
    q = domain_aware_teacher(z, domain_log_importance(confident), 1.0, "probs").exp()
    assert torch.allclose(q, torch.softmax(z[1], dim=1), atol=1e-5)
    uniform = torch.full((3, 6), -math.log(3))
    q = domain_aware_teacher(z, uniform, 1.0, "probs").exp()
    assert torch.allclose(q, torch.softmax(z, dim=2).mean(dim=0), atol=1e-6)


@pytest.mark.parametrize("reduction, divisor", [("batchmean", 4), ("mean", 4 * 5)])
def test_distillation_loss_written_out(reduction, divisor):
    gen = torch.Generator().manual_seed(1)
    student = torch.randn(4, 5, generator=gen, requires_grad=True)
    q = torch.softmax(torch.randn(4, 5, generator=gen), dim=1)
    T = 3.0
    s = torch.softmax(student / T, dim=1)
    expected = T**2 * (q * (q.log() - s.log())).sum() / divisor
    value = domain_aware_distillation(student, q.log(), T, reduction)
    assert torch.allclose(value, expected, atol=1e-6)
    # KL ≥ 0, and 0 with no gradient when the student is the teacher.
    assert float(value.detach()) > 0
    same = torch.randn(4, 5, requires_grad=True)
    loss = domain_aware_distillation(same, torch.log_softmax(same.detach() / T, dim=1), T, reduction)
    loss.backward()
    assert abs(float(loss.detach())) < 1e-6 and float(same.grad.abs().max()) < 1e-6


def test_adversarial_losses_written_out_with_the_cards_signs():
    real = torch.tensor([0.3, -1.2], requires_grad=True)
    fake = torch.tensor([2.0, -0.4], requires_grad=True)
    log_sig = lambda v: -math.log1p(math.exp(-v))  # noqa: E731
    expected = -(log_sig(0.3) + log_sig(-1.2)) / 2 - (log_sig(-2.0) + log_sig(0.4)) / 2  # log(1 − σ(v)) = logσ(−v)
    loss = discriminator_loss(real, fake)
    assert math.isclose(float(loss.detach()), expected, rel_tol=1e-6)
    loss.backward()
    # Minimising it raises the real logits and lowers the fake ones.
    assert bool((real.grad < 0).all()) and bool((fake.grad > 0).all())
    fake2 = torch.tensor([2.0, -0.4], requires_grad=True)
    g = generator_adversarial_loss(fake2)
    assert math.isclose(float(g.detach()), -(log_sig(2.0) + log_sig(-0.4)) / 2, rel_tol=1e-6)
    g.backward()
    assert bool((fake2.grad < 0).all())  # the generator pushes its samples toward "real"


def test_theorem_one_a_tabular_discriminator_converges_to_p_over_p_plus_pg():
    """Card §7: trained on Eq. 2 against a fixed fake distribution, f(x) → p(x) / (p(x) + p_g(x))."""
    p_real = torch.tensor([0.5, 0.3, 0.1, 0.1])
    p_fake = torch.tensor([0.1, 0.2, 0.3, 0.4])
    real_batch = torch.repeat_interleave(torch.arange(4), (p_real * 100).long())  # exact proportions
    fake_batch = torch.repeat_interleave(torch.arange(4), (p_fake * 100).long())
    table = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([table], lr=5.0)
    for _ in range(3000):
        opt.zero_grad()
        discriminator_loss(table[real_batch], table[fake_batch]).backward()
        opt.step()
    assert torch.allclose(torch.sigmoid(table.detach()), p_real / (p_real + p_fake), atol=1e-3)


# -- the method on digits --------------------------------------------------------------------------------


def test_round_one_and_no_distillation_give_the_weighted_average_of_the_uploads(digits):
    for rnd, overrides in ((1, {}), (2, {"algorithm.distill_epochs": 0})):
        sim = Simulation(small_config(**DAFKD, **{**QUICK, **overrides}), digits)
        for earlier in range(1, rnd):
            sim.run_round(earlier)
        info, replies = _round(sim, rnd)
        ordered = [replies[c] for c in sorted(replies)]
        weights = aggregation_weights([int(r["num_samples"]) for r in ordered])
        sim.algorithm.aggregate(sim.server, info, replies)
        assert torch.equal(get_flat(sim.server.model), weighted_mean([r["weights"] for r in ordered], weights))
        # Eq. (4): the new global generator is the p_k-weighted average of the local ones.
        assert torch.equal(sim.server.state[GENERATOR_KEY], weighted_mean([r["generator"] for r in ordered], weights))


def test_distillation_changes_the_average_from_round_two(digits):
    sim = Simulation(small_config(**DAFKD, **QUICK), digits)
    sim.run_round(1)
    info, replies = _round(sim, 2)
    ordered = [replies[c] for c in sorted(replies)]
    average = weighted_mean([r["weights"] for r in ordered], aggregation_weights([int(r["num_samples"]) for r in ordered]))
    metrics = sim.algorithm.aggregate(sim.server, info, replies)
    assert not torch.equal(get_flat(sim.server.model), average)
    # A KL divergence, non-negative up to float rounding: where student and target nearly agree, the sum of
    # p·(log p − log q) rounds to about −1e-8 on some CPUs (seen on an AVX-512 AMD EPYC host).
    assert metrics["dafkd_kd_loss"] >= -1e-6 and metrics["dafkd_refine_seconds"] > 0


@pytest.mark.parametrize(
    ("teacher_scale", "target_prior"), [("raw", None), ("aggregate", None), ("raw", "aggregate")]
)  # fmt: skip
def test_the_default_distils_the_mixture_with_a_uniform_class_prior_written_out(digits, monkeypatch, teacher_scale, target_prior):
    """Issue 61's default in the server's step, written out from the teachers' raw scores: the teachers'
    ``softmax(z_k/T)`` mixed with Eq. 7's ``α̂ = f_k / Σ_j f_j`` (Eq. 8, the paper's probability space at T = 1;
    ambiguity 22), then the mixture ``q`` times ``(1/M) / q̄``, renormalised (ambiguities 19 and 22: every class
    an equal share of the batch); and that costs the model's BN buffers nothing. With the option ``target_prior:
    aggregate`` (ambiguity 19) the share is ŵ's own, ``s̄_ŵ``, the batch mean of ŵ's ``softmax(z/T)``. With the
    option ``teacher_scale: aggregate`` (ambiguity 20) each teacher's logits are first centred and scaled, sample by
    sample, to the standard deviation of ŵ's logits."""
    import fedistill.algorithms.dafkd as dafkd_module

    options = {"algorithm.teacher_scale": teacher_scale}
    if target_prior:
        options["algorithm.target_prior"] = target_prior
    sim = Simulation(small_config(**DAFKD, **QUICK, **options), digits)
    sim.run_round(1)
    info, replies = _round(sim, 2)
    algorithm, server = sim.algorithm, sim.server
    seen: dict = {"scores": []}
    real_distil, real_score = dafkd_module.distil, algorithm.score_inputs

    def capture(student, inputs, log_target, p, precision):
        seen["inputs"], seen["target"] = inputs, log_target
        seen["buffers"] = [b.clone() for b in student.buffers()]
        seen["aggregate"] = get_flat(student)
        return real_distil(student, inputs, log_target, p, precision)

    def scores(teacher, discriminator, x):  # each teacher's raw logits z_k and discriminator logits ℓ_k
        z, ell = real_score(teacher, discriminator, x)
        seen["scores"].append((z.clone(), ell.clone()))
        return z, ell

    monkeypatch.setattr(dafkd_module, "distil", capture)
    monkeypatch.setattr(algorithm, "score_inputs", scores)
    algorithm.aggregate(server, info, replies)
    assert len(seen["scores"]) == len(replies)
    model = server.model
    set_flat(model, seen["aggregate"])
    t = algorithm.params.temperature
    model.train()  # the distillation's mode (card ambiguity 8), BN buffers put back by hand after
    saved = [b.clone() for b in model.buffers()]
    with torch.no_grad():
        r = torch.cat([model(seen["inputs"][i : i + 32]) for i in range(0, 64, 32)]).float()
        for b, v in zip(model.buffers(), saved):
            b.copy_(v)
    z = torch.stack([zk for zk, _ in seen["scores"]])  # (K, N, M)
    f = torch.sigmoid(torch.stack([ell for _, ell in seen["scores"]]))  # (K, N)
    alpha = f / f.sum(0)
    centred = z - z.mean(2, keepdim=True)
    scaled = centred * (r.std(1, unbiased=False)[None, :, None] / centred.std(2, unbiased=False, keepdim=True))
    assert algorithm.params.ensemble_space == "probs" and t == 1.0
    q_scaled = (alpha[..., None] * torch.softmax(scaled / t, dim=2)).sum(0)
    q_raw = (alpha[..., None] * torch.softmax(z / t, dim=2)).sum(0)
    q = q_scaled if teacher_scale == "aggregate" else q_raw
    s_hat = torch.softmax(r / t, dim=1) if target_prior == "aggregate" else torch.full_like(q, 0.1)  # M = 10
    assert algorithm.params.target_prior == (target_prior or "uniform")
    expected = q * (s_hat.mean(0) / q.mean(0))
    expected = expected / expected.sum(1, keepdim=True)
    assert torch.allclose(seen["target"], expected.log(), atol=1e-5)
    # the prior correction changes this target by far more than the tolerance above, and so does the scaling
    assert float((expected.log() - q.log()).abs().max()) > 2e-4
    if teacher_scale == "aggregate":
        assert float((q_scaled.log() - q_raw.log()).abs().max()) > 2e-4
    assert all(torch.equal(a, b) for a, b in zip(seen["buffers"], saved))


def test_discriminator_heads_persist_per_client_and_differ_between_clients(digits):
    sim = Simulation(small_config(**DAFKD, **QUICK, rounds=1), digits)
    states: dict = {}
    info, replies = _round(sim, 1, states)
    heads = {cid: reply["discriminator"] for cid, reply in replies.items()}
    feature_dim = build_model("digits_cnn", (1, 8, 8), 10).feature_dim
    assert all(h.numel() == feature_dim + 1 for h in heads.values())
    values = list(heads.values())
    assert all(not torch.equal(values[0], other) for other in values[1:])
    # The ψ_k a client starts its next participation with is the one it uploaded.
    for cid, head in heads.items():
        assert torch.equal(states[cid][DISCRIMINATOR_KEY], head)
        context = sim.client_runtime.context(cid, 2, states[cid])
        assert torch.equal(sim.client_runtime.algorithm._worker_discriminator(context).state_vector(), head)


@pytest.mark.parametrize("model", ["digits_cnn", "resnet11"])
def test_generator_step_moves_only_the_generator(digits, model):
    """Card §7: with the discriminator off, the generator's steps change neither the classifier nor ψ_k. With
    ResNet-11 that includes its BatchNorm statistics, which travel in w_k (the fake batches of the generator
    step moved them by up to 2.25 before they were kept)."""
    base = {**DAFKD, **QUICK, "algorithm.discriminator_rounds": 0, "rounds": 1}
    if model == "resnet11":
        from fedistill.data.dataset import resized

        digits = resized(digits, 16)
        base.update({"dataset.resize": 16, "model.name": "resnet11", "model.kwargs": {"width": 4}})
    on = Simulation(small_config(**base), digits)
    off = Simulation(small_config(**base, **{"algorithm.generator_rounds": 0}), digits)
    broadcast = on.server.state[GENERATOR_KEY].clone()
    _, with_g = _round(on, 1)
    _, without_g = _round(off, 1)
    for cid in with_g:
        assert torch.equal(with_g[cid]["weights"], without_g[cid]["weights"])
        assert torch.equal(with_g[cid]["discriminator"], without_g[cid]["discriminator"])
        assert not torch.equal(with_g[cid]["generator"], broadcast)
        assert torch.equal(without_g[cid]["generator"], broadcast)


@pytest.mark.parametrize("channels_last", [True, False])
def test_client_generator_takes_the_runs_memory_format_with_the_same_samples(digits, channels_last):
    """The clients' generator is laid out like the run's models (run.channels_last): its last transposed
    convolution was 13x slower in NCHW bf16 on CPU. The layout changes the strides, not the samples."""
    sim = Simulation(small_config(**DAFKD, **QUICK, rounds=1, **{"run.channels_last": channels_last}), digits)
    _round(sim, 1)
    generator = sim.client_runtime.algorithm._client_generator
    kernels = [m.weight for m in generator.modules() if isinstance(m, torch.nn.ConvTranspose2d)]
    kernels = [w for w in kernels if w.shape[1] > 1 and w.shape[-1] > 1]  # a 1x1 or 1-channel kernel is both
    assert kernels and all((w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()) == channels_last for w in kernels)
    plain = build_generator("dcgan", (1, 8, 8), 10, noise_dim=16, ngf=16)
    set_flat(plain, get_flat(generator))
    z = torch.randn(6, 16)
    generator.eval(), plain.eval()
    with torch.no_grad():
        assert torch.allclose(generator(z), plain(z), atol=1e-5)


def test_privacy_variant_gives_the_discriminator_teacher(digits):
    """Appendix B: Σ_k f_k s_k / Σ_k f_k from the clients' uploads equals Eq. 8 with the discriminators."""
    plain = Simulation(small_config(**DAFKD, **QUICK), digits)
    private = Simulation(small_config(**DAFKD, **QUICK, **{"algorithm.privacy": True}), digits)
    for sim in (plain, private):
        sim.run_round(1)
    info, plain_replies = _round(plain, 2)
    _, private_replies = _round(private, 2)
    order = sorted(plain_replies)
    for cid in order:  # local training is the same; only the extra upload differs
        assert torch.equal(plain_replies[cid]["weights"], private_replies[cid]["weights"])
        assert "discriminator" not in private_replies[cid]
        assert private_replies[cid]["weighted_predictions"].shape == (64, 10)
    algorithm = plain.algorithm
    x = algorithm.server_distill_inputs(plain.server, 2)
    expected = algorithm.teacher_target(plain.server, x, [plain_replies[c] for c in order])
    got = private.algorithm.teacher_target(private.server, x, [private_replies[c] for c in order])
    assert torch.allclose(got.exp(), expected.exp(), atol=1e-5)
    plain.algorithm.aggregate(plain.server, info, plain_replies)
    private.algorithm.aggregate(private.server, info, private_replies)
    assert torch.allclose(get_flat(plain.server.model), get_flat(private.server.model), atol=1e-4)


def test_bytes_count_the_generator_both_ways_and_the_head_up(digits):
    fedavg = Simulation(small_config(algorithm="fedavg", rounds=1), digits).run()[-1]
    dafkd = Simulation(small_config(**DAFKD, **QUICK, rounds=1), digits).run()[-1]
    generator = build_generator("dcgan", (1, 8, 8), 10, noise_dim=16, ngf=16)
    head = build_model("digits_cnn", (1, 8, 8), 10).feature_dim + 1
    clients = 3
    assert dafkd["bytes_down"] == fedavg["bytes_down"] + clients * 4 * num_flat(generator)
    assert dafkd["bytes_up"] == fedavg["bytes_up"] + clients * 4 * (num_flat(generator) + head)


def test_separate_discriminator_uploads_a_whole_network_and_starts_from_the_initial_extractor(digits):
    sim = Simulation(small_config(**DAFKD, **QUICK, **{"algorithm.discriminator": "separate"}, rounds=1), digits)
    _, replies = _round(sim, 1)
    model = build_model("digits_cnn", (1, 8, 8), 10)
    size = num_flat(model) - 10 * (model.feature_dim + 1) + model.feature_dim + 1
    assert all(r["discriminator"].numel() == size for r in replies.values())


def test_profiles_fill_unset_switches_and_explicit_values_win():
    """Card ambiguity 18: the code profile is the default; each profile sets its switches, explicit values win."""
    p = make_algorithm(small_config(**DAFKD, **{"algorithm.profile": "code"})).params
    assert (p.ensemble_space, p.temperature, p.kd_reduction) == ("logits", 20.0, "mean")
    assert (p.discriminator_rounds, p.generator_rounds, p.gan_epochs, p.gradient_penalty) == (3, 5, 5, 0.3)
    assert p.gradient_penalty_on == "sigmoid"
    assert (p.generator_output, p.distill_bn_mode) == ("data", "train")
    assert (p.client_optimizer, p.client_lr, p.client_weight_decay, p.distill_lr) == ("adam", 1e-4, 0.0, 1e-4)
    assert p.distill_optimizer == "adam"
    assert (p.generator_lr, p.generator_weight_decay) == (1e-4, 1e-4)
    assert p.target_prior == "teachers" and p.teacher_scale == "raw"
    # The default: the code's switches, the joint step on Adam 1e-4 while D trains (the run's SGD after), the
    # penalty on the logit and a uniform class prior in the server's target (issue 61).
    default = make_algorithm(small_config(**DAFKD)).params
    assert default.profile == "default"
    for name in DaFKDParams.model_fields:
        if name not in (
            "profile", "client_optimizer", "client_lr", "gradient_penalty_on", "target_prior", "teacher_scale",
            "distill_optimizer", "distill_lr", "ensemble_space", "temperature",
        ):  # fmt: skip
            assert getattr(default, name) == getattr(p, name), name
    assert (default.client_optimizer, default.client_lr, default.client_weight_decay) == ("adam_gan", 1e-4, 0.0)
    assert default.gradient_penalty_on == "logit"
    assert default.target_prior == "uniform" and default.teacher_scale == "raw"
    # and the server's distillation on SGD at the paper's lr (issue 61, card ambiguity 21)
    assert (default.distill_optimizer, default.distill_lr, default.distill_momentum) == ("sgd", 1e-2, 0.9)
    # and the teachers mixed as probabilities at T = 1, the paper's Eq. 8 (issue 61, card ambiguity 22)
    assert (default.ensemble_space, default.temperature, default.kd_reduction) == ("probs", 1.0, "mean")
    # privacy mode cannot rescale the teachers (the server sees only the secure sums): asking for both is refused
    # with the way out
    private = make_algorithm(small_config(**DAFKD, **{"algorithm.privacy": True})).params
    assert private.teacher_scale == "raw" and private.target_prior == "uniform"
    with pytest.raises(ConfigError, match="teacher_scale: raw"):
        make_algorithm(small_config(**DAFKD, **{"algorithm.privacy": True, "algorithm.teacher_scale": "aggregate_cap"}))
    paper = make_algorithm(small_config(**DAFKD, **{"algorithm.profile": "paper"})).params
    assert (paper.ensemble_space, paper.temperature, paper.kd_reduction) == ("probs", 1.0, "batchmean")
    assert (paper.discriminator_rounds, paper.generator_rounds, paper.gan_epochs, paper.gradient_penalty) == (
        None, None, None, 0.0,
    )  # fmt: skip
    assert (paper.generator_output, paper.distill_bn_mode, paper.client_optimizer) == ("tanh", "eval", "sgd")
    assert (paper.client_lr, paper.distill_lr, paper.generator_lr) == (None, 1e-2, 1e-3)
    assert paper.distill_optimizer == "adam"
    assert paper.target_prior == "teachers" and paper.teacher_scale == "raw"
    p = make_algorithm(small_config(**DAFKD, **{"algorithm.profile": "code", "algorithm.temperature": 4.0})).params
    assert p.temperature == 4.0 and p.ensemble_space == "logits"


def test_dafkd_cannot_be_combined_either_way():
    with pytest.raises(ConfigError, match="dafkd"):
        make_algorithm(small_config(algorithm="fedavg", **{"algorithm.plus": {"dafkd": {}}}))
    with pytest.raises(ConfigError, match="dafkd replaces local_update"):
        make_algorithm(small_config(algorithm="dafkd", **{"algorithm.plus": {"fedprox": {}}}))


def test_dafkd_learns_on_label_skewed_digits(digits):
    assert_learns(digits, "dafkd", **QUICK)


def test_uniform_importance_gives_every_teacher_one_over_k_on_every_sample(digits, monkeypatch):
    """``importance: uniform`` (Table 3's "no correlation"): α̂ = 1/K_t in the mixed teacher of every server step.
    This was a second 15-round run of test_dafkd_learns_on_label_skewed_digits, whose accuracy matched the
    discriminator's in every round to 0.1 % (at QUICK's distillation lr the two runs' weights differed by 3e-8
    after four rounds): it showed the path runs, not what it computes."""
    import fedistill.algorithms.dafkd as dafkd_module

    seen: list[tuple[int, torch.Tensor]] = []
    original = dafkd_module.mixed_teacher

    def spy(teacher_logits, log_alpha, *args, **kwargs):
        seen.append((teacher_logits.shape[0], log_alpha.clone()))
        return original(teacher_logits, log_alpha, *args, **kwargs)

    monkeypatch.setattr(dafkd_module, "mixed_teacher", spy)
    Simulation(small_config(rounds=2, **DAFKD, **QUICK, **{"algorithm.importance": "uniform"}), digits).run()
    assert seen  # round 2 distils (round 1 is the plain average)
    for teachers, log_alpha in seen:
        assert teachers == 3 and log_alpha.shape[0] == 3 and log_alpha.shape[1] == 64  # 3 clients, 64 samples
        torch.testing.assert_close(log_alpha.exp(), torch.full_like(log_alpha, 1 / 3))


def test_resume_equals_uninterrupted_generator_and_discriminators_included(digits, tmp_path):
    assert_resume_is_exact(
        digits, tmp_path, "dafkd", server_keys=(GENERATOR_KEY,), client_keys=(DISCRIMINATOR_KEY,), **QUICK
    )


def test_discriminators_on_disk_give_the_same_run_as_in_memory(digits):
    """run.client_state=disk keeps each ψ_k in a file per client; the numbers do not change."""
    from conftest import assert_same_rounds

    memory = small_config(**DAFKD, **QUICK, **{"run.client_state": "memory"})
    disk = small_config(**DAFKD, **QUICK, **{"run.client_state": "disk"})
    assert_same_rounds(memory, disk, digits, rounds=3)


def test_dataset_resize_is_bilinear_once_at_load(digits):
    """dataset.resize (card ambiguity 11: 28x28 -> 32x32): a 2x2 image to 4x4 written out by hand."""
    from fedistill.data.dataset import Dataset, resized

    image = torch.tensor([[[[0, 100], [200, 255]]]], dtype=torch.uint8)
    tiny = Dataset("tiny", image, torch.zeros(1, dtype=torch.int64), image, torch.zeros(1, dtype=torch.int64), 10, (0.5,), (0.5,))
    out = resized(tiny, 4)
    # align_corners=False: output centres sit at input coordinates -0.25, 0.25, 0.75, 1.25 (clamped to 0..1).
    assert out.train_x[0, 0, 0].tolist() == [0, 25, 75, 100]
    assert out.train_x[0, 0, 3].tolist() == [200, 214, 241, 255]  # 200 + t·55 at t = 0, 0.25, 0.75, 1
    corner = 0.75 * 0.75 * 0 + 0.75 * 0.25 * 100 + 0.25 * 0.75 * 200 + 0.25 * 0.25 * 255
    assert int(out.train_x[0, 0, 1, 1]) == round(corner)
    assert resized(tiny, None) is tiny and resized(tiny, 2) is tiny
    # A run on resized digits: 16x16 inputs, the DCGAN's 16x16 layout, the same labels.
    cfg = small_config(**DAFKD, **QUICK, **{"dataset.resize": 16, "model.name": "resnet11", "model.kwargs": {"width": 4}}, rounds=1)
    from fedistill.runner import load_dataset_for

    big = resized(digits, 16)
    assert big.input_shape == (1, 16, 16) and torch.equal(big.train_y, digits.train_y)
    rows = Simulation(cfg, big).run()
    assert rows[-1]["test_accuracy"] > 0 and load_dataset_for(cfg).input_shape == (1, 16, 16)


def test_privacy_bytes_are_the_weighted_predictions_and_scores_instead_of_the_head(digits):
    """Appendix B: from round 2 a client uploads N·M + N float64 (no ψ_k); the server sends one seed more."""
    plain = Simulation(small_config(**DAFKD, **QUICK, rounds=2), digits).run()
    private = Simulation(small_config(**DAFKD, **QUICK, **{"algorithm.privacy": True}, rounds=2), digits).run()
    head = build_model("digits_cnn", (1, 8, 8), 10).feature_dim + 1
    clients, samples, classes = 3, 64, 10
    assert private[0]["bytes_up"] == plain[0]["bytes_up"] - clients * 4 * head  # round 1: no distillation
    assert private[1]["bytes_up"] == plain[1]["bytes_up"] - clients * 4 * head + clients * 8 * samples * (classes + 1)
    assert private[1]["bytes_down"] == plain[1]["bytes_down"] + clients * 8


def test_joint_step_trains_the_shared_extractor_through_the_adversarial_loss_alone(digits, monkeypatch):
    """Card §7: with the CE zeroed, L_adv of Eq. 9 still moves φ_k (the extractor it shares with ψ_k), but
    not the classifier head h_k; with the discriminator off as well, nothing moves."""
    import fedistill.algorithms.dafkd as dafkd_module

    real_ce = torch.nn.functional.cross_entropy
    monkeypatch.setattr(dafkd_module.torch.nn.functional, "cross_entropy", lambda logits, y, **kw: 0.0 * real_ce(logits, y))
    base = {**DAFKD, **QUICK, "rounds": 1, "local.weight_decay": 0.0, "algorithm.generator_rounds": 0}
    for discriminator_on in (True, False):
        extra = {} if discriminator_on else {"algorithm.discriminator_rounds": 0}
        sim = Simulation(small_config(**base, **extra), digits)
        start = sim.server.model
        start_extractor = [p.detach().clone() for n, p in start.named_parameters() if not n.startswith("classifier")]
        start_head = [p.detach().clone() for p in start.classifier.parameters()]
        _round(sim, 1)
        worker = sim.client_runtime.worker  # holds the last client's updated model
        extractor = [p for n, p in worker.named_parameters() if not n.startswith("classifier")]
        moved = any(not torch.equal(a, b) for a, b in zip(start_extractor, extractor))
        assert moved is discriminator_on
        assert all(torch.equal(a, b) for a, b in zip(start_head, worker.classifier.parameters()))


# -- the code profile (card ambiguity 18) -----------------------------------------------------------------


def test_gradient_penalty_written_out_per_sample_over_the_whole_image():
    """The code's penalty λ·mean_b(‖∇_x̃ f(x̃_b)‖ − 1)² with the card's per-sample flattened norm. With
    f(x) = σ(Σ W·x + c), ∇f = f(1 − f)·W, so the norm is f(1 − f)·‖W‖_F (a norm over the channel axis
    only, the code's bug, or a missing square root or λ would not give this value)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(2, 3, 3, generator=gen)
    real = torch.randn(4, 2, 3, 3, generator=gen)
    fake = torch.randn(4, 2, 3, 3, generator=gen)
    mix = torch.tensor([0.0, 0.25, 0.6, 1.0])
    w = weight.clone().requires_grad_(True)
    gp = interpolation_gradient_penalty(lambda v: torch.sigmoid((v * w).sum(dim=(1, 2, 3)) + 0.2), real, fake, mix, 0.3)
    expected = 0.0
    frobenius = math.sqrt(float((weight**2).sum()))
    for b in range(4):
        x = float(mix[b]) * real[b] + (1 - float(mix[b])) * fake[b]
        f = 1 / (1 + math.exp(-(float((x * weight).sum()) + 0.2)))
        expected += (f * (1 - f) * frobenius - 1) ** 2
    expected = 0.3 * expected / 4
    assert math.isclose(float(gp.detach()), expected, rel_tol=1e-5)
    gp.backward()  # the penalty trains the discriminator (create_graph)
    assert w.grad is not None and float(w.grad.abs().sum()) > 0


def test_code_penalty_on_the_sigmoid_runs_away_on_one_class_clients_under_sgd_and_the_logit_penalty_does_not(digits):
    """Issue 42's NaN at Dirichlet α = 0.05, on small data: a client that holds one class meets its CE through the
    bias, and the joint SGD step then follows the discriminator's terms alone. With the code's penalty on
    f = sigmoid(ℓ) the shared extractor and ψ_k run away (weights 1e4-1e7 or non-finite here, within 90 steps);
    with the same penalty on the logit ℓ (the default) every weight stays near its start, as with no penalty."""
    base = {**ONE_DIGIT_CLIENTS_ONE_ROUND, **SGD_JOINT_STEP, "local.lr": 0.03}
    largest: dict[str, list[float]] = {}
    for on in ("sigmoid", "logit"):
        sim = Simulation(small_config(**base, **{"algorithm.gradient_penalty_on": on}), digits)
        fed = sim.federation
        one_class = [c for c in range(10) if fed.dataset.train_y[fed.train_indices[c]].unique().numel() == 1]
        assert len(one_class) >= 4  # the shards of sorted labels give most clients a single digit
        info = sim.round_info(1)
        largest[on] = []
        for cid in one_class[:4]:
            reply = sim.client_runtime.update(cid, info, sim.server_runtime.broadcast(info, cid), {})
            weights = reply["weights"]
            largest[on].append(float(weights.abs().max()) if torch.isfinite(weights).all() else math.inf)
            if on == "sigmoid" and largest[on][-1] > 1e3:
                break  # one runaway client is the claim; every client must stay bounded under the logit's penalty
    assert max(largest["sigmoid"]) > 1e3, largest  # the runaway
    assert max(largest["logit"]) < 10, largest  # bounded: the initial weights are below 1


def test_sgd_with_momentum_on_the_joint_step_runs_away_on_one_class_clients_and_adam_does_not(digits):
    """Issue 42's NaN on MNIST α = 0.1 (seeds 6 and 7), on small data: with the penalty on the logit, a one-class
    client's discriminator still separates real from generated images by growing the shared features; when the
    generator catches up, the BCE's gradient scales with |φ|, SGD's step with the gradient, and momentum 0.9
    carries each overshoot on, so the weights ramp up and overflow. The same steps without momentum stay bounded,
    and so does the default profile's Adam (steps bounded by its lr whatever the gradient's scale; the code's)."""
    base = {**ONE_DIGIT_CLIENTS_ONE_ROUND, "local.epochs": 8}  # 8 are enough here (15: the same verdicts)
    runs = {
        "sgd, momentum 0.9": {**SGD_JOINT_STEP, "local.lr": 0.08, "local.momentum": 0.9},
        "sgd, no momentum": {**SGD_JOINT_STEP, "local.lr": 0.08, "local.momentum": 0.0},
        "adam (default: the discriminator trains in every epoch here)": {},
    }
    largest: dict[str, list[float]] = {}
    for name, overrides in runs.items():
        sim = Simulation(small_config(**base, **overrides), digits)
        info = sim.round_info(1)
        assert sim.client_runtime.algorithm.params.gradient_penalty_on == "logit"
        largest[name] = []
        # clients 0-2: one digit each (the shards of sorted labels); with momentum, over 8 epochs, clients 0 and 2
        # overflow and client 1 reaches 4.0 (over 15 all three overflowed on the hosts tried; clients 3 and 5 stayed
        # at 3.9 and 6.4 on the Intel host), without it none passes 0.5
        for cid in range(3):
            assert sim.federation.dataset.train_y[sim.federation.train_indices[cid]].unique().numel() == 1
            weights = sim.client_runtime.update(cid, info, sim.server_runtime.broadcast(info, cid), {})["weights"]
            largest[name].append(float(weights.abs().max()) if torch.isfinite(weights).all() else math.inf)
            if name == "sgd, momentum 0.9" and largest[name][-1] > 1e3:
                break  # one runaway client is the claim; the bounded runs check all three
    assert max(largest["sgd, momentum 0.9"]) > 1e3, largest  # the runaway (non-finite here)
    assert max(largest["sgd, no momentum"]) < 2, largest  # the initial weights are below 0.4
    assert max(largest["adam (default: the discriminator trains in every epoch here)"]) < 2, largest


def test_adam_at_1e3_inflates_a_one_class_clients_logits_and_the_default_1e4_does_not(digits):
    """Issue 42's round-5 NaN at Dirichlet α = 0.05 (Fashion-MNIST seed 1), on small data. A client that holds one
    class drives its CE towards 0 by widening the logit margin, and its gradient vanishes as it does; SGD's steps
    vanish with it, but Adam divides by the gradient's running scale, so each weight keeps moving by about its lr
    per step and the margin keeps growing at a rate set by the lr. At Adam 1e-3 the uploads' logit spread (largest
    max − min logit over real images) reached 79 and 962 in the failing run; the routed ensemble mixes the teachers'
    logits linearly (Eq. 8, logit space), so the student is trained towards that scale, and the CE-only SGD of round
    5 then diverged. Here: one round, the discriminator trained in every epoch, 8 epochs on single-digit clients;
    the default's Adam 1e-4 (the authors' script's client lr) stays below 8 (1.4-1.7 measured), 1e-3 goes above
    15 (20-24; over 15 epochs 3.5-4.6 against 22-28)."""
    base = {**ONE_DIGIT_CLIENTS_ONE_ROUND, "local.epochs": 8}
    spread: dict[str, list[float]] = {}
    for name, overrides in {"default (Adam 1e-4)": {}, "Adam 1e-3": {"algorithm.client_lr": 1e-3}}.items():
        sim = Simulation(small_config(**base, **overrides), digits)
        assert sim.client_runtime.algorithm.params.client_optimizer == "adam_gan"
        info = sim.round_info(1)
        inputs, _ = next(sim.server_runtime.test_pipeline.test_batches(512))  # every digit
        model = sim.server_runtime.server.model
        spread[name] = []
        for cid in range(4):  # clients 0-3: one digit each (the shards of sorted labels)
            assert sim.federation.dataset.train_y[sim.federation.train_indices[cid]].unique().numel() == 1
            set_flat(model, sim.client_runtime.update(cid, info, sim.server_runtime.broadcast(info, cid), {})["weights"])
            model.eval()
            with torch.no_grad():
                logits = model(inputs).float()
            spread[name].append(float((logits.max(1).values - logits.min(1).values).max()))
    assert max(spread["default (Adam 1e-4)"]) < 8, spread
    assert min(spread["Adam 1e-3"]) > 15, spread


def test_default_penalty_is_on_the_logit_written_out():
    """Issue 42: with ℓ(x) = Σ W·x + c the logit's input gradient is W, so the default penalty is λ·(‖W‖_F − 1)²
    for every sample (the code's sigmoid form would scale the norm by f(1 − f) ≤ 1/4)."""
    from fedistill.algorithms.dafkd import penalty_score

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(1, 4, 4, generator=gen)

    class Linear:
        def logits(self, model, v):
            return (v * weight).sum(dim=(1, 2, 3)) + 0.2

    real, fake = torch.randn(3, 1, 4, 4, generator=gen), torch.randn(3, 1, 4, 4, generator=gen)
    mix = torch.tensor([0.1, 0.5, 0.9])
    gp = float(interpolation_gradient_penalty(penalty_score(Linear(), None, "logit"), real, fake, mix, 0.3).detach())
    assert math.isclose(gp, 0.3 * (math.sqrt(float((weight**2).sum())) - 1) ** 2, rel_tol=1e-5)
    sigmoid = float(interpolation_gradient_penalty(penalty_score(Linear(), None, "sigmoid"), real, fake, mix, 0.3).detach())
    assert not math.isclose(sigmoid, gp, rel_tol=1e-3)
    assert DaFKDParams().gradient_penalty_on == "logit"


def test_generator_output_is_read_as_pixels_and_normalised_like_the_data(digits):
    """Code profile point 1: tanh's −1, 0, 1 are the authors' pixels 0, ½, 1, normalised with the run's
    mean/std ((p − 0.3)/0.4 for digits); ``generator_output: tanh`` feeds the raw output."""
    scale, shift = output_map((0.3,), (0.4,), (1, 8, 8), torch.device("cpu"))
    with pytest.raises(ConfigError, match="generator_output: tanh"):  # no silent guess of the normalisation
        output_map((), (), (1, 8, 8), torch.device("cpu"))
    g = torch.tensor([-1.0, 0.0, 1.0]).view(1, 1, 1, 3)
    assert torch.allclose(g * scale + shift, torch.tensor([(0 - 0.3) / 0.4, (0.5 - 0.3) / 0.4, (1 - 0.3) / 0.4]).view(1, 1, 1, 3))
    for output, low, high in (("data", -0.75, 1.75), ("tanh", -1.0, 1.0)):
        sim = Simulation(small_config(**DAFKD, **QUICK, **{"algorithm.generator_output": output}), digits)
        x = sim.algorithm.server_distill_inputs(sim.server, 2)
        assert float(x.min()) >= low - 1e-5 and float(x.max()) <= high + 1e-5
        assert float(x.max()) > 0.5 * high  # the range is used, not just bounded
    assert (sim.server.input_mean, sim.server.input_std) == ((0.3,), (0.4,))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_distillation_inputs_are_drawn_in_the_profiles_mode_from_the_round_start_generator(digits, mode):
    """Code profile point 3: the code draws its distillation inputs with the generator in train mode, one
    batch at a time (BatchNorm on each batch's statistics); ``distill_bn_mode: eval`` uses the running
    statistics. Written out with a fresh DCGAN loaded with θ_g^t; the generator's buffers stay as they were."""
    batch = 16
    overrides = {"algorithm.distill_bn_mode": mode, "algorithm.distill_batch_size": batch}
    sim = Simulation(small_config(**DAFKD, **QUICK, **overrides), digits)
    sim.run_round(1)
    state = sim.server.state[GENERATOR_KEY].clone()
    x = sim.algorithm.server_distill_inputs(sim.server, 2)
    assert torch.equal(sim.server.state[GENERATOR_KEY], state)
    reference = build_generator("dcgan", (1, 8, 8), 10, noise_dim=16, ngf=16)
    set_flat(reference, state)
    noise = torch.randn(64, 16, generator=torch.Generator().manual_seed(sim.algorithm.distill_noise_seed(sim.server.seed, 2)))
    with torch.no_grad():  # eval first: a train-mode forward moves the running statistics
        reference.eval()
        eval_out = reference(noise)
        reference.train()
        train_out = torch.cat([reference(z) for z in noise.split(batch)])
    to_pixels = lambda g: ((g + 1) / 2 - 0.3) / 0.4  # noqa: E731
    expected, other = (train_out, eval_out) if mode == "train" else (eval_out, train_out)
    assert torch.allclose(x, to_pixels(expected), atol=1e-5)
    assert not torch.allclose(x, to_pixels(other), atol=1e-2)  # the two modes differ on this generator
    # The module the server drew them with keeps its running statistics.
    assert torch.equal(get_flat(sim.algorithm._generator.load(sim.server)), state)


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_server_distillation_cuts_the_lr_on_a_plateau_as_written_out(optimizer_name):
    """Card §4: SGD with momentum (default, ambiguity 21) or Adam at distill_lr, E_d epochs over fixed batches, lr ×
    factor once the epoch's mean loss has not improved for ``patience`` epochs (mode min, relative threshold 1e-4).
    A hand-written loop with the rule and the optimiser's update spelled out gives the same student; without the
    cut, or with the other optimiser, it would not."""
    from torch import nn

    from fedistill.algorithms.dafkd import DaFKDParams, distil

    gen = torch.Generator().manual_seed(5)
    inputs = torch.randn(12, 4, generator=gen)
    log_target = torch.log_softmax(3 * torch.randn(12, 3, generator=gen), dim=1)
    lr = 0.5 if optimizer_name == "adam" else 2.0
    p = DaFKDParams(
        distill_epochs=8, distill_batch_size=4, distill_lr=lr, plateau_factor=0.2, plateau_patience=0,
        ensemble_space="probs", temperature=1.0, kd_reduction="batchmean", distill_optimizer=optimizer_name,
    )  # fmt: skip
    torch.manual_seed(0)
    student = nn.Linear(4, 3)
    by_hand = nn.Linear(4, 3)
    by_hand.load_state_dict(student.state_dict())
    distil(student, inputs, log_target, p, "fp32")

    params = list(by_hand.parameters())
    group_lr = lr
    moments = [[torch.zeros_like(q), torch.zeros_like(q)] for q in params]  # SGD: velocity; Adam: m, v
    steps = 0
    best, bad, cuts = float("inf"), 0, 0
    for _ in range(8):
        total = 0.0
        for start in range(0, 12, 4):
            log_s = torch.log_softmax(by_hand(inputs[start : start + 4]), dim=1)
            q = log_target[start : start + 4].exp()
            loss = (q * (log_target[start : start + 4] - log_s)).sum() / 4
            grads = torch.autograd.grad(loss, params)
            steps += 1
            with torch.no_grad():
                for w, g, state in zip(params, grads, moments):
                    if optimizer_name == "sgd":  # v ← μ v + g (v = g on the first step), w ← w − lr v
                        state[0] = g.clone() if steps == 1 else 0.9 * state[0] + g
                        w -= group_lr * state[0]
                    else:  # Adam, betas (0.9, 0.999), eps 1e-8, bias-corrected
                        state[0] = 0.9 * state[0] + 0.1 * g
                        state[1] = 0.999 * state[1] + 0.001 * g * g
                        m_hat, v_hat = state[0] / (1 - 0.9**steps), state[1] / (1 - 0.999**steps)
                        w -= group_lr * m_hat / (v_hat.sqrt() + 1e-8)
            total += float(loss.detach()) * 4
        mean = total / 12
        if mean < best * (1 - 1e-4):
            best, bad = mean, 0
        else:
            bad += 1
        if bad > 0:  # patience 0
            group_lr *= 0.2
            bad, cuts = 0, cuts + 1
    assert cuts >= 1  # the written-out run does hit a plateau, so the schedule matters here
    for a, b in zip(student.parameters(), by_hand.parameters()):
        assert torch.allclose(a, b, atol=1e-5)


def test_server_distillation_moves_the_features_only_where_the_head_sees_them():
    """Issue 61's mechanism on a small case (card ambiguity 21). The KL's gradient reaches the features through the
    head, ∂L/∂φ = Hᵀ(s − q), so an SGD step moves φ inside the head's row space (to first order; the head moves
    too). Adam divides each weight's step by its own running scale, which turns the update out of that subspace:
    the features also move along the head's null space, where the logits do not see it (on MNIST α = 0.05 seed 1
    round 4: 23.0 against SGD's 11.9 on real images, the features 3.3x against 2.2x). Invisible to the server's
    KL, that growth is what the next round's clients meet: a client's CE step on the head changes its logits by
    lr·(‖φ‖² + 1)·(p − y), so the one-class ones drift far, and their average fell to chance (9.8 % against 28.9 %
    from the same step on SGD). Here: a linear feature layer and a head, distilled towards a teacher 1.5x more
    confident on the generated inputs, measured on other ("real") inputs. Fails with the code's Adam as the default."""
    from torch import nn

    from fedistill.algorithms.dafkd import DaFKDParams, distil

    def null_space_move(params: DaFKDParams) -> tuple[float, float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.Linear(32, 3))
        gen = torch.Generator().manual_seed(4)
        generated = torch.randn(1280, 6, generator=gen)  # the server's N = 40 x 32: 1,600 steps in 40 epochs
        real = torch.randn(64, 6, generator=gen) + 1.0
        with torch.no_grad():
            log_target = torch.log_softmax(model(generated) * 1.5 / params.temperature, dim=1)
            head_rows, _ = torch.linalg.qr(model[1].weight.T)  # orthonormal basis of the head's row space (32 x 3)
            before = model[0](real)
        distil(model, generated, log_target, params, "fp32")
        with torch.no_grad():
            moved = model[0](real) - before
            visible = moved @ head_rows @ head_rows.T
        return float((moved - visible).norm(dim=1).mean()), float(visible.norm(dim=1).mean())

    adam_null, adam_visible = null_space_move(DaFKDParams(distill_optimizer="adam", distill_lr=1e-4))
    default_null, default_visible = null_space_move(DaFKDParams())
    assert adam_null > 0.03 and adam_null > 0.5 * adam_visible  # Adam: as much unseen movement as seen
    assert default_visible > 0.01  # the default does learn (its features move where the head sees them)
    assert default_null < 0.2 * adam_null and default_null < 0.2 * default_visible  # the fix


def test_client_lr_follows_the_runs_decay_and_weight_decay_the_profile(digits, monkeypatch):
    """Code profile point 5: the joint step is Adam at client_lr (1e-4) × the run's lr decay, weight decay 0."""
    import fedistill.algorithms.dafkd as dafkd_module

    made = []
    real_adam = torch.optim.Adam

    def spy(params, **kwargs):
        made.append(kwargs)
        return real_adam(params, **kwargs)

    monkeypatch.setattr(dafkd_module.torch.optim, "Adam", spy)
    overrides = {"algorithm.profile": "code", "local.lr_decay": 0.5, "local.weight_decay": 1e-3}
    sim = Simulation(small_config(**DAFKD, **QUICK, **overrides), digits)
    sim.run_round(1)
    made.clear()
    _round(sim, 2)
    joint = made[0]  # each client makes its joint optimiser first, then the generator's
    assert math.isclose(joint["lr"], 1e-4 * 0.5) and joint["weight_decay"] == 0.0
    assert math.isclose(made[1]["lr"], 1e-4) and made[1]["weight_decay"] == 1e-4 and made[1]["amsgrad"]


def test_adam_gan_is_adam_while_the_discriminator_trains_and_the_runs_sgd_after(digits):
    """client_optimizer: adam_gan takes the joint step with Adam in the epochs whose loss holds the discriminator's
    terms and with the run's local SGD (its lr, momentum and weight decay) in the CE-only ones: a client's update
    equals the adam one's to the bit while D trains in every epoch, and the sgd one's (client_lr null) once D stops."""

    def update(optimizer, discriminator_rounds, rnd):
        overrides = {
            **QUICK, "algorithm.client_optimizer": optimizer, "algorithm.discriminator_rounds": discriminator_rounds,
            "algorithm.gan_epochs": None, "local.epochs": 2, "local.weight_decay": 1e-3,
        }  # fmt: skip
        if optimizer == "sgd":
            overrides.update({"algorithm.client_lr": None, "algorithm.client_weight_decay": None})
        sim = Simulation(small_config(**DAFKD, **overrides), digits)
        info = sim.round_info(rnd)
        return sim.client_runtime.update(0, info, sim.server_runtime.broadcast(info, 0), {})["weights"]

    assert torch.equal(update("adam_gan", None, 1), update("adam", None, 1))  # D trains: Adam at client_lr
    assert torch.equal(update("adam_gan", 1, 2), update("sgd", 1, 2))  # round 2, D done: the run's SGD
    assert not torch.equal(update("adam", 1, 2), update("sgd", 1, 2))  # the two optimisers do differ


def test_bn_teachers_score_batch_by_batch_in_train_mode_and_a_frozen_student_keeps_its_statistics(digits):
    """On a BatchNorm model (ResNet-11): in the code profile each teacher and its discriminator score the
    distillation inputs in train mode, one batch at a time; Eq. 7-8 written out (α̂ = f_k / Σ_j f_j, logits
    mixed, softmax at T = 20). The student distils in train mode, moving its running statistics, unless
    ``freeze_student_bn_stats`` keeps the real-data ones of the average."""
    from fedistill.algorithms.dafkd import named_flat
    from fedistill.data.dataset import resized

    small = resized(digits, 16)
    base = {**DAFKD, **QUICK, "dataset.resize": 16, "model.name": "resnet11", "model.kwargs": {"width": 4},
            "algorithm.distill_batch_size": 16, "algorithm.distill_epochs": 1,
            "algorithm.ensemble_space": "logits", "algorithm.temperature": 20.0}  # the code's mixture  # fmt: skip
    sim = Simulation(small_config(**base), small)
    sim.run_round(1)
    info, replies = _round(sim, 2)  # one federation round; its server step runs once per setting below
    ordered = [replies[c] for c in sorted(replies)]
    x = sim.algorithm.server_distill_inputs(sim.server, 2)
    teacher = build_model("resnet11", (1, 16, 16), 10, width=4)
    head = torch.nn.Linear(teacher.feature_dim, 1)
    logits, scores = [], []
    with torch.no_grad():
        for reply in ordered:
            set_flat(teacher, reply["weights"])
            set_flat(head, reply["discriminator"])
            teacher.train()
            features = [teacher.extract(xb) for xb in x.split(16)]
            logits.append(torch.cat([teacher.classify(f) for f in features]))
            scores.append(torch.sigmoid(torch.cat([head(f).squeeze(1) for f in features])))
    f = torch.stack(scores)
    mixed = sum((f[k] / f.sum(dim=0)).unsqueeze(1) * logits[k] for k in range(len(ordered)))
    target = sim.algorithm.teacher_target(sim.server, x, ordered)
    assert torch.allclose(target.exp(), torch.softmax(mixed / 20, dim=1), atol=1e-5)
    average = weighted_mean([r["weights"] for r in ordered], aggregation_weights([int(r["num_samples"]) for r in ordered]))
    results = {}
    for freeze in (False, True):
        sim.algorithm.params = sim.algorithm.params.model_copy(update={"freeze_student_bn_stats": freeze})
        set_flat(sim.server.model, average)
        sim.algorithm.aggregate(sim.server, info, replies)
        results[freeze] = (named_flat(sim.server.model, get_flat(sim.server.model)), named_flat(sim.server.model, average))
    for freeze, (tuned, average) in results.items():
        stats = [n for n in tuned if "running_" in n]
        assert stats
        kept = all(torch.equal(tuned[n], average[n]) for n in stats)
        assert kept is freeze
        assert any(not torch.equal(tuned[n], average[n]) for n in tuned if "running_" not in n)  # weights moved


def test_server_step_moves_the_average_to_the_teachers_and_raises_accuracy_where_they_are_better(digits):
    """Issue 24's end-to-end check of the server step itself, on the label-skewed digits (α = 0.5): the code
    profile's distillation (importance-weighted teachers mixed as logits at T = 20, the code's Adam 1e-4, 40 epochs) fed 512
    real images without their labels in place of the generator's, with the mixture distilled as it is (the code's
    target; the default's correction of its class prior is tested below). On those inputs the distilled model must
    reproduce its target (≥ 85 % argmax agreement, its accuracy there within 5 points of the teacher's), so
    in every round where the teachers beat the average ŵ by 2 points or more the step must raise accuracy, and it
    must do so at least once. A flipped KD sign, the student as its own teacher or a step that does nothing fails
    this. What it does not claim: on digits the teachers often trail ŵ after a few rounds, and the step then
    lowers accuracy by design (benchmarks/RESULTS.md, "DaFKD fidelity")."""
    cfg = small_config(
        rounds=4, clients_per_round=5,
        **{"algorithm.name": "dafkd", "partition.num_clients": 10, "partition.alpha": 0.5, "local.epochs": 2,
           "algorithm.target_prior": "teachers", "algorithm.teacher_scale": "raw",
           "algorithm.ensemble_space": "logits", "algorithm.temperature": 20.0,  # the code's mixture
           # the code's Adam: on this seed its rounds have teachers 2+ points above ŵ, which the check needs (the
           # default's SGD step reproduces its target here too, agreement 0.95-0.99, but its rounds have none;
           # the SGD update itself is written out in the plateau test)
           "algorithm.distill_optimizer": "adam", "algorithm.distill_lr": 1e-4},
    )  # fmt: skip
    sim = Simulation(cfg, digits)
    pipeline = sim.server_runtime.test_pipeline
    inputs, labels = next(pipeline.test_batches(512))
    algorithm, model = sim.algorithm, sim.server_runtime.server.model
    algorithm.server_distill_inputs = lambda server, rnd: inputs
    refine, rounds = algorithm.refine, []

    def accuracy_on_inputs() -> float:
        model.eval()
        with torch.no_grad():
            return 100.0 * float((model(inputs).argmax(1) == labels).float().mean())

    def measured_refine(server, info, replies, cids):
        if not algorithm.distils(info.round):
            return refine(server, info, replies, cids)
        # The target the step distils (the default's: the mixture with ŵ's class prior on the batch, issue 61).
        teacher = distillation_target(
            algorithm.teacher_target(server, inputs, replies),
            lambda: algorithm.student_log_probs(server, inputs),
            algorithm.params.target_prior,
        ).argmax(1)
        before = accuracy_on_inputs()
        metrics = refine(server, info, replies, cids)
        model.eval()
        with torch.no_grad():
            student = model(inputs).argmax(1)
        rounds.append((before, 100.0 * float((teacher == labels).float().mean()), accuracy_on_inputs(), float((student == teacher).float().mean())))
        return metrics

    algorithm.refine = measured_refine
    sim.run()
    assert len(rounds) == 3
    shown = [tuple(round(v, 2) for v in r) for r in rounds]  # (before, teacher, after, agreement) per round
    for before, teacher, after, agreement in rounds:
        assert agreement >= 0.85 and abs(after - teacher) <= 5.0, shown
        if teacher >= before + 2.0:
            assert after > before, shown
    assert any(teacher >= before + 2.0 for before, teacher, _, _ in rounds), shown


# -- issue 61: the collapse under extreme skew and the aggregate's class prior -----------------------------


def test_scale_matched_logits_by_hand_and_its_invariants():
    """Card ambiguity 20: ``z̃ = (z − z̄)·σ(r)/σ(z)`` per teacher and sample. By hand: z = (1, 2, 3) has centred
    logits (−1, 0, 1) and σ = √(2/3); r = (0, 0, 6) has σ = √8; so z̃ = (−1, 0, 1)·√12. A teacher with equal logits
    stays zero; on random logits the ranking is kept and σ(z̃) is the reference's, whatever the teacher's scale."""
    got = scale_matched_logits(torch.tensor([[[1.0, 2.0, 3.0]], [[5.0, 5.0, 5.0]]]), torch.tensor([[0.0, 0.0, 6.0]]))
    assert torch.allclose(got[0, 0], torch.tensor([-1.0, 0.0, 1.0]) * math.sqrt(12.0), atol=1e-5)
    assert torch.equal(got[1, 0], torch.zeros(3))
    g = torch.Generator().manual_seed(0)
    teachers = torch.randn(3, 50, 10, generator=g) * torch.tensor([1.0, 40.0, 800.0]).view(3, 1, 1)
    reference = torch.randn(50, 10, generator=g) * 3 + 7
    scaled = scale_matched_logits(teachers, reference)
    assert torch.equal(scaled.argsort(dim=2), teachers.argsort(dim=2))
    assert torch.allclose(scaled.std(dim=2, unbiased=False), reference.std(dim=1, unbiased=False).expand(3, 50), rtol=1e-4)
    assert torch.allclose(scaled.mean(dim=2), torch.zeros(3, 50), atol=1e-4)
    # shrink_only: the quiet teacher (σ 1 against the reference's 3) keeps its logits, the loud ones come down
    capped = scale_matched_logits(teachers, reference, shrink_only=True)
    centred = teachers - teachers.mean(dim=2, keepdim=True)
    quiet = centred.std(2, unbiased=False) <= reference.std(1, unbiased=False)
    assert quiet[0].float().mean() > 0.9 and not quiet[1:].any()
    assert torch.allclose(capped[quiet], centred[quiet]) and torch.allclose(capped[1:], scaled[1:], rtol=1e-4, atol=1e-4)
    # per="teacher": one factor per teacher, √(mean_i σ(r_i)² / mean_i σ(z_{k,i})²), by hand on two samples
    two = scale_matched_logits(torch.tensor([[[0.0, 2.0], [0.0, 6.0]]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]]), per="teacher")
    factor = math.sqrt(0.25 / ((1.0 + 9.0) / 2))  # σ(r_i) = 0.5 on both; σ(z) = 1 and 3
    assert torch.allclose(two, torch.tensor([[[-1.0, 1.0], [-3.0, 3.0]]]) * factor, atol=1e-6)


def test_prior_corrected_target_written_out():
    """``q̃_ic ∝ q_ic · r̄_c / q̄_c`` with ``q̄, r̄`` the batch means, by hand in loops: rows sum to 1, the ratio of
    two classes changes by the same factor on every sample, and a target whose prior is the reference's keeps
    its values."""
    gen = torch.Generator().manual_seed(3)
    log_q = torch.log_softmax(4 * torch.randn(6, 3, generator=gen), dim=1)
    log_r = torch.log_softmax(torch.randn(6, 3, generator=gen), dim=1)
    q, r = log_q.exp().tolist(), log_r.exp().tolist()
    q_bar = [sum(q[i][c] for i in range(6)) / 6 for c in range(3)]
    r_bar = [sum(r[i][c] for i in range(6)) / 6 for c in range(3)]
    expected = []
    for i in range(6):
        unnormalised = [q[i][c] * r_bar[c] / q_bar[c] for c in range(3)]
        expected.append([v / sum(unnormalised) for v in unnormalised])
    got = prior_corrected_target(log_q, log_r)
    assert torch.allclose(got.exp(), torch.tensor(expected), atol=1e-6)
    assert torch.allclose(got.exp().sum(1), torch.ones(6), atol=1e-6)
    shift = (got[:, 0] - got[:, 1]) - (log_q[:, 0] - log_q[:, 1])
    assert torch.allclose(shift, shift[0].expand(6), atol=1e-5)
    assert torch.allclose(prior_corrected_target(log_q, log_q), log_q, atol=1e-5)
    assert torch.equal(distillation_target(log_q, lambda: log_r, "teachers"), log_q)
    assert torch.equal(distillation_target(log_q, lambda: log_r, "aggregate"), got)
    uniform = prior_corrected_target(log_q, torch.full_like(log_q, -math.log(3)))
    by_hand = [[q[i][c] / q_bar[c] / sum(q[i][d] / q_bar[d] for d in range(3)) for c in range(3)] for i in range(6)]
    assert torch.allclose(uniform.exp(), torch.tensor(by_hand), atol=1e-6)  # q_ic / q̄_c, renormalised
    assert torch.equal(distillation_target(log_q, lambda: log_r, "uniform"), uniform)


def _blobs(n, gen, means):
    labels = torch.randint(0, means.shape[0], (n,), generator=gen)
    return means[labels] + torch.randn(n, means.shape[1], generator=gen), labels


class _BlobTask:
    """The small case of issue 61's mechanism tests: four Gaussian classes in 8 dimensions (2,000 training and
    2,000 test samples from ``gen``, seeded 0), a one-hidden-layer MLP, full-batch SGD and test accuracy."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(0)
        torch.manual_seed(0)  # the MLPs' initial weights
        means = 3 * torch.randn(4, 8, generator=self.gen)
        self.x_train, self.y_train = _blobs(2000, self.gen, means)
        self.x_test, self.y_test = _blobs(2000, self.gen, means)

    @staticmethod
    def mlp():
        from torch import nn

        return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))

    def train(self, model, steps):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(self.x_train), self.y_train)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return model

    def accuracy(self, model):
        with torch.no_grad():
            return 100.0 * float((model(self.x_test).argmax(1) == self.y_test).float().mean())

    def student_and_better(self):
        """ŵ after 3 steps (about 97 %) and a better model of the same data: ŵ trained 57 steps more."""
        student = self.train(self.mlp(), 3)
        better = self.mlp()
        better.load_state_dict(student.state_dict())
        return student, self.train(better, 60)


@pytest.mark.parametrize("target_prior", ["default", "aggregate", "teachers"])
def test_one_class_teachers_throw_the_student_to_chance_unless_the_target_corrects_their_prior(target_prior):
    """Issue 61's mechanism on a small case. Four Gaussian classes; a student (ŵ) at about 97 %; three teachers
    that are a better model of the same data plus +6 on class 0's logit (every near-one-class client prefers its
    class, and here they share one). On noise inputs (the generator's samples) the mixture names class 0 for
    every sample. Distilled as it is (the code's, ``teachers``), with the default's mixture and 40 epochs, the
    student learns the +6 as a prior and every real sample goes to class 0: chance. With the default's target (a
    uniform prior on the batch) or the aggregate's prior it keeps its accuracy and moves towards the teachers'
    per-sample preferences (it gains). This test fails if the default distils the teachers' prior."""
    task = _BlobTask()
    gen, accuracy = task.gen, task.accuracy
    student, better = task.student_and_better()
    before = accuracy(student)
    assert 90.0 < before < accuracy(better) - 1.0
    with torch.no_grad():
        better[2].bias[0] += 6.0
    p = make_algorithm(small_config(**DAFKD)).params
    if target_prior != "default":
        p = p.model_copy(update={"target_prior": target_prior})
    p = p.model_copy(update={"distill_samples": 320})  # 10 batches x 40 epochs: the default's epochs and rates
    noise = 2 * torch.randn(p.distill_samples, 8, generator=gen)
    with torch.no_grad():
        teacher_logits = torch.stack([better(noise)] * 3)
        log_q = domain_aware_teacher(teacher_logits, torch.full((3, noise.shape[0]), -math.log(3)), p.temperature, p.ensemble_space)
        assert float((log_q.argmax(1) == 0).float().mean()) > 0.99  # one class for the whole generated batch
        target = distillation_target(log_q, lambda: torch.log_softmax(student(noise) / p.temperature, dim=1), p.target_prior)
    distil(student, noise, target, p, "fp32")
    after = accuracy(student)
    if target_prior == "teachers":
        share = float((student(task.x_test).argmax(1) == 0).float().mean())
        assert after < 30.0 and share > 0.95, (after, share)  # chance: 25 %
    else:
        assert after > before, (before, after)


@pytest.mark.parametrize("mixture", ["default", "logits_t20"])
def test_one_loud_teacher_outvotes_the_rest_in_logit_space_and_not_as_probabilities(mixture):
    """Issue 61's second mechanism (card ambiguity 22) on a small case. Four Gaussian classes; a student (ŵ) at
    about 97 %; three teachers that are a better model of the same data, routed 0.3 each on every sample, and one
    loud one-class teacher routed 0.1: a random head with logits hundreds wide that vary from sample to sample
    (MNIST α = 0.05 seed 4's round-5 teachers: spreads up to 802 on the generated batch, the aggregate's 7). Mixed
    as logits at T = 20 (the code's), 0.1 of the loud teacher's logits outweighs 0.9 of the others' on most
    samples, the target follows its noise and the student loses 20 points in one step. Mixed as probabilities at
    T = 1 (the paper's Eq. 8, the default), the loud teacher moves each target by at most its 0.1 and the student
    gains. This test fails if the default mixes logits or a teacher's vote is not bounded by its weight."""
    task = _BlobTask()
    gen, accuracy = task.gen, task.accuracy
    student, better = task.student_and_better()
    loud = task.mlp()
    with torch.no_grad():
        loud[2].weight.mul_(60.0)
        loud[2].bias[0] += 300.0
    p = make_algorithm(small_config(**DAFKD)).params.model_copy(update={"distill_samples": 320})
    if mixture == "logits_t20":
        p = p.model_copy(update={"ensemble_space": "logits", "temperature": 20.0})
    noise = 2 * torch.randn(p.distill_samples, 8, generator=gen)
    before = accuracy(student)
    assert 90.0 < before < accuracy(better) - 1.0
    with torch.no_grad():
        loud_logits, good_logits = loud(noise), better(noise)
        spread = lambda z: float((z.max(1).values - z.min(1).values).mean())  # noqa: E731
        assert spread(loud_logits) > 100 * spread(good_logits)
        log_alpha = torch.tensor([0.3, 0.3, 0.3, 0.1]).log()[:, None].expand(4, noise.shape[0])
        log_q = domain_aware_teacher(torch.stack([good_logits] * 3 + [loud_logits]), log_alpha, p.temperature, p.ensemble_space)
        agreement = float((log_q.argmax(1) == good_logits.argmax(1)).float().mean())
        if p.ensemble_space == "probs":  # card 22's invariant: the loud teacher moves each q_ic by at most its α̂
            loud_share = log_q.exp() - 0.9 * torch.softmax(good_logits / p.temperature, dim=1)
            assert float(loud_share.min()) >= -1e-6 and float(loud_share.max()) <= 0.1 + 1e-6
        target = distillation_target(log_q, lambda: torch.log_softmax(student(noise) / p.temperature, dim=1), p.target_prior)
    distil(student, noise, target, p, "fp32")
    after = accuracy(student)
    if mixture == "logits_t20":
        assert agreement < 0.5 and after < before - 10.0, (agreement, before, after)
    else:
        assert agreement > 0.85 and after > before, (agreement, before, after)


@pytest.mark.parametrize("target_prior", ["default", "aggregate"])
def test_an_aggregate_at_chance_is_lifted_by_the_uniform_prior_and_held_there_by_its_own(target_prior):
    """Issue 61's third mechanism (card ambiguity 22) on a small case: the clients' average itself at chance (MNIST
    α = 0.05 seed 4 round 6: 9.9 %, one class for the whole test set). Four Gaussian classes; ŵ is a good model
    with +20 on class 0's logit, so it calls every sample class 0 (chance, 25 %); three good teachers. The
    aggregate's prior (``target_prior: aggregate``) moves the target's class shares on the batch to ŵ's own,
    about all class 0, so the target names class 0 again and the step keeps ŵ at chance (the replay of that round:
    9.9 → 10.2 %). A uniform prior (the default) keeps the teachers' per-sample preferences and gives each class
    an equal share, and the student recovers (the replay: 9.9 → 61.7 %). This test fails if the default takes
    the aggregate's prior."""
    task = _BlobTask()
    gen, accuracy = task.gen, task.accuracy
    good = task.train(task.mlp(), 60)
    student = task.mlp()
    student.load_state_dict(good.state_dict())
    with torch.no_grad():
        student[2].bias[0] += 20.0

    assert accuracy(student) < 30.0 < 90.0 < accuracy(good)
    p = make_algorithm(small_config(**DAFKD)).params.model_copy(update={"distill_samples": 320})
    if target_prior != "default":
        p = p.model_copy(update={"target_prior": target_prior})
    noise = 2 * torch.randn(p.distill_samples, 8, generator=gen)
    with torch.no_grad():
        log_q = domain_aware_teacher(torch.stack([good(noise)] * 3), torch.full((3, noise.shape[0]), -math.log(3)), p.temperature, p.ensemble_space)
        target = distillation_target(log_q, lambda: torch.log_softmax(student(noise) / p.temperature, dim=1), p.target_prior)
    distil(student, noise, target, p, "fp32")
    after = accuracy(student)
    if target_prior == "aggregate":
        assert after < 30.0, after
    else:
        assert after > 80.0, after
