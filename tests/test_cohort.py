"""Cohort training (engine/cohort.py, issue 66 items 1-2): K clients stacked into one batched step equal K
sequential steps of the engine's own step (``eager_sgd_step`` with the fused SGD ``local_sgd`` builds), within the
tolerance of a reordered float sum. The clients differ in size (different numbers of steps, partial last batches);
an inactive client's weights and momentum must not move, a padded row must not count in the mean, and a
wrong sign, a missing weight decay or momentum term, or a wrong normaliser fails these tests."""

from __future__ import annotations

import pytest
import torch

from fedistill.algorithms.local import fused
from fedistill.engine.cohort import cohort_sgd, flat_layout, proximal_term
from fedistill.engine.cuda_graphs import eager_sgd_step
from fedistill.models import build_model
from fedistill.models.flat import get_flat, set_flat

SIZES = [45, 16, 29]  # three clients: 3, 1 and 2 batches of 16, two of them ending in a partial batch


def client_batches(seed: int, batch_size: int = 16, epochs: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in SIZES:
        x, y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)
        batches = []
        for _ in range(epochs):
            order = torch.randperm(n, generator=g)
            batches += [(x[order[s : s + batch_size]], y[order[s : s + batch_size]]) for s in range(0, n, batch_size)]
        out.append(batches)
    return out


def sequential(model, weights, batches, lr, momentum=0.0, weight_decay=0.0, extra_loss=None):
    """Each client alone, as local_sgd trains it: a fresh fused SGD, the engine's eager step per batch."""
    rows, losses = [], []
    for w, client in zip(weights, batches):
        set_flat(model, w)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, **fused(torch.device("cpu")))
        total = 0.0
        for x, y in client:
            total += float(eager_sgd_step(model, optimizer, x, y, "fp32", None, extra_loss=extra_loss).detach()) * y.shape[0]
        rows.append(get_flat(model))
        losses.append(total)
    return torch.stack(rows), torch.tensor(losses, dtype=torch.float64)


def digits_cnn():
    """The tests' model, its initial weights seeded here: drawn from the global generator, they would depend on
    which tests ran before in the same process, and at a ReLU's kink a reordered sum can flip a unit."""
    torch.manual_seed(0)
    return build_model("digits_cnn", (1, 8, 8), 10)


def starts(model, k=3):
    g = torch.Generator().manual_seed(7)
    base = get_flat(model)
    return torch.stack([base + 0.01 * torch.randn(base.shape, generator=g) for _ in range(k)])


def test_one_step_of_three_clients_equals_three_sequential_steps():
    """One batch each (sizes 16, 16 and 13: a padded client): the same weights as three eager steps, up to a
    reordered float sum (largest relative difference printed by the assertion on failure)."""
    model = digits_cnn()
    weights = starts(model)
    batches = [[client[0]] for client in client_batches(0)]
    batches[2] = [(batches[2][0][0][:13], batches[2][0][1][:13])]
    result = cohort_sgd(model, weights, batches, lr=0.1, momentum=0.9, weight_decay=1e-3)
    expected, losses = sequential(model, weights, batches, lr=0.1, momentum=0.9, weight_decay=1e-3)
    difference = float(((result.weights - expected).abs() / expected.abs().clamp_min(1e-3)).max())
    assert difference < 1e-5, difference
    torch.testing.assert_close(result.loss_sum, losses, rtol=1e-6, atol=0)
    assert result.steps.tolist() == [1, 1, 1] and result.samples_seen.tolist() == [16, 16, 13] and result.padded_slots == 0


