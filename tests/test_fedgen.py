"""FedGen invariants from spec/fedgen.md §7, and its client and server losses written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_learns, assert_resume_is_exact, assert_same_rounds, small_config

from fedistill.algorithms.base import Message
from fedistill.algorithms.fedgen import ADAM_KEYS, GENERATOR_KEY
from fedistill.simulation import Simulation
from fedistill.losses import class_ensemble_weights, diversity_loss, fedgen_teacher_loss, qualified_labels, stacked_head_logits
from fedistill.models import build_model
from fedistill.models.flat import get_flat, num_flat, set_flat
from fedistill.models.generators import FeatureGenerator

FEDGEN = {"algorithm.name": "fedgen"}


@pytest.mark.parametrize(
    "d, hidden, features, classes, expected",
    [(32, 256, 32, 10, 19_744), (32, 256, 32, 26, 23_840), (64, 512, 32, 10, 55_840)],
)
def test_generator_parameter_counts_match_the_card(d, hidden, features, classes, expected):
    generator = FeatureGenerator(d, classes, features, hidden)
    assert sum(p.numel() for p in generator.parameters()) == expected
    assert num_flat(generator) == expected + 2 * hidden  # what travels: parameters + BN running mean/var


def test_generator_output_shape_and_label_dependence():
    generator = FeatureGenerator(32, 10, 64, 256).eval()
    eps = torch.randn(8, 32)
    a = generator(eps, torch.zeros(8, dtype=torch.long))
    b = generator(eps, torch.full((8,), 3, dtype=torch.long))
    assert a.shape == (8, 64)
    assert not torch.allclose(a, b)


def test_label_weights_sum_to_one_and_qualified_labels_need_a_processed_sample():
    raw = torch.tensor([[5, 0, 0, 2], [0, 0, 7, 1], [3, 0, 0, 0]])
    counts = 1.0 + raw.double()  # the card's +1 prior
    omega = class_ensemble_weights(counts)
    assert bool((omega >= 0).all())
    assert torch.allclose(omega.sum(dim=0), torch.ones(4))
    assert torch.allclose(omega[:, 0], torch.tensor([6 / 11, 1 / 11, 4 / 11]))
    assert torch.allclose(omega[:, 1], torch.full((3,), 1 / 3))  # nobody processed label 1
    assert qualified_labels(counts).tolist() == [True, False, True, True]


def test_teacher_loss_written_out():
    """Σ_k (1/B) Σ_b ω_{y_b,k} CE(h_k(ẑ_b), y_b), and the code's batch-scalar product (card ambiguity 3)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 4, generator=gen)
    labels = torch.tensor([0, 2, 2, 3, 1])
    omega = torch.rand(3, 4, generator=gen)
    omega = omega / omega.sum(dim=0)
    per_sample = batch_scalar = 0.0
    for k in range(3):
        ces, ws = [], []
        for b in range(5):
            row = logits[k, b].tolist()
            ce = -row[labels[b]] + math.log(sum(math.exp(v) for v in row))
            ces.append(ce)
            ws.append(float(omega[k, labels[b]]))
        per_sample += sum(c * w for c, w in zip(ces, ws)) / 5
        batch_scalar += (sum(ces) / 5) * (sum(ws) / 5)
    assert math.isclose(float(fedgen_teacher_loss(logits, labels, omega)), per_sample, rel_tol=1e-6)
    assert math.isclose(float(fedgen_teacher_loss(logits, labels, omega, "batch_scalar")), batch_scalar, rel_tol=1e-6)


def test_diversity_loss_on_features_is_bounded():
    eps = torch.randn(6, 4)
    same = torch.ones(6, 3)
    assert float(diversity_loss(same, eps)) == 1.0
    spread = torch.randn(6, 3)
    value = float(diversity_loss(spread, eps))
    assert 0.0 < value < 1.0
    assert float(diversity_loss(2 * spread, eps)) < value


