"""FedDF invariants from spec/feddf.md §7, and its teacher target and student loss written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_learns, assert_resume_is_exact, assert_same_rounds, global_vectors, small_config

from fedistill.algorithms.base import Message
from fedistill.algorithms.feddf import GENERATOR_KEY
from fedistill.simulation import Simulation
from fedistill.errors import ConfigError
from fedistill.losses import ensemble_distillation, ensemble_target
from fedistill.models import build_model
from fedistill.models.flat import get_flat, set_flat

# Small enough for tests: the card's generator mode is 50 + 20 steps of a 64-wide CGeneratorA.
GENERATOR = {
    "algorithm.name": "feddf",
    "algorithm.generator_width": 16,
    "algorithm.noise_dim": 32,
    "algorithm.generator_steps": 10,
    "algorithm.student_steps": 5,
    "algorithm.pseudo_batch_size": 32,
}
PROXY = {
    "algorithm.name": "feddf",
    "algorithm.mode": "proxy",
    "algorithm.proxy_dataset": "digits",
    "algorithm.proxy_size": 256,
    "algorithm.distill_steps": 20,
}


def _softmax_rows(z: torch.Tensor) -> torch.Tensor:
    e = torch.exp(z - z.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def test_avg_logits_target_is_the_softmax_of_the_mean_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 5, generator=gen) * 3
    expected = _softmax_rows((logits[0] + logits[1] + logits[2]) / 3 / 2.0)
    target = ensemble_target(logits, "avg_logits", tau=2.0)
    assert torch.allclose(target, expected, atol=1e-6)
    assert torch.allclose(target.sum(dim=1), torch.ones(4))
    probs = ensemble_target(logits, "avg_probs")
    assert torch.allclose(probs, sum(_softmax_rows(logits[k]) for k in range(3)) / 3, atol=1e-6)
    same = logits[:1].expand(3, 4, 5)  # identical teachers: that teacher's softmax under both schemes
    assert torch.allclose(ensemble_target(same, "avg_logits"), _softmax_rows(logits[0]), atol=1e-6)
    assert torch.allclose(ensemble_target(same, "avg_probs"), _softmax_rows(logits[0]), atol=1e-6)


def test_student_loss_written_out():
    """(1/B) Σ_b Σ_c p_T,bc (log p_T,bc − log σ(s_b/T)_c), no T² factor (card §3)."""
    student = torch.tensor([[1.0, -0.5, 2.0], [0.0, 0.3, -1.2]])
    teacher = torch.tensor([[0.2, 0.1, 1.5], [-1.0, 2.0, 0.5]])
    tau = 2.0
    expected = 0.0
    for s_row, t_row in zip(student.tolist(), teacher.tolist()):
        zs = sum(math.exp(v / tau) for v in s_row)
        zt = sum(math.exp(v / tau) for v in t_row)
        for s, t in zip(s_row, t_row):
            p = math.exp(t / tau) / zt
            expected += p * (math.log(p) - math.log(math.exp(s / tau) / zs))
    expected /= 2
    target = ensemble_target(teacher[None], "avg_logits", tau)
    assert math.isclose(float(ensemble_distillation(student, target, tau)), expected, rel_tol=1e-6)


def test_teacher_equal_to_student_gives_zero_loss_and_zero_gradient():
    logits = torch.randn(6, 4, requires_grad=True)
    loss = ensemble_distillation(logits, ensemble_target(logits.detach()[None], "avg_logits"))
    (grad,) = torch.autograd.grad(loss, logits)
    assert abs(float(loss.detach())) < 1e-6 and float(grad.abs().max()) < 1e-7


def _fedavg_then(sim, rnd):
    """Run round ``rnd``'s clients, aggregate with FedAvg only; returns (info, ordered replies, cids)."""
    info = sim.round_info(rnd)
    replies = {}
    for cid in sim.server_runtime.select_clients(rnd):
        replies[cid] = sim.client_runtime.update(cid, info, sim.server_runtime.broadcast(info, cid), {})
    algorithm = sim.algorithm
    algorithm.refine = lambda *args: {}  # the instance attribute hides the method: plain FedAvg aggregation
    algorithm.aggregate(sim.server, info, replies)
    del algorithm.refine
    cids = sorted(replies)
    return info, [replies[c] for c in cids], cids