def test_clients_of_different_sizes_over_two_epochs_with_momentum_stay_with_the_sequential_path():
    """Two epochs of 3, 1 and 2 batches (partial last batches) with momentum 0.9 and weight decay: every client
    within 1e-4 relative of its sequential run; the short clients' rows, momentum and loss sums frozen while the
    longest trains on (6 slots, 6 + 2 + 4 steps, 6 padded)."""
    model = digits_cnn()
    weights = starts(model)
    batches = client_batches(1, epochs=2)
    result = cohort_sgd(model, weights, batches, lr=0.05, momentum=0.9, weight_decay=1e-4)
    expected, losses = sequential(model, weights, batches, lr=0.05, momentum=0.9, weight_decay=1e-4)
    for k in range(3):
        torch.testing.assert_close(result.weights[k], expected[k], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(result.loss_sum, losses, rtol=1e-5, atol=0)
    assert result.steps.tolist() == [6, 2, 4] and result.padded_slots == 6
    assert result.samples_seen.tolist() == [2 * n for n in SIZES]
    assert not torch.allclose(result.weights[1], weights[1])


def test_the_proximal_term_batches_with_the_clients_global_weights():
    """FedProx's (μ/2)‖w − w_g‖² as a cohort term equals the sequential step with the same term (μ = 0.5, each
    client's own w_g row)."""
    model = digits_cnn()
    weights = starts(model)
    anchors = starts(model) * 0.5
    batches = client_batches(2)
    result = cohort_sgd(model, weights, batches, lr=0.05, momentum=0.5, extra_loss=proximal_term(0.5), fixed={"global": anchors})
    rows = []
    for k in range(3):
        anchor = anchors[k]

        def prox(model, x, y, logits, features, anchor=anchor):
            flat = torch.cat([p.reshape(-1) for p in model.parameters()])
            return 0.25 * (flat - anchor).pow(2).sum()

        rows.append(sequential(model, weights[k : k + 1], batches[k : k + 1], lr=0.05, momentum=0.5, extra_loss=prox)[0][0])
    for k in range(3):
        torch.testing.assert_close(result.weights[k], rows[k], rtol=1e-4, atol=1e-6)
    plain = cohort_sgd(model, weights, batches, lr=0.05, momentum=0.5)
    assert not torch.allclose(plain.weights, result.weights, rtol=1e-4, atol=1e-6)


def test_a_model_with_batchnorm_statistics_is_refused():
    with pytest.raises(ValueError, match="BatchNorm"):
        flat_layout(build_model("resnet8", (1, 8, 8), 10))


# -------------------------------------------------------------------- run.cohort: the executor (issue 66, item 1)
def cohort_run(algorithm: str, cohort, digits, **overrides):
    """A 3-round run of ``algorithm`` with ``run.cohort`` = ``cohort``; ``sim.cohort_steps`` counts the batched
    steps it took (0: its clients trained sequentially)."""
    from conftest import small_config

    import fedistill.engine.cohort as cohort_module
    from fedistill.simulation import Simulation

    cfg = small_config(**{"algorithm.name": algorithm, "run.workers": 1, "run.cohort": cohort, "local.momentum": 0.9,
                          "local.batch_size": 20, "local.lr": 0.02, "rounds": 3, **overrides})  # fmt: skip
    sim = Simulation(cfg, digits)
    calls, original = [], cohort_module.cohort_sgd

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    cohort_module.cohort_sgd = counted
    try:
        history = sim.run()
    finally:
        cohort_module.cohort_sgd = original
    sim.cohort_steps = len(calls)
    return sim, history


# Methods whose three-round trajectory meets a knife edge where the reordered sums of a batched step grow by orders
# of magnitude, more on some CPUs than others (relative distance after rounds 1 / 2 / 3). The AVX-512 host: FedNova
# 4e-8 after round 2, 4e-5 after round 3. The AVX2-only host (no AVX-512: other kernels, other orders of summation):
# FedLMD-Tf 2.4e-5 / 2.0e-4 / 9.8e-4; FedNova 2.4e-8 / 1.8e-6 / 1.9e-4 (1.3e-4 with the reference code's shift).
# Their third round is held to 2e-3 and their first round to everyone's 1e-4. FedLMD-Tf's first round is this
# trajectory's edge, not its batched term: with seed 1, 2 or 3, lr 0.015 or 0.025, or τ = 3 the same round is 2e-8
# apart on that host, as every other method is (benchmarks/RESULTS.md, "The suite's time at this stop", 2026-12-08).
# A seed off the edge is no way out: at seed 1 FedLMD-Tf and FedNova stay within 6e-8 over three rounds there, but
# FedAvg+KD (9e-5), MOON (5e-5) and FedRS (1e-5) meet edges of their own. The edges move with the trajectory; the
# bounds here are kept per method, with every method's first round at 1e-4, where a wrong batched term shows.
KNIFE_EDGE = {"fedlmd_tf": 2e-3, "fednova": 2e-3}


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "fedntd", "fedlmd", "fedlmd_tf", "fedavg_kd", "fedavg_ls", "scaffold", "fedrs", "feddyn", "moon", "fednova", "fedavgm", "fedadam", "fedcurv"])
def test_a_cohort_run_keeps_the_sequential_runs_weights_and_accuracy(digits, algorithm):
    """Three rounds of three clients of different sizes (partial last batches), momentum 0.9: the global model
    within 1e-4 of the sequential run's in relative norm (measured: 5e-8 to 1e-7 for most, 1.1e-6 for FedAvgM, whose
    server momentum carries the rounding further, 4e-5 for FedNova, whose round 3 meets a knife edge: 4e-8 after
    round 2) and 1e-4 in every entry, the accuracy within 0.1 point, the
    training loss within 1e-6 relative, the bytes the same. (At lr 0.05 FedAvg+LS's trajectory meets a knife edge
    in round 1, client 5's last step: a difference of 6e-8 from the reordered sums becomes 1.8e-5 in one step and
    grows about 30x a round, as any reordering of the sequential sums would make it; at 0.02 every method stays
    within 1e-7.)"""
    sequential_sim, expected = cohort_run(algorithm, None, digits)
    cohort_sim, history = cohort_run(algorithm, 3, digits)
    assert cohort_sim.cohort_steps > 0 and sequential_sim.cohort_steps == 0  # the clients did train as a cohort
    a, b = get_flat(sequential_sim.server.model), get_flat(cohort_sim.server.model)
    tolerance = KNIFE_EDGE.get(algorithm, 1e-4)
    assert float((a - b).norm() / a.norm()) < tolerance and float((a - b).abs().max()) < tolerance
    if algorithm in KNIFE_EDGE:  # before the knife edge amplifies the reordered sums: as close as every other method
        one_sequential, _ = cohort_run(algorithm, None, digits, rounds=1)
        one_cohort, _ = cohort_run(algorithm, 3, digits, rounds=1)
        a, b = get_flat(one_sequential.server.model), get_flat(one_cohort.server.model)
        assert float((a - b).norm() / a.norm()) < 1e-4 and float((a - b).abs().max()) < 1e-4
    for mine, theirs in zip(history, expected):
        # the knife-edge methods on the AVX2-only host: one test image of 297 flips (0.34 points) in FedLMD-Tf's
        # round 3, and the losses move up to 7e-5 (FedNova 3e-6)
        assert abs(mine["test_accuracy"] - theirs["test_accuracy"]) <= (0.5 if algorithm in KNIFE_EDGE else 0.1)
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-4 if algorithm in KNIFE_EDGE else 1e-6)
        assert (mine["bytes_up"], mine["bytes_down"]) == (theirs["bytes_up"], theirs["bytes_down"])