def _round(sim, rnd):
    """Broadcast and run the clients of one round by hand; returns (info, {cid: reply})."""
    info = sim.round_info(rnd)
    replies = {}
    for cid in sim.server_runtime.select_clients(rnd):
        replies[cid] = sim.client_runtime.update(cid, info, sim.server_runtime.broadcast(info, cid), {})
    return info, replies


def test_client_regulariser_written_out(digits):
    """Round 2 (card t = 1): (B_g/B)·α_t·CE(h(G(ε,ŷ)), ŷ) + β_t·KL(σ(h(G(ε,y))) ‖ σ(f(x))), by hand (card §3)."""
    cfg = small_config(**FEDGEN, **{"algorithm.generative_alpha": 3.0, "algorithm.generative_beta": 2.0,
                                    "algorithm.gen_batch_size": 16})  # fmt: skip
    sim = Simulation(cfg, digits)
    server = sim.server
    # Non-trivial BN running statistics, so that eval mode on the client matters.
    template = FeatureGenerator(32, 10, 64, 256)
    set_flat(template, server.state[GENERATOR_KEY])
    with torch.no_grad():
        template.bn.running_mean.uniform_(-0.5, 0.5)
        template.bn.running_var.uniform_(0.5, 2.0)
    server.state[GENERATOR_KEY] = get_flat(template)
    info = sim.round_info(2)
    msg = sim.server_runtime.broadcast(info, 0)
    assert math.isclose(msg["generative_alpha"], 3.0 * 0.98) and math.isclose(msg["generative_beta"], 2.0 * 0.98)
    ctx = sim.client_runtime.context(0, 2, {})
    model = ctx.model
    set_flat(model, msg["weights"])
    term = sim.client_runtime.algorithm.extra_loss(ctx, msg)
    x, y = ctx.data.train_batch(ctx.train_indices[:32], torch.Generator().manual_seed(1))
    rng_state = ctx.generator.get_state()
    term.prepare_step(32)  # local_sgd draws the step's noise and labels before the step (prepare_hook)
    value = term(model, x, y, model(x), None)

    # -- by hand --
    rng = torch.Generator()
    rng.set_state(rng_state)
    eps = torch.randn(32, 32, generator=rng)  # the draws, in the client's order: ε for y, ŷ, ε for ŷ
    sampled = torch.randint(10, (16,), generator=rng)
    eps_g = torch.randn(16, 32, generator=rng)
    s = template.state_dict()

    def generate(noise, labels):
        inputs = torch.cat([noise, torch.eye(10)[labels]], dim=1)
        pre = inputs @ s["fc1.weight"].T + s["fc1.bias"]
        normed = (pre - s["bn.running_mean"]) / torch.sqrt(s["bn.running_var"] + 1e-5) * s["bn.weight"] + s["bn.bias"]
        return torch.clamp(normed, min=0) @ s["fc2.weight"].T + s["fc2.bias"]

    def softmax(z):
        e = torch.exp(z - z.max(dim=1, keepdim=True).values)
        return e / e.sum(dim=1, keepdim=True)

    with torch.no_grad():
        w, b = model.classifier.weight, model.classifier.bias
        p_gen = softmax(generate(eps_g, sampled) @ w.T + b)
        ce = -torch.log(p_gen[torch.arange(16), sampled]).mean()
        target = softmax(generate(eps, y) @ w.T + b)
        q = softmax(model(x))
        kl = (target * (torch.log(target) - torch.log(q))).sum() / 32
        expected = (16 / 32) * (3.0 * 0.98) * ce + (2.0 * 0.98) * kl
    assert torch.allclose(value.detach(), expected, rtol=1e-5, atol=1e-6)

    # Gradients reach the client model only: the generator is frozen and not in the client's optimizer.
    value.backward()
    generator = sim.client_runtime.algorithm._client_generator
    assert all(p.grad is None and not p.requires_grad for p in generator.parameters())
    assert model.classifier.weight.grad is not None