def test_one_proxy_step_with_a_tiny_lr_does_not_increase_the_kl_and_leaves_teachers_alone(digits):
    cfg = small_config(**{**PROXY, "algorithm.proxy_size": 64, "algorithm.distill_steps": 1,
                          "algorithm.distill_batch_size": 64, "algorithm.distill_lr": 1e-5})  # fmt: skip
    sim = Simulation(cfg, digits)
    info, replies, cids = _fedavg_then(sim, 1)
    sent = [r["weights"].clone() for r in replies]
    pipeline, images = sim.algorithm._proxy
    x = pipeline.normalise(images)  # one batch = the whole 64-image proxy set
    # The AVGLOGITS target, computed here from fresh models built from the uploads.
    with torch.no_grad():
        logits = []
        for reply in replies:
            teacher = build_model("digits_cnn", (1, 8, 8), 10).eval()
            set_flat(teacher, reply["weights"])
            logits.append(teacher(x))
        target = _softmax_rows(sum(logits) / len(logits))

    def kl():
        with torch.no_grad():
            q = _softmax_rows(sim.server.model(x))
            return float((target * (target.log() - q.log())).sum() / x.shape[0])

    before = kl()
    average = get_flat(sim.server.model)
    sim.algorithm.refine(sim.server, info, replies, cids)
    after = kl()
    assert before > 1e-3 and after < before
    assert not torch.equal(get_flat(sim.server.model), average)  # the student started at the average and moved
    assert all(torch.equal(r["weights"], s) for r, s in zip(replies, sent))  # teachers unchanged


def test_zero_distillation_steps_is_fedavg_bit_for_bit(digits):
    fedavg = global_vectors(small_config(algorithm="fedavg"), digits, 2)
    proxy = global_vectors(small_config(**{**PROXY, "algorithm.distill_steps": 0}), digits, 2)
    assert all(torch.equal(a, b) for a, b in zip(fedavg, proxy))
    # Generator mode with no student step: the generator still trains, the global model is FedAvg's.
    sim = Simulation(small_config(**{**GENERATOR, "algorithm.student_steps": 0}), digits)
    initial = sim.server.state[GENERATOR_KEY].clone()
    for rnd, expected in enumerate(fedavg, start=1):
        sim.run_round(rnd)
        assert torch.equal(get_flat(sim.server.model), expected)
    assert not torch.equal(sim.server.state[GENERATOR_KEY], initial)


def test_bytes_proxy_mode_is_fedavg_generator_mode_adds_label_counts(digits):
    fedavg = Simulation(small_config(algorithm="fedavg", rounds=1), digits).run()[-1]
    proxy = Simulation(small_config(**PROXY, rounds=1), digits).run()[-1]
    generator = Simulation(small_config(**GENERATOR, rounds=1), digits).run()[-1]
    assert (proxy["bytes_down"], proxy["bytes_up"]) == (fedavg["bytes_down"], fedavg["bytes_up"])
    assert generator["bytes_down"] == fedavg["bytes_down"]
    assert generator["bytes_up"] == fedavg["bytes_up"] + 3 * 8 * 10  # M int64 per client
    assert generator["feddf_student_loss"] >= 0 and "feddf_refine_seconds" in generator


def test_proxy_mode_needs_a_usable_proxy_set(digits):
    with pytest.raises(ConfigError, match="needs proxy_dataset"):
        Simulation(small_config(**{**PROXY, "algorithm.proxy_dataset": None}), digits)
    with pytest.raises(ConfigError, match="proxy_size"):
        Simulation(small_config(**{**PROXY, "algorithm.proxy_size": 100_000}), digits)


def test_feddf_as_an_ingredient(digits):
    """``algorithm.plus: {feddf: ...}``: FedProx with μ = 0 plus FedDF with no step is FedAvg; with steps it distils."""
    no_steps = {"student_steps": 0, "generator_steps": 0}
    idle = small_config(**{"algorithm.name": "fedprox", "algorithm.mu": 0.0, "algorithm.plus": {"feddf": no_steps}})
    assert_same_rounds(small_config(algorithm="fedavg"), idle, digits, rounds=1)
    plus = {k.removeprefix("algorithm."): v for k, v in PROXY.items() if k != "algorithm.name"}
    cfg = small_config(**{"algorithm.name": "fedprox", "algorithm.plus": {"feddf": plus}}, rounds=1)
    row = Simulation(cfg, digits).run()[-1]
    assert row["feddf_student_loss"] >= 0