@pytest.mark.parametrize("base, plus", [("fedlmd", {"fedprox": {"mu": 0.01}}), ("fedntd", {"scaffold": {}, "fedrs": {}})])
def test_a_combination_batches_its_parts_terms_together(digits, base, plus):
    """algorithm.plus: FedLMD + FedProx (two loss terms, one with a teacher) and FedNTD + SCAFFOLD + FedRS (a term, a
    gradient offset and logit scales) batch as one cohort term and stay with their sequential runs."""
    sequential_sim, expected = cohort_run(base, None, digits, **{"algorithm.plus": plus})
    cohort_sim, history = cohort_run(base, 3, digits, **{"algorithm.plus": plus})
    a, b = get_flat(sequential_sim.server.model), get_flat(cohort_sim.server.model)
    assert cohort_sim.cohort_steps > 0 and float((a - b).norm() / a.norm()) < 1e-4
    assert [r["test_accuracy"] for r in history] == pytest.approx([r["test_accuracy"] for r in expected], abs=0.1)
    assert [r["train_loss"] for r in history] == pytest.approx([r["train_loss"] for r in expected], rel=1e-6)


def test_fednovas_shift_batches_as_a_gradient_offset(digits):
    """FedNova with the reference code's shift (ccvr fedntd_quirk): −d_k^prev as each client's gradient offset, a
    zero one in its first round; the run stays with the sequential one."""
    sequential_sim, expected = cohort_run("fednova", None, digits, **{"algorithm.ccvr": "fedntd_quirk"})
    cohort_sim, history = cohort_run("fednova", 3, digits, **{"algorithm.ccvr": "fedntd_quirk"})
    a, b = get_flat(sequential_sim.server.model), get_flat(cohort_sim.server.model)
    assert float((a - b).norm() / a.norm()) < KNIFE_EDGE["fednova"] and cohort_sim.cohort_steps > 0
    assert [r["test_accuracy"] for r in history] == pytest.approx([r["test_accuracy"] for r in expected], abs=0.1)