def test_round_one_is_fedavg_and_server_training_never_touches_the_model(digits):
    # Round 1 is the card's t = 0: CE only, so FedGen's client update and aggregate equal FedAvg's bit for bit.
    # (FedGen's clients run plain SGD by default, its card's optimiser: FedAvg is compared on the same one.)
    plain_fedavg = small_config(algorithm="fedavg", **{"local.momentum": 0.0})
    assert small_config(**FEDGEN).local.momentum == 0.0
    assert_same_rounds(plain_fedavg, small_config(**FEDGEN), digits, rounds=1)
    # With the client terms off, the generator trained every round on the server never changes θ.
    off = small_config(**FEDGEN, **{"algorithm.regularization": False})
    assert_same_rounds(plain_fedavg, off, digits, rounds=2)


def test_server_samples_only_qualified_labels_and_updates_generator_and_adam(digits, monkeypatch):
    import fedistill.algorithms.fedgen as fedgen_module

    seen: list[torch.Tensor] = []
    real = fedgen_module.fedgen_teacher_loss

    def spy(logits, labels, weights, weighting="per_sample"):
        seen.append(labels.clone())
        return real(logits, labels, weights, weighting)

    monkeypatch.setattr(fedgen_module, "fedgen_teacher_loss", spy)
    sim = Simulation(small_config(**FEDGEN, **{"algorithm.generator_steps": 7}), digits)
    info, replies = _round(sim, 1)
    # Labels 0, 1, 2 only: every client "processed" nothing else this round.
    ordered = []
    for cid in sorted(replies):
        counts = replies[cid]["label_counts"].clone()
        counts[3:] = 0
        counts[:3] += 1
        ordered.append(Message({**replies[cid], "label_counts": counts}))
    before = sim.server.state[GENERATOR_KEY].clone()
    model_before = get_flat(sim.server.model)
    metrics = sim.algorithm.refine(sim.server, info, ordered, sorted(replies))
    assert len(seen) == 7 and all(int(l.max()) <= 2 for l in seen)
    assert torch.equal(get_flat(sim.server.model), model_before)  # β_ens = 0: the global model is not touched
    assert not torch.equal(sim.server.state[GENERATOR_KEY], before)
    assert float(sim.server.state[ADAM_KEYS[2]]) == 7.0
    assert 0.0 < metrics["fedgen_diversity"] <= 1.0


def test_coefficients_decay_with_a_floor():
    cfg = small_config(**FEDGEN, **{"algorithm.generative_alpha": 10.0, "algorithm.generative_beta": 1.0})
    from fedistill.algorithms.build import make_algorithm

    algorithm = make_algorithm(cfg)
    assert algorithm.coefficients(1) == (10.0, 1.0)  # engine round 1 = card t = 0
    alpha, beta = algorithm.coefficients(11)
    assert math.isclose(alpha, 10.0 * 0.98**10) and math.isclose(beta, 0.98**10)
    assert algorithm.coefficients(2000) == (1e-4, 1e-4)


def test_bytes_download_model_generator_two_scalars_upload_fedavg_plus_counts(digits):
    fedavg = Simulation(small_config(algorithm="fedavg", rounds=1), digits).run()[-1]
    fedgen = Simulation(small_config(**FEDGEN, rounds=1), digits).run()[-1]
    clients, classes, hidden = 3, 10, 256
    model = build_model("digits_cnn", (1, 8, 8), 10)
    generator_floats = (32 + classes) * hidden + hidden + 2 * hidden + hidden * model.feature_dim + model.feature_dim
    generator_floats += 2 * hidden  # BN running mean and variance
    assert fedgen["bytes_down"] == fedavg["bytes_down"] + clients * (4 * generator_floats + 2 * 8)
    assert fedgen["bytes_up"] == fedavg["bytes_up"] + clients * 8 * classes


def test_fedgen_learns_and_resumes_exactly(digits, tmp_path):
    # FedGen's clients use plain SGD (card §5); with momentum 0.9 and lr 0.05 the α₀ = 10 term diverges.
    assert_resume_is_exact(digits, tmp_path, "fedgen", server_keys=(GENERATOR_KEY, *ADAM_KEYS))
    assert_learns(digits, "fedgen", **{"local.momentum": 0.0})