def test_feddf_generator_mode_learns_and_resumes_exactly(digits, tmp_path):
    settings = {k: v for k, v in GENERATOR.items() if k != "algorithm.name"}
    assert_resume_is_exact(digits, tmp_path, "feddf", server_keys=(GENERATOR_KEY,), **settings)
    assert_learns(digits, "feddf", **settings)


def test_feddf_proxy_mode_learns_and_resumes_exactly(digits, tmp_path):
    settings = {k: v for k, v in PROXY.items() if k != "algorithm.name"}
    assert_resume_is_exact(digits, tmp_path, "feddf", **settings)
    assert_learns(digits, "feddf", **settings)


def test_the_proxy_set_is_found_in_the_runs_data_directory(digits, tmp_path):
    """`--data-dir` (dataset.data_dir) is where the proxy dataset is looked up too, not only ./data."""
    from tests.test_datasets import make_mnist_dir

    make_mnist_dir(tmp_path / "mnist", n_train=40, n_test=5)
    cfg = small_config(
        **{**PROXY, "algorithm.proxy_dataset": "mnist", "algorithm.proxy_size": None, "dataset.data_dir": str(tmp_path),
           "dataset.verify": False}
    )  # fmt: skip
    # The 28x28 files were found and read from dataset.data_dir (before: "no dataset files in ./data/mnist");
    # they do not fit the 8x8 digits model, which is the next check.
    with pytest.raises(ConfigError, match="has 1x28x28 images, the model takes 1x8x8"):
        Simulation(cfg, digits)


# -- generator mode, one step at a time: each term moves the way the card's objective says -----------------
def _generator_mode_round(digits, **params):
    cfg = small_config(**{**GENERATOR, "algorithm.pseudo_batch_size": 16, **{f"algorithm.{k}": v for k, v in params.items()}})
    sim = Simulation(cfg, digits)
    info, replies, cids = _fedavg_then(sim, 1)
    return sim, info, replies, cids


def _round_draws(sim, info, replies, first_steps):
    """The (y, z) of the first pseudo batch, drawn as the card's round does: the labels of the first phase
    (``first_steps`` batches, stratified over the pooled label counts), then the noise of its first batch."""
    from fedistill.engine.seeding import FEDDF, make_generator
    from fedistill.losses import stratified_labels

    p = sim.algorithm.params
    rng = make_generator(sim.server.seed, FEDDF, info.round)
    pooled = torch.stack([r["label_counts"].to(torch.int64) for r in replies]).sum(dim=0)
    y = stratified_labels(first_steps * p.pseudo_batch_size, pooled, rng)[: p.pseudo_batch_size]
    z = torch.randn(p.pseudo_batch_size, p.noise_dim, generator=rng)
    return y, z


def _teachers(replies):
    models = []
    for reply in replies:
        teacher = build_model("digits_cnn", (1, 8, 8), 10).eval()
        set_flat(teacher, reply["weights"])
        models.append(teacher)
    return models


@pytest.mark.parametrize("term", ["teachers_ce", "diversity"])
def test_one_generator_step_lowers_the_term_it_weights(digits, term):
    """J = η·L_div + α·mean_k CE(f_k(G(z, y)), y) is minimised (card §3): one small Adam step with only one term
    switched on lowers that term on the same (z, y) (a flipped sign raises it)."""
    from fedistill.losses import diversity_loss

    weights = {"alpha": 1.0, "eta": 0.0} if term == "teachers_ce" else {"alpha": 0.0, "eta": 1.0}
    sim, info, replies, cids = _generator_mode_round(digits, generator_steps=1, student_steps=0, generator_lr=1e-3, **weights)
    y, z = _round_draws(sim, info, replies, first_steps=1)
    teachers = _teachers(replies)

    def value():
        generator = sim.algorithm._generator.load(sim.server).train()
        with torch.no_grad():
            x = generator(z, y)
            if term == "diversity":
                return float(diversity_loss(x, z))
            return sum(float(torch.nn.functional.cross_entropy(t(x), y)) for t in teachers) / len(teachers)

    before = value()
    sim.algorithm.refine(sim.server, info, replies, cids)
    after = value()
    assert after < before, (term, before, after)


