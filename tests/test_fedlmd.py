"""FedLMD / FedLMD-Tf invariants (spec/fedlmd.md §7) and the Table 1-2 ablations (FedAvg+KD, FedAvg+LS)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_learns, assert_same_rounds, global_vectors

from fedistill.algorithms.aggregate import ServerMomentum
from fedistill.algorithms.fedlmd import FedLMD
from fedistill.simulation import Simulation
from fedistill.losses import (
    knowledge_distillation,
    label_masking_distillation,
    label_smoothing_term,
    majority_labels,
    masked_teacher_log_distribution,
    not_true_distillation,
    proximal_term,
)
from fedistill.registry import ALGORITHMS

C = 10


def mask(*classes, c=C):
    m = torch.zeros(c, dtype=torch.bool)
    m[list(classes)] = True
    return m


def lmd_by_hand(zs, zt, y, majority, tau):
    """ℓ_LMD written from the card's definition, one sample at a time with index lists (no masked_fill)."""
    total = 0.0
    for b in range(zs.shape[0]):
        a = [i for i in range(zs.shape[1]) if i != int(y[b]) and not bool(majority[i])]
        s = [i for i in range(zs.shape[1]) if i != int(y[b])]
        if not a:
            continue
        log_ps = torch.log_softmax(zs[b, s] / tau, 0)
        log_ps = dict(zip(s, log_ps.tolist()))
        if zt is None:
            pt = {i: 1.0 / len(a) for i in a}
        else:
            pt = dict(zip(a, torch.softmax(zt[b, a] / tau, 0).tolist()))
        total += sum(pt[i] * (torch.log(torch.tensor(pt[i])).item() - log_ps[i]) for i in a)
    return tau**2 * total / zs.shape[0]


# -- the loss -------------------------------------------------------------------------------------
@pytest.mark.parametrize("teacher", [True, False])
def test_lmd_matches_the_cards_definition(teacher):
    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(16, C, generator=g) * 3, torch.randn(16, C, generator=g) * 3
    y = torch.randint(0, C, (16,), generator=g)
    majority = mask(1, 4, 7)
    got = label_masking_distillation(zs, zt if teacher else None, y, majority, 2.0)
    assert abs(float(got) - lmd_by_hand(zs, zt if teacher else None, y, majority, 2.0)) < 1e-5


@pytest.mark.parametrize("teacher", [True, False])
def test_empty_majority_set_is_fedntd(teacher):
    g = torch.Generator().manual_seed(1)
    zs, zt = torch.randn(32, C, generator=g) * 2, torch.randn(32, C, generator=g) * 2
    y = torch.randint(0, C, (32,), generator=g)
    zt = zt if teacher else None
    lmd = label_masking_distillation(zs, zt, y, mask(), 1.5)
    assert torch.allclose(lmd, not_true_distillation(zs, zt, y, 1.5), atol=1e-6)


def test_zero_loss_cases_and_nonnegativity():
    g = torch.Generator().manual_seed(2)
    zs = torch.randn(8, C, generator=g)
    y = torch.full((8,), 3)
    # M ⊆ {y} and equal logits off the target: zero.
    zt = zs.clone()
    zt[:, 3] += 5.0
    assert float(label_masking_distillation(zs, zt, y, mask(3), 1.0)) < 1e-6
    assert float(label_masking_distillation(zs, zt, y, mask(), 1.0)) < 1e-6
    # Student equal to the teacher on A(y) and -1e4 on the other majority labels: zero.
    majority = mask(3, 5, 6)
    student = zt.clone()
    student[:, [5, 6]] = -1e4
    assert float(label_masking_distillation(student, zt, y, majority, 1.0)) < 1e-6
    for seed in range(5):
        g.manual_seed(seed)
        zs, zt = torch.randn(16, C, generator=g) * 4, torch.randn(16, C, generator=g) * 4
        y = torch.randint(0, C, (16,), generator=g)
        assert float(label_masking_distillation(zs, zt, y, mask(0, 2), 0.7)) >= 0.0
        assert float(label_masking_distillation(zs, None, y, mask(0, 2), 0.7)) >= 0.0