def test_a_method_whose_step_cannot_batch_trains_sequentially_under_run_cohort(digits):
    """FedGen's clients draw generated features inside their steps, which it does not declare as a cohort term:
    under run.cohort they take the sequential path, so the run equals the sequential one bit for bit."""
    sequential_sim, expected = cohort_run("fedgen", None, digits)
    cohort_sim, history = cohort_run("fedgen", 3, digits)
    assert cohort_sim.cohort_steps == 0
    from conftest import without_timings

    assert torch.equal(get_flat(sequential_sim.server.model), get_flat(cohort_sim.server.model))
    assert without_timings(history) == without_timings(expected)


def test_a_cohort_run_resumes_bit_for_bit(digits, tmp_path):
    from conftest import assert_resume_is_exact

    assert_resume_is_exact(digits, tmp_path, {"name": "fedprox"}, **{"run.workers": 1, "run.cohort": 2, "local.momentum": 0.9})


def test_run_cohort_refuses_what_it_cannot_do_in_one_line(digits):
    from conftest import small_config

    from fedistill.errors import ConfigError
    from fedistill.simulation import Simulation

    with pytest.raises(ConfigError, match="run.cohort: .*BatchNorm"):
        sim = Simulation(small_config(**{"run.workers": 1, "run.cohort": 2, "model.name": "resnet8"}), digits)
        sim.run()
    with pytest.raises(ConfigError, match="a cohort trains in this process"):
        small_config(**{"run.workers": 2, "run.cohort": 2})
    with pytest.raises(ConfigError, match="run.cohort"):
        small_config(**{"run.cohort": 1})


def test_the_loss_terms_weighted_means_leave_padded_rows_out():
    """A cohort step pads a partial batch with rows of weight 0: each term's weighted mean over [real, real, padded]
    equals its plain mean over the two real rows (FedNTD's, FedLMD's, KD's, label smoothing's and MOON's)."""
    from fedistill.losses import (
        knowledge_distillation,
        label_masking_distillation,
        label_smoothing_term,
        model_contrastive,
        not_true_distillation,
    )

    g = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    labels, weights = torch.tensor([1, 3, 0]), torch.tensor([1.0, 1.0, 0.0])
    majority = torch.tensor([True, False, False, True, False])
    pairs = [
        (not_true_distillation(student, teacher, labels, 2.0, weights=weights), not_true_distillation(student[:2], teacher[:2], labels[:2], 2.0)),
        (label_masking_distillation(student, teacher, labels, majority, 2.0, weights=weights),
         label_masking_distillation(student[:2], teacher[:2], labels[:2], majority, 2.0)),
        (knowledge_distillation(student, teacher, 2.0, weights=weights), knowledge_distillation(student[:2], teacher[:2], 2.0)),
        (label_smoothing_term(student, labels, 0.1, weights=weights), label_smoothing_term(student[:2], labels[:2], 0.1)),
        (model_contrastive(student, teacher, -teacher, 0.5, weights=weights), model_contrastive(student[:2], teacher[:2], -teacher[:2], 0.5)),
    ]  # fmt: skip
    for weighted, plain in pairs:
        assert float(weighted) == pytest.approx(float(plain), rel=1e-6)


def test_cohorts_group_clients_of_similar_step_counts(digits):
    """K = 2 over a round of clients of different sizes: the two largest train together, then the next two, so the
    padded slots are those of the sorted pairs, computed here from the clients' batch counts (E = 1, B = 20), fewer
    than pairing them in the round's order would waste."""
    from math import ceil

    from conftest import small_config

    from fedistill.simulation import Simulation

    cfg = small_config(**{"algorithm.name": "fedavg", "run.workers": 1, "run.cohort": 2, "local.batch_size": 20, "rounds": 1,
                          "clients_per_round": 6, "partition.alpha": 0.3})  # fmt: skip
    sim = Simulation(cfg, digits)
    sim.run_round(1)
    steps = [ceil(int(sim.federation.train_indices[c].numel()) / 20) for c in sim.server_runtime.select_clients(1)]
    padding = lambda order: sum(abs(a - b) for a, b in zip(order[::2], order[1::2]))  # noqa: E731
    grouped = padding(sorted(steps, reverse=True))
    assert sim.executor.padded_slots == grouped
    assert grouped < padding(steps), steps  # the round's order would pad more: the test can tell them apart