def test_label_counts_are_the_processed_labels_or_the_histogram(digits):
    """c_k − 1 = E · n_k (each sample is processed once per epoch, card ambiguity 2), or n_k with label_counts=dataset."""
    for mode, epochs in (("processed", 2), ("dataset", 2)):
        cfg = small_config(**FEDGEN, **{"algorithm.label_counts": mode, "local.epochs": epochs})
        sim = Simulation(cfg, digits)
        info, replies = _round(sim, 1)
        for cid, reply in replies.items():
            labels = digits.train_y[sim.federation.train_indices[cid]]
            histogram = torch.bincount(labels, minlength=10)
            assert torch.equal(reply["label_counts"], histogram * (epochs if mode == "processed" else 1))


@pytest.mark.parametrize("term", ["teacher", "diversity"])
def test_one_generator_step_lowers_the_term_it_weights(digits, term):
    """J = α_ens·Σ ω CE(h_k(G(ε, y)), y) + η_ens·L_div is minimised (card §3): one small Adam step with one term
    switched on lowers that term on the same (ε, y), recomputed here from the uploaded heads (a flipped sign
    raises it)."""
    from fedistill.algorithms.fedgen import draw_noise, head_slices
    from fedistill.engine.seeding import FEDGEN as TAG
    from fedistill.engine.seeding import make_generator

    coefficients = {"algorithm.alpha_ens": 1.0, "algorithm.eta_ens": 0.0} if term == "teacher" else {"algorithm.alpha_ens": 0.0, "algorithm.eta_ens": 1.0}
    sim = Simulation(small_config(**FEDGEN, **coefficients, **{"algorithm.generator_steps": 1, "algorithm.generator_lr": 1e-3}), digits)
    info, replies = _round(sim, 1)
    ordered = [replies[c] for c in sorted(replies)]
    p = sim.algorithm.params
    counts = 1.0 + torch.stack([r["label_counts"].double() for r in ordered])
    labels_q = torch.nonzero(qualified_labels(counts)).flatten()
    rng = make_generator(sim.server.seed, TAG, info.round)
    y = labels_q[torch.randint(labels_q.numel(), (p.generator_batch_size,), generator=rng)]
    eps = draw_noise(p.generator_batch_size, p.noise_dim, p.noise, rng)
    w_slice, b_slice = head_slices(sim.server.model)
    heads = [(r["weights"][w_slice].view(10, -1), r["weights"][b_slice]) for r in ordered]
    weights = class_ensemble_weights(counts)

    def value():
        generator = sim.algorithm._generator.load(sim.server).train()
        with torch.no_grad():
            features = generator(eps, y)
            if term == "diversity":
                return float(diversity_loss(features, eps))
            logits = torch.stack([features @ w.T + b for w, b in heads])
            return float(fedgen_teacher_loss(logits, y, weights))

    before = value()
    sim.algorithm.refine(sim.server, info, ordered, sorted(replies))
    after = value()
    assert after < before, (term, before, after)


def _hand_made_replies(model, counts, seed=0):
    """One reply per row of ``counts``: the model's flat vector plus small noise, and those label counts."""
    base = get_flat(model)
    noise = torch.Generator().manual_seed(seed)
    return [
        Message({"weights": base + 0.05 * torch.randn(base.shape, generator=noise),
                 "label_counts": torch.tensor(row, dtype=torch.int64), "num_samples": 10 + 5 * k})
        for k, row in enumerate(counts)
    ]  # fmt: skip