def test_invariances_and_gradients():
    g = torch.Generator().manual_seed(3)
    zs = (torch.randn(12, C, generator=g) * 2).requires_grad_(True)
    zt = (torch.randn(12, C, generator=g) * 2).requires_grad_(True)
    y = torch.randint(0, C, (12,), generator=g)
    majority = mask(0, 9)
    base = label_masking_distillation(zs, zt, y, majority, 2.0)
    changed = zt.detach().clone()
    changed[:, [0, 9]] += torch.randn(12, 2, generator=g) * 10  # teacher logits on M_k
    changed[torch.arange(12), y] -= 7.0  # and on the target
    assert torch.allclose(label_masking_distillation(zs, changed, y, majority, 2.0), base, atol=1e-6)
    assert torch.allclose(label_masking_distillation(zs + 3.0, zt, y, majority, 2.0), base, atol=1e-5)
    assert torch.allclose(label_masking_distillation(zs, zt - 4.0, y, majority, 2.0), base, atol=1e-5)
    # ∂ℓ/∂z_{s,y} = 0 exactly; the loss reaches the teacher only if its logits require grad.
    grad_s, grad_t = torch.autograd.grad(base, [zs, zt])
    assert torch.all(grad_s[torch.arange(12), y] == 0)
    assert torch.all(grad_t[:, [0, 9]] == 0)  # masked teacher logits get nothing either
    assert torch.isfinite(grad_s).all()


def test_teacher_free_target_sums_to_one_and_is_zero_on_masked_labels():
    y = torch.tensor([0, 3, 5, 9])
    majority = mask(0, 3)
    target = F.one_hot(y, C).bool()
    keep = ~(target | majority[None])
    mu = torch.where(keep, masked_teacher_log_distribution(None, keep, 1.0).exp(), torch.zeros(4, C))
    assert torch.allclose(mu.sum(1), torch.ones(4))
    assert torch.all(mu[~keep] == 0)
    assert torch.allclose(mu[0, keep[0]], torch.full((8,), 1 / 8))  # y ∈ M_k: 1/(C − C_k), Eq. 8
    assert torch.allclose(mu[2, keep[2]], torch.full((7,), 1 / 7))  # y ∉ M_k: the target is removed as well


def test_teacher_free_loss_vanishes_for_a_uniform_student_on_the_minority_labels():
    y = torch.tensor([2, 2])
    zs = torch.zeros(2, C)
    assert float(label_masking_distillation(zs, None, y, mask(2), 1.0)) < 1e-7  # M ⊆ {y}, equal logits
    zs[:, [4, 5]] = -1e4  # no mass on the other majority labels
    assert float(label_masking_distillation(zs, None, y, mask(2, 4, 5), 1.0)) < 1e-6
    zs[:, [4, 5]] = 3.0  # mass on them is penalised
    assert float(label_masking_distillation(zs, None, y, mask(2, 4, 5), 1.0)) > 0.1


def test_majority_label_examples():
    def counts(*head):
        return torch.tensor(list(head) + [0] * (C - len(head)))

    assert majority_labels(counts(250, 250)).nonzero().flatten().tolist() == [0, 1]
    assert majority_labels(counts(100, 1)).nonzero().flatten().tolist() == [0]
    assert not majority_labels(torch.full((C,), 7)).any()
    almost = majority_labels(torch.tensor([10] * 9 + [1]))
    assert almost.nonzero().flatten().tolist() == list(range(9))
    # A class-9 sample then has an empty teacher support: loss 0, no NaN, finite gradients.
    zs = torch.randn(3, C, requires_grad=True)
    loss = label_masking_distillation(zs, torch.randn(3, C), torch.tensor([9, 9, 9]), almost, 1.0)
    assert float(loss.detach()) == 0.0
    (grad,) = torch.autograd.grad(loss, zs)
    assert torch.isfinite(grad).all()
    # The paper's rule: ≥ mean over the classes present.
    assert majority_labels(counts(100, 1), "paper").nonzero().flatten().tolist() == [0]
    assert majority_labels(counts(5, 5, 2), "paper").nonzero().flatten().tolist() == [0, 1]
    assert majority_labels(counts(5, 5, 0, 2), "code").nonzero().flatten().tolist() == [0, 1, 3]


def test_single_class_client_is_fedntd_and_two_classes_give_zero():
    zs, zt = torch.randn(6, C), torch.randn(6, C)
    y = torch.full((6,), 4)
    single = majority_labels(torch.tensor([0, 0, 0, 0, 50, 0, 0, 0, 0, 0]))
    assert single.nonzero().flatten().tolist() == [4]
    assert torch.allclose(label_masking_distillation(zs, zt, y, single, 1.0), not_true_distillation(zs, zt, y, 1.0), atol=1e-6)
    z2 = torch.randn(5, 2)
    for m in (mask(c=2), mask(0, c=2), mask(0, 1, c=2)):
        assert float(label_masking_distillation(z2, torch.randn(5, 2), torch.randint(0, 2, (5,)), m, 1.0)) == 0.0