# -------------------------------------------------------------------- run.cohort=auto (issue 66, item 5)
def measured(device="NVIDIA H200", precision="fp32", method="fedavg", sequential=0.37, cohort=0.07, resident=False):
    suffix = "+resident" if resident else ""
    return [{"device": device, "precision": precision, "method": method, "path": path + suffix, "clients": 10,
             "seconds_per_round": seconds} for path, seconds in (("sequential", sequential), ("cohort", cohort))]  # fmt: skip


def test_auto_chooses_a_cohort_only_where_this_gpu_model_measured_one_faster():
    """The rule of engine/cohort_choice.py, each branch: a faster cohort on this GPU model, precision and method
    gives K = clients_per_round; a slower one, another GPU, another precision, another method, the resident paths
    when the run is not resident, a CPU, or one client a round give the sequential path, each with its reason."""
    from conftest import small_config

    from fedistill.engine.cohort_choice import choose_cohort
    from fedistill.simulation import make_algorithm

    cfg = small_config(**{"algorithm.name": "fedavg", "run.cohort": "auto", "clients_per_round": 6})
    fedavg = make_algorithm(cfg)
    assert choose_cohort(cfg, fedavg, "NVIDIA H200", measured()) == (6, "measured faster: 0.070 s a round against 0.370 s sequential with graphs on NVIDIA H200")
    size, why = choose_cohort(cfg, fedavg, "NVIDIA H200", measured(cohort=0.5))
    assert size is None and why.startswith("measured slower")
    for device, rows in [("NVIDIA H100 80GB HBM3", measured()), ("NVIDIA H200", measured(precision="bf16")),
                         ("NVIDIA H200", measured(method="fedprox")), ("NVIDIA H200", measured(resident=True))]:  # fmt: skip
        size, why = choose_cohort(cfg, fedavg, device, rows)
        assert size is None and why.startswith("no measurement of fedavg on " + device), why
    resident = small_config(**{"algorithm.name": "fedavg", "run.cohort": "auto", "clients_per_round": 6, "run.resident_weights": True})
    assert choose_cohort(resident, fedavg, "NVIDIA H200", measured(resident=True))[0] == 6
    assert choose_cohort(cfg, fedavg, "cpu", measured(device="cpu"))[0] is None  # a CPU: sequential, whatever a row says
    one = small_config(**{"algorithm.name": "fedavg", "run.cohort": "auto", "clients_per_round": 1})
    assert choose_cohort(one, fedavg, "NVIDIA H200", measured()) == (None, "one client a round: nothing to stack")


def test_auto_keeps_a_method_whose_step_does_not_batch_sequential():
    from conftest import small_config

    from fedistill.engine.cohort_choice import choose_cohort
    from fedistill.simulation import make_algorithm

    for name in ("fedgen", "fedproto"):
        cfg = small_config(**{"algorithm.name": name, "run.cohort": "auto"})
        size, why = choose_cohort(cfg, make_algorithm(cfg), "NVIDIA H200", measured(method=name))
        assert size is None and why.endswith("client step does not batch"), why


def test_resolving_auto_turns_graphs_off_only_under_a_chosen_cohort(monkeypatch):
    """resolve_cohort's config: K with the clients' CUDA graphs off when a cohort is chosen (the measured path), the
    user's graphs kept when the sequential path is; a size or null passes through unchanged."""
    from conftest import small_config

    import fedistill.engine.cohort_choice as choice
    from fedistill.simulation import make_algorithm

    cfg = small_config(**{"algorithm.name": "fedavg", "run.cohort": "auto", "clients_per_round": 4})
    graphed = cfg.model_copy(update={"run": cfg.run.model_copy(update={"cuda_graphs": True})})  # no CUDA here to validate
    monkeypatch.setattr(choice, "load_measurements", lambda: measured())
    chosen, line = choice.resolve_cohort(graphed, make_algorithm(cfg), "NVIDIA H200")
    assert (chosen.run.cohort, chosen.run.cuda_graphs) == (4, False) and "CUDA graphs off" in line
    kept, line = choice.resolve_cohort(graphed, make_algorithm(cfg), "NVIDIA A100-SXM4-40GB")
    assert (kept.run.cohort, kept.run.cuda_graphs) == (None, True) and "one client after another" in line
    fixed = small_config(**{"run.cohort": 3, "run.workers": 1})
    assert choice.resolve_cohort(fixed, make_algorithm(fixed)) == (fixed, None)