def test_one_student_step_follows_the_gradient_of_kl_teacher_to_student(digits):
    """The student's SGD step on G's images is −lr·∇ of (1/B) Σ_b KL(p_T,b ‖ σ(s_b)) written out here (the
    reverse KL, or an ascent, moves the weights elsewhere)."""
    lr = 0.05
    sim, info, replies, cids = _generator_mode_round(digits, generator_steps=0, student_steps=1, student_lr=lr, student_weight_decay=0.0)
    y, z = _round_draws(sim, info, replies, first_steps=1)
    generator = sim.algorithm._generator.load(sim.server).eval()
    with torch.no_grad():
        x = generator(z, y)
        # Generator mode's target (card §3, FedFTG's data-free FedDF): the mean of the teachers' softmaxes, T = 1.
        target = sum(_softmax_rows(t(x)) for t in _teachers(replies)) / len(replies)
    student = build_model("digits_cnn", (1, 8, 8), 10).train()
    start = get_flat(sim.server.model)
    set_flat(student, start)
    log_q = torch.log_softmax(student(x), dim=1)
    kl = (target * (target.log() - log_q)).sum() / x.shape[0]
    grads = torch.autograd.grad(kl, list(student.parameters()))
    expected = torch.cat([(p.detach() - lr * g).reshape(-1) for p, g in zip(student.parameters(), grads)])
    sim.algorithm.refine(sim.server, info, replies, cids)
    moved = get_flat(sim.server.model)
    assert torch.allclose(moved, expected, atol=1e-6)
    assert not torch.allclose(moved, start, atol=1e-5)


# -- proxy mode: the cosine schedule and the BatchNorm modes of teachers and student ------------------------
def _uploads(model, name, kwargs, count=3, seed=0):
    """``count`` hand-made uploads around ``model``: parameters plus noise and, where the model has BatchNorm,
    running statistics of their own (so that eval-mode outputs differ from batch-statistics outputs)."""
    base = get_flat(model)
    noise = torch.Generator().manual_seed(seed)
    replies = []
    for k in range(count):
        copy = build_model(name, (1, 8, 8), 10, **kwargs)
        set_flat(copy, base + 0.05 * torch.randn(base.shape, generator=noise))
        with torch.no_grad():
            for buffer_name, buf in copy.named_buffers():
                if buffer_name.endswith("running_mean"):
                    buf.copy_(torch.rand(buf.shape, generator=noise) * 2 - 1)
                elif buffer_name.endswith("running_var"):
                    buf.copy_(0.5 + (1.5 + k) * torch.rand(buf.shape, generator=noise))
        replies.append(Message({"weights": get_flat(copy), "num_samples": 20 + 10 * k}))
    return replies


def test_proxy_distillation_lr_is_cosine_annealed_over_the_distillation_steps(digits, monkeypatch):
    """Card §4-5 proxy mode: Adam(lr η₀) with CosineAnnealing(T_max = N_d), one scheduler step per student
    step, so step j = 0..N_d−1 runs at η_j = η₀ · (1 + cos(π j / N_d)) / 2 (written out here). Catches a
    removed schedule or a scheduler that is never stepped (every step at η₀)."""
    lrs: list[float] = []

    class RecordingAdam(torch.optim.Adam):
        def step(self, closure=None):
            lrs.append(self.param_groups[0]["lr"])
            return super().step(closure)

    steps, lr0 = 5, 2e-3
    cfg = small_config(**{**PROXY, "algorithm.proxy_size": 64, "algorithm.distill_steps": steps,
                          "algorithm.distill_batch_size": 16, "algorithm.distill_lr": lr0})  # fmt: skip
    sim = Simulation(cfg, digits)
    replies = _uploads(sim.server.model, "digits_cnn", {})
    monkeypatch.setattr(torch.optim, "Adam", RecordingAdam)
    sim.algorithm.aggregate(sim.server, sim.round_info(1), dict(enumerate(replies)))
    expected = [lr0 * (1 + math.cos(math.pi * j / steps)) / 2 for j in range(steps)]
    assert len(lrs) == steps
    assert lrs == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert lrs[-1] < 0.1 * lr0  # annealed towards 0, not constant