def test_half_precision_logits_give_finite_gradients():
    zs = (torch.randn(4, C) * 5).half().requires_grad_(True)
    loss = label_masking_distillation(zs, torch.randn(4, C).half(), torch.tensor([0, 1, 2, 3]), mask(0, 5), 1.0)
    (grad,) = torch.autograd.grad(loss, zs)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_kd_and_label_smoothing_terms():
    zs, zt = torch.randn(8, C), torch.randn(8, C)
    y = torch.randint(0, C, (8,))
    assert float(knowledge_distillation(zs, zs, 2.0)) < 1e-6
    expected = 4.0 * F.kl_div(F.log_softmax(zs / 2, 1), F.softmax(zt / 2, 1), reduction="batchmean")
    assert torch.allclose(knowledge_distillation(zs, zt, 2.0), expected, atol=1e-6)
    smoothed = F.cross_entropy(zs, y) + label_smoothing_term(zs, y, 0.1)
    assert torch.allclose(smoothed, F.cross_entropy(zs, y, label_smoothing=0.1), atol=1e-6)


# -- the method -----------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["fedlmd", "fedlmd_tf", "fedavg_kd"])
def test_beta_zero_is_fedavg_step_for_step(make_config, digits, algorithm):
    assert_same_rounds(make_config(algorithm="fedavg"), make_config(**{"algorithm.name": algorithm, "algorithm.beta": 0.0}), digits)


def test_switch_round_zero_is_fedlmd_and_past_the_end_is_tf(make_config, digits, monkeypatch):
    """Card §7: R = 0 is FedLMD (the teacher from round 1 on), R ≥ T is FedLMD-Tf. R = 0 is also the default,
    so comparing it with the default alone proves nothing: which rounds load the teacher is counted."""
    from fedistill.algorithms.teacher import GlobalTeacher

    loads = []
    load = GlobalTeacher.load
    monkeypatch.setattr(GlobalTeacher, "load", lambda self, client, w: loads.append(client.round) or load(self, client, w))
    for switch, teacher_rounds in ((0, {1, 2}), (1, {2}), (2, set())):
        loads.clear()
        Simulation(make_config(rounds=2, **{"algorithm.name": "fedlmd", "algorithm.switch_round": switch}), digits).run()
        assert set(loads) == teacher_rounds, switch
    zero = make_config(**{"algorithm.name": "fedlmd", "algorithm.switch_round": 0})
    assert not torch.equal(global_vectors(zero, digits, 1)[0], global_vectors(make_config(algorithm="fedlmd_tf"), digits, 1)[0])
    assert_same_rounds(make_config(algorithm="fedlmd_tf"), make_config(**{"algorithm.name": "fedlmd", "algorithm.switch_round": 2}), digits)


def test_switch_runs_tf_up_to_round_r_then_the_teacher(make_config, digits):
    switched = global_vectors(make_config(**{"algorithm.name": "fedlmd", "algorithm.switch_round": 1}), digits, 2)
    tf = global_vectors(make_config(algorithm="fedlmd_tf"), digits, 2)
    lmd = global_vectors(make_config(algorithm="fedlmd"), digits, 1)
    assert torch.equal(switched[0], tf[0]) and not torch.equal(switched[0], lmd[0])
    assert not torch.equal(switched[1], tf[1])


def test_prox_with_mu_zero_and_avgm_with_zero_momentum_are_fedlmd(make_config, digits):
    plus = {"fedprox": {"mu": 0.0}, "fedavgm": {"server_momentum": 0.0}}
    assert_same_rounds(make_config(algorithm="fedlmd"), make_config(**{"algorithm.name": "fedlmd", "algorithm.plus": plus}), digits)


class LMDWithProxAndMomentum(FedLMD):
    """FedLMD+Prox+AvgM (Table 5) written by hand: the LMD term plus (μ/2)||w − w_g||², FedAvgM's server."""

    def extra_loss(self, client, msg):
        lmd = super().extra_loss(client, msg)
        params = [p for p in client.model.parameters() if p.requires_grad]
        anchors = [p.detach().clone() for p in params]
        return lambda model, x, y, logits, f: lmd(model, x, y, logits, f) + proximal_term(params, anchors, 0.5)

    def server_optimizer(self, server):
        return ServerMomentum(0.7, 1.0)