def test_a_run_with_auto_on_the_cpu_is_the_sequential_run_and_says_why(digits, tmp_path):
    """On the CPU auto is the sequential path: the same numbers as run.cohort unset, no batched step, the choice
    in the run's log; its checkpoint resumes exactly."""
    from conftest import assert_resume_is_exact, without_timings

    sequential_sim, expected = cohort_run("fedprox", None, digits)
    auto_sim, history = cohort_run("fedprox", "auto", digits)
    assert auto_sim.cohort_steps == 0 and auto_sim.cfg.run.cohort is None
    assert auto_sim.cohort_choice == "run.cohort=auto: one client after another: on a CPU the batched step is slower (0.62x in fp32 for 10 MNIST CNN clients, docs/speed.md)"
    assert torch.equal(get_flat(sequential_sim.server.model), get_flat(auto_sim.server.model))
    assert without_timings(history) == without_timings(expected)
    assert_resume_is_exact(digits, tmp_path, {"name": "fedprox"}, **{"run.cohort": "auto"})


def test_recorded_measurements_merge_and_are_what_auto_reads(tmp_path):
    """bench_gpu_cohort.py --record: a new row of the same device, precision, method, path and size replaces the
    old one, others stay; the shipped table parses."""
    from fedistill.engine.cohort_choice import MEASURED, load_measurements, record_measurements

    table = tmp_path / "measured.json"
    bench = {"device": "NVIDIA H200", "precision": "fp32", "rounds": 4, "clients": 10, "date": "2026-12-07",
             "rows": [{"method": "fedavg", "path": p, "seconds_per_round": s} for p, s in (("sequential", 0.37), ("cohort", 0.2))]}  # fmt: skip
    assert record_measurements(bench, table) == 2
    bench["rows"] = [{"method": "fedavg", "path": "cohort", "seconds_per_round": 0.07}, {"method": "fedprox", "path": "cohort", "seconds_per_round": 0.1}]
    assert record_measurements(bench, table) == 3
    rows = {(r["method"], r["path"]): r["seconds_per_round"] for r in load_measurements(table)}
    assert rows == {("fedavg", "sequential"): 0.37, ("fedavg", "cohort"): 0.07, ("fedprox", "cohort"): 0.1}
    assert isinstance(load_measurements(MEASURED), list)