def test_server_label_weights_and_qualified_labels_use_the_plus_one_prior(digits, monkeypatch):
    """Card §3: c_k^y = 1 + (processed samples of y), ω_{y,k} = c_k^y / Σ_j c_j^y, Y_q = {y : max_k c_k^y > 1}.

    Catches a server that drops the +1 prior: with it, a client that processed no sample of a label another
    client did still gets ω = 1/(Σ_j c_j^y) > 0 (without it: 0), and a label that one client processed exactly
    once is qualified (without it: max c = 1, not > 1, the label is never generated)."""
    import fedistill.algorithms.fedgen as fedgen_module

    raw = [
        [5, 0, 1, 0, 0, 0, 0, 0, 0, 2],  # label 2: processed once, by client 0 only
        [0, 0, 0, 3, 0, 0, 0, 0, 0, 2],  # label 0: zero here, 5 and 7 at the others
        [7, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # labels 1, 4-8: nobody processed them
    ]
    # The card's formulas, written out with the +1.
    expected = [[0.0] * 10 for _ in raw]
    for y in range(10):
        total = sum(1 + row[y] for row in raw)
        for k, row in enumerate(raw):
            expected[k][y] = (1 + row[y]) / total
    expected_qualified = [max(1 + row[y] for row in raw) > 1 for y in range(10)]
    assert expected_qualified == [True, False, True, True, False, False, False, False, False, True]
    assert math.isclose(expected[1][0], 1 / 15) and math.isclose(expected[0][2], 2 / 4)

    seen_weights, seen_labels, seen_qualified = [], [], []
    real_loss, real_qualified = fedgen_module.fedgen_teacher_loss, fedgen_module.qualified_labels

    def loss_spy(logits, labels, weights, weighting="per_sample"):
        seen_weights.append(weights.detach().cpu().clone())
        seen_labels.append(labels.cpu().clone())
        return real_loss(logits, labels, weights, weighting)

    def qualified_spy(counts, *args, **kwargs):
        out = real_qualified(counts, *args, **kwargs)
        seen_qualified.append(out.clone())
        return out

    monkeypatch.setattr(fedgen_module, "fedgen_teacher_loss", loss_spy)
    monkeypatch.setattr(fedgen_module, "qualified_labels", qualified_spy)
    cfg = small_config(**FEDGEN, **{"algorithm.generator_steps": 2, "algorithm.noise_dim": 8, "algorithm.hidden_dim": 16})
    sim = Simulation(cfg, digits)
    replies = _hand_made_replies(sim.server.model, raw)
    sim.algorithm.refine(sim.server, sim.round_info(1), replies, [0, 1, 2])

    assert len(seen_weights) == 2 and len(seen_qualified) == 1
    for weights in seen_weights:
        torch.testing.assert_close(weights.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-7)
    assert seen_qualified[0].tolist() == expected_qualified
    # Every generated label is a qualified one, and the label processed once is among them.
    sampled = set(torch.cat(seen_labels).tolist())
    assert sampled == {y for y in range(10) if expected_qualified[y]}


def test_server_generator_trains_in_train_mode_and_never_touches_the_bn_models_statistics(digits):
    """Card §4 TrainGenerator: ``w.train()`` (its BatchNorm1d uses and updates batch statistics: after one step
    the running stats are 0.9·old + 0.1·batch mean / unbiased variance of the first layer's pre-activations on
    the step's (ε, y)); a generator left in eval mode keeps its running stats. Card §1 and ambiguity 5: nothing
    is distilled into the global model on the server, so the refine step leaves every entry of a BatchNorm
    model (resnet8) and its train/eval flags as they are, and the aggregate's BN statistics are the plain
    n_k-weighted mean of the clients' (the full state dict is averaged)."""
    from fedistill.algorithms.fedgen import draw_noise
    from fedistill.engine.seeding import FEDGEN as TAG
    from fedistill.engine.seeding import make_generator

    cfg = small_config(**FEDGEN, **{"model.name": "resnet8", "model.kwargs": {"width": 8}, "algorithm.generator_steps": 1,
                                    "algorithm.noise_dim": 8, "algorithm.hidden_dim": 16})  # fmt: skip
    sim = Simulation(cfg, digits)
    server, algorithm = sim.server, sim.algorithm
    model = server.model
    bn_names = [n for n, _ in model.named_buffers() if n.endswith(("running_mean", "running_var"))]
    assert bn_names  # the global model has BatchNorm statistics
    # Clients whose BN statistics differ from each other and from the initial ones.
    raw = [[3, 1, 0, 2, 0, 0, 4, 0, 0, 1], [0, 2, 2, 0, 5, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0, 3, 0, 2, 0, 0]]
    replies = []
    for k, reply in enumerate(_hand_made_replies(model, raw, seed=3)):
        copy = build_model("resnet8", (1, 8, 8), 10, width=8)
        set_flat(copy, reply["weights"])
        with torch.no_grad():
            for name, buf in copy.named_buffers():
                if name.endswith("running_mean"):
                    buf.uniform_(-1.0, 1.0)
                elif name.endswith("running_var"):
                    buf.uniform_(0.5, 2.0 + k)
        replies.append(Message({**reply, "weights": get_flat(copy)}))

    # The generator's BN running statistics after one train-mode step, written out.
    p = algorithm.params
    template = FeatureGenerator(p.noise_dim, 10, model.classifier.in_features, p.hidden_dim)
    set_flat(template, server.state[GENERATOR_KEY])
    rng = make_generator(server.seed, TAG, 1)
    labels_q = torch.tensor([y for y in range(10) if any(row[y] for row in raw)])
    y = labels_q[torch.randint(labels_q.numel(), (p.generator_batch_size,), generator=rng)]
    eps = draw_noise(p.generator_batch_size, p.noise_dim, p.noise, rng)
    with torch.no_grad():
        pre = template.fc1(torch.cat([eps, torch.eye(10)[y]], dim=1))
        expected_mean = 0.9 * template.bn.running_mean + 0.1 * pre.mean(dim=0)
        expected_var = 0.9 * template.bn.running_var + 0.1 * pre.var(dim=0, unbiased=True)

    seen = {}
    refine = algorithm.refine

    def watched(server_ctx, info, ordered, cids):
        seen["before"] = get_flat(model).clone()
        seen["modes"] = [m.training for m in model.modules()]
        out = refine(server_ctx, info, ordered, cids)
        seen["after"] = get_flat(model).clone()
        seen["modes_after"] = [m.training for m in model.modules()]
        return out

    algorithm.refine = watched
    algorithm.aggregate(server, sim.round_info(1), dict(enumerate(replies)))
    del algorithm.refine

    assert torch.equal(seen["before"], seen["after"]) and seen["modes"] == seen["modes_after"]
    sizes = [int(r["num_samples"]) for r in replies]
    clients = [build_model("resnet8", (1, 8, 8), 10, width=8) for _ in replies]
    for client, reply in zip(clients, replies):
        set_flat(client, reply["weights"])
    buffers = dict(model.named_buffers())
    for name in bn_names:
        mean = sum(n * dict(c.named_buffers())[name] for n, c in zip(sizes, clients)) / sum(sizes)
        torch.testing.assert_close(buffers[name], mean, rtol=1e-6, atol=1e-6)
    trained = algorithm._generator.load(server)
    torch.testing.assert_close(trained.bn.running_mean, expected_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trained.bn.running_var, expected_var, rtol=1e-5, atol=1e-6)


def test_stacked_head_logits_is_each_head_applied_in_turn():
    """[k, b, c] = Σ_d W_k[c, d] z_b[d] + b_k[c], written out with loops (both FedGen forms use it)."""
    g = torch.Generator().manual_seed(3)
    z, w, b = torch.randn(4, 5, generator=g), torch.randn(3, 2, 5, generator=g), torch.randn(3, 2, generator=g)
    out = stacked_head_logits(z, w, b)
    assert out.shape == (3, 4, 2)
    for k in range(3):
        for i in range(4):
            for c in range(2):
                expected = sum(float(w[k, c, d]) * float(z[i, d]) for d in range(5)) + float(b[k, c])
                assert float(out[k, i, c]) == pytest.approx(expected, abs=1e-5)