def test_prox_and_avgm_on_fedlmd_equal_the_hand_written_combination(make_config, digits, monkeypatch):
    """With effective μ and β_m (the zero-valued check above would pass if ``plus`` were ignored)."""
    monkeypatch.setitem(ALGORITHMS._entries, "lmd_prox_momentum_by_hand", LMDWithProxAndMomentum)
    plus = {"fedprox": {"mu": 0.5}, "fedavgm": {"server_momentum": 0.7}}
    composed = make_config(**{"algorithm.name": "fedlmd", "algorithm.plus": plus})
    assert_same_rounds(make_config(**{"algorithm.name": "lmd_prox_momentum_by_hand"}), composed, digits, rounds=3)
    assert not torch.equal(global_vectors(composed, digits, 3)[-1], global_vectors(make_config(algorithm="fedlmd"), digits, 3)[-1])


def test_bytes_per_round_equal_fedavgs(make_config, digits):
    rows = {a: Simulation(make_config(algorithm=a, rounds=1), digits).run()[0] for a in ("fedavg", "fedlmd", "fedlmd_tf")}
    for a in ("fedlmd", "fedlmd_tf"):
        assert (rows[a]["bytes_down"], rows[a]["bytes_up"]) == (rows["fedavg"]["bytes_down"], rows["fedavg"]["bytes_up"])


def test_majority_set_is_the_clients_own_and_computed_once(make_config, digits, monkeypatch):
    import fedistill.algorithms.fedlmd as fedlmd_module

    computed = []
    rule = fedlmd_module.majority_labels
    monkeypatch.setattr(fedlmd_module, "majority_labels", lambda counts, r: computed.append(1) or rule(counts, r))
    sim = Simulation(make_config(algorithm="fedlmd", rounds=4), digits)
    sim.run()
    algorithm = sim.client_runtime.algorithm
    counts = sim.federation.class_counts()
    assert algorithm._majority  # filled for the clients that trained
    assert len(computed) == len(algorithm._majority)  # once per client, however often it trained (card §3)
    for cid, m in algorithm._majority.items():
        # card §3, by hand (not through majority_labels, the function under test): n_kc > n_k / C over all C classes
        n_kc = [int(c) for c in counts[cid]]
        assert m.tolist() == [c > sum(n_kc) / len(n_kc) for c in n_kc], cid


@pytest.mark.parametrize("algorithm", ["fedlmd", "fedlmd_tf"])
def test_fedlmd_learns_on_strongly_label_skewed_digits(digits, algorithm, make_config):
    """LDA α=0.1 over 10 clients (most hold 1-3 classes): accuracy swings by ±5 points between rounds, so
    the check is on the last five rounds: every one far above chance (10%), the best above 75%."""
    cfg = make_config(
        rounds=20, clients_per_round=5,
        **{"algorithm.name": algorithm, "partition.num_clients": 10, "partition.alpha": 0.1, "local.epochs": 2},
    )  # fmt: skip
    last = [r["test_accuracy"] for r in Simulation(cfg, digits).run()[-5:]]
    assert min(last) > 60.0 and max(last) > 75.0, last


@pytest.mark.parametrize("algorithm", ["fedavg_kd", "fedavg_ls"])
def test_ablations_learn(digits, algorithm):
    assert_learns(digits, algorithm)


def test_one_frozen_teacher_per_process_reloaded_each_round(make_config, digits):
    from fedistill.models.flat import get_flat

    sim = Simulation(make_config(algorithm="fedlmd", rounds=2), digits)
    algorithm = sim.client_runtime.algorithm
    sim.run_round(1)
    teacher = algorithm._teacher._model
    assert teacher is not None and teacher is not sim.client_runtime.worker
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    before = get_flat(sim.server.model)
    sim.run_round(2)
    assert algorithm._teacher._model is teacher  # the same module, not a copy per client or batch
    assert torch.equal(get_flat(teacher), before)  # holding round 2's broadcast (the last client's)
    x = (digits.test_x[:4].float() / 255 - 0.3) / 0.4
    out = algorithm._teacher.logits(teacher, x)
    assert not out.requires_grad and not out.is_inference()  # usable inside the student's autograd graph