def test_a_measurement_auto_could_not_choose_by_is_refused_and_nothing_is_written(tmp_path, capsys):
    """A CPU's rows, a one-round bench (nothing timed), a NaN or a failed row: refused in one line, the table as it
    was. A NaN in the table (edited by hand) reads as no measurement, not as "faster" (NaN >= x is False)."""
    from conftest import small_config

    from fedistill.engine.cohort_choice import choose_cohort, main, record_measurements
    from fedistill.simulation import make_algorithm

    table = tmp_path / "measured.json"
    good = {"device": "NVIDIA H200", "precision": "fp32", "rounds": 4, "clients": 10,
            "rows": [{"method": "fedavg", "path": "sequential", "seconds_per_round": 0.37}]}  # fmt: skip
    record_measurements(good, table)
    before = table.read_text()
    bad = [({**good, "device": "cpu"}, "CPU"), ({**good, "rounds": 1}, "warm-up"),
           ({**good, "rows": [{"method": "fedavg", "path": "cohort", "seconds_per_round": float("nan")}]}, "fedavg cohort"),
           ({**good, "rows": [{"method": "fedprox", "path": "cohort", "seconds_per_round": None}]}, "fedprox cohort"),
           ({"rows": []}, "no device")]  # fmt: skip
    for bench, says in bad:
        with pytest.raises(ValueError, match=says):
            record_measurements(bench, table)
    assert table.read_text() == before
    cfg = small_config(**{"algorithm.name": "fedavg", "run.cohort": "auto", "clients_per_round": 6})
    size, why = choose_cohort(cfg, make_algorithm(cfg), "NVIDIA H200", measured(cohort=float("nan")))
    assert size is None and why.startswith("no measurement"), why
    (tmp_path / "cut.json").write_text('{"device": "H')
    for argv, says in (([str(tmp_path / "absent.json")], "cannot read"), ([str(tmp_path / "cut.json")], "not JSON")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err


class _Answered(Exception):
    pass


def test_what_cohort_batches_says_before_a_round_is_what_cohort_term_answers_in_it(digits, monkeypatch):
    """run.cohort=auto and the cohort executor decide with a method's ``cohort_batches()`` before a round; a cohort
    is planned with ``cohort_term`` in it. For every registered method (and FedProx's gradient-hook form, a gradient
    clip, two combinations) the first client's ``cohort_term`` is not None exactly when ``cohort_batches()`` said
    so (the executor is made to ask every method here)."""
    from conftest import small_config

    import fedistill.engine.cohort_choice as choice
    from fedistill.engine.cohort_choice import batches_clients
    from fedistill.errors import ConfigError
    from fedistill.registry import ALGORITHMS
    from fedistill.simulation import Simulation

    settings = [{"algorithm.name": name} for name in ALGORITHMS.names()] + [
        {"algorithm.name": "fedprox", "algorithm.implementation": "grad_hook"},
        {"algorithm.name": "fedntd", "algorithm.grad_clip": 1.0},
        {"algorithm.name": "fedlmd", "algorithm.plus": {"fedprox": {"mu": 0.01}}},
        {"algorithm.name": "fedavg", "algorithm.plus": {"fedgen": {}}},
    ]
    asked = {}
    monkeypatch.setattr(choice, "batches_clients", lambda algorithm: True)  # the executor asks cohort_term always
    for setting in settings:
        try:
            sim = Simulation(small_config(**{"run.workers": 1, "run.cohort": 2, "rounds": 1, **setting}), digits)
        except ConfigError:  # a method that needs a model group or a shared model: not one cohorts batch
            assert setting["algorithm.name"] not in ("fedavg", "fedprox", "fedntd", "fedlmd")
            continue
        algorithm = sim.client_runtime.algorithm
        said = batches_clients(algorithm)
        if getattr(algorithm, "cohort_term", None) is None or getattr(algorithm, "personal_model", "global") == "local":
            assert not said  # the executor never asks it
            continue
        answers, original = [], algorithm.cohort_term

        def spy(client, msg, answers=answers, original=original):
            answers.append(original(client, msg) is not None)
            raise _Answered

        algorithm.cohort_term = spy
        with pytest.raises(_Answered):
            sim.run_round(1)
        sim.close()
        asked[str(setting)] = answers[0]
        assert answers == [said], setting
    batched = {name for name, answer in asked.items() if answer}
    assert {"{'algorithm.name': 'fedavg'}", "{'algorithm.name': 'scaffold'}", "{'algorithm.name': 'moon'}"} <= batched
    assert "{'algorithm.name': 'fedgen'}" in asked and not asked["{'algorithm.name': 'fedgen'}"]
    assert not asked[str(settings[-4])] and not asked[str(settings[-3])] and asked[str(settings[-2])] and not asked[str(settings[-1])]


def test_a_run_where_auto_chooses_a_cohort_is_the_cohort_run(digits, monkeypatch):
    """The chosen branch end to end, on the CPU with a measured GPU pretended: the run trains as ``run.cohort = K``
    (K its clients a round) would, bit for bit, its log line names the measurement, its numerics record K."""
    from conftest import without_timings

    import fedistill.engine.cohort_choice as choice
    from fedistill.engine.executors import CohortExecutor
    from fedistill.engine.run_setup import run_numerics

    fixed_sim, expected = cohort_run("fedprox", 3, digits)
    monkeypatch.setattr(choice, "device_model", lambda device: "NVIDIA H200")
    monkeypatch.setattr(choice, "load_measurements", lambda: measured(method="fedprox"))
    auto_sim, history = cohort_run("fedprox", "auto", digits)
    assert isinstance(auto_sim.executor, CohortExecutor) and auto_sim.executor.size == auto_sim.cfg.clients_per_round == 3
    assert auto_sim.cohort_choice.startswith("run.cohort=auto: cohorts of 3 clients: measured faster: 0.070 s")
    assert run_numerics(auto_sim.cfg)["cohort"] == 3
    assert torch.equal(get_flat(fixed_sim.server.model), get_flat(auto_sim.server.model))
    assert without_timings(history) == without_timings(expected)