def test_proxy_teachers_are_evaluated_in_eval_mode_and_the_student_bn_mode_follows_the_flag(digits, monkeypatch):
    """On a BatchNorm model (resnet8, width 8), card §4 and ambiguity 5:

    * teachers in eval mode: the target of every proxy sample equals σ(mean_k f_k(x)) with each teacher run on
      that sample alone in eval mode (its running statistics), so it does not depend on the batch it came in
      (teachers in train mode would normalise with the batch's statistics);
    * the student distils in train mode by default: its first-step logits are the train-mode forward of the
      aggregate and its BN running statistics move; with ``freeze_student_bn_stats`` it runs in eval mode and its
      running statistics stay exactly the aggregate's while its parameters still train;
    * the server model's train/eval flag is restored afterwards.
    """
    import fedistill.algorithms.feddf as feddf_module
    from fedistill.engine.seeding import FEDDF, make_generator

    # Width 8, not 4: on one CPU thread, torch 2.13 corrupts the heap in the backward of a channels-last 1x1
    # stride-2 convolution with fewer than 8 input channels (resnet8's shortcut at width 4).
    kwargs = {"width": 8}
    for freeze in (False, True):
        cfg = small_config(**{**PROXY, "model.name": "resnet8", "model.kwargs": kwargs, "algorithm.proxy_size": 32,
                              "algorithm.distill_steps": 1, "algorithm.distill_batch_size": 32,
                              "algorithm.distill_lr": 1e-2, "algorithm.freeze_student_bn_stats": freeze})  # fmt: skip
        sim = Simulation(cfg, digits)
        algorithm, model = sim.algorithm, sim.server.model
        replies = _uploads(model, "resnet8", kwargs, seed=int(freeze))
        captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        real = feddf_module.ensemble_distillation

        def spy(logits, target, tau=1.0):
            captured.append((logits.detach().clone(), target.clone()))
            return real(logits, target, tau)

        monkeypatch.setattr(feddf_module, "ensemble_distillation", spy)
        snapshot = {}
        refine = algorithm.refine

        def watched(server, info, ordered, cids):
            snapshot["start"] = get_flat(model).clone()
            snapshot["training"] = model.training
            return refine(server, info, ordered, cids)

        algorithm.refine = watched
        algorithm.aggregate(sim.server, sim.round_info(1), dict(enumerate(replies)))
        del algorithm.refine
        assert len(captured) == 1 and model.training == snapshot["training"]

        # The proxy batch (all 32 images), in the order the round draws it.
        pipeline, images = algorithm._proxy
        rows = torch.randperm(images.shape[0], generator=make_generator(sim.server.seed, FEDDF, 1))[:32]
        x = pipeline.normalise(images[rows])
        with torch.no_grad():
            teacher_logits, alone = [], []
            for reply in replies:
                teacher = build_model("resnet8", (1, 8, 8), 10, **kwargs).eval()
                set_flat(teacher, reply["weights"])
                teacher_logits.append(teacher(x))
                alone.append(teacher(x[:1]))  # the first sample on its own: eval mode does not see the batch
            target = _softmax_rows(sum(teacher_logits) / len(teacher_logits))
            target_alone = _softmax_rows(sum(alone) / len(alone))
        torch.testing.assert_close(captured[0][1], target, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(captured[0][1][:1], target_alone, rtol=1e-4, atol=1e-5)

        student = build_model("resnet8", (1, 8, 8), 10, **kwargs).train(not freeze)
        set_flat(student, snapshot["start"])
        with torch.no_grad():
            expected_logits = student(x)
        torch.testing.assert_close(captured[0][0], expected_logits, rtol=1e-4, atol=1e-5)

        start, end = build_model("resnet8", (1, 8, 8), 10, **kwargs), model
        set_flat(start, snapshot["start"])
        stats = [(name, buf) for name, buf in start.named_buffers() if name.endswith(("running_mean", "running_var"))]
        after = dict(end.named_buffers())
        moved = [not torch.equal(buf, after[name]) for name, buf in stats]
        assert not any(moved) if freeze else all(moved), (freeze, moved)
        assert not torch.equal(start.classifier.weight, end.classifier.weight)  # the student trained either way
        monkeypatch.undo()
