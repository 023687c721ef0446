"""``run.cuda_graphs`` (engine/cuda_graphs.py): what can be checked without a GPU.

The capture itself needs CUDA (tests/test_cuda.py runs it against the eager step on a GPU). Its correctness rests
on one argument that holds on any device: a kept SGD optimizer whose momentum buffers are zeroed follows a new
optimizer's trajectory bit for bit, so one optimizer can live with the captured graph across clients.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import small_config
from torch import nn

from fedistill.engine.cuda_graphs import reset_momentum
from fedistill.errors import ConfigError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches) -> None:
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("fused", [True, False])
def test_a_kept_optimizer_with_zeroed_momentum_follows_a_new_one_bit_for_bit(fused):
    g = torch.Generator().manual_seed(1)
    first_client = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    second_client = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]
    settings = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, fused=fused)

    kept_model = _model()
    kept = torch.optim.SGD(kept_model.parameters(), **settings)
    _train(kept_model, kept, first_client)  # leaves non-zero momentum behind
    start = [p.detach().clone() for p in kept_model.parameters()]
    reset_momentum(kept)
    assert all(torch.count_nonzero(s["momentum_buffer"]) == 0 for s in kept.state.values())
    _train(kept_model, kept, second_client)

    new_model = _model()
    with torch.no_grad():
        for p, s in zip(new_model.parameters(), start):
            p.copy_(s)
    _train(new_model, torch.optim.SGD(new_model.parameters(), **settings), second_client)
    for a, b in zip(kept_model.parameters(), new_model.parameters()):
        assert torch.equal(a, b)

    # Without the reset the kept momentum carries over and the weights differ: the test can fail.
    stale_model = _model()
    stale = torch.optim.SGD(stale_model.parameters(), **settings)
    _train(stale_model, stale, first_client)
    with torch.no_grad():
        for p, s in zip(stale_model.parameters(), start):
            p.copy_(s)
    _train(stale_model, stale, second_client)
    assert not all(torch.equal(a, b) for a, b in zip(stale_model.parameters(), new_model.parameters()))


def test_cuda_graphs_on_a_cpu_device_is_a_config_error():
    with pytest.raises(ConfigError, match="cuda_graphs needs a CUDA device.*run.device=cuda"):
        small_config(**{"run.cuda_graphs": True})


def test_index_columns_make_the_batches_of_the_epoch_bit_for_bit(digits):
    """The graph's input is a batch's columns (indices and augmentation draws); made into a batch they must be the
    batch ``epoch_batches`` gives from the same generator, augmentation included (crop, flip and cutout)."""
    from fedistill.data.pipeline import AugmentSpec, TensorPipeline

    pipeline = TensorPipeline(digits, AugmentSpec(crop_padding=2, flip=True, cutout=4))
    indices = torch.arange(0, 90)
    batches = list(pipeline.epoch_batches(indices, 32, torch.Generator().manual_seed(3)))
    columns = list(pipeline.epoch_columns(indices, 32, torch.Generator().manual_seed(3)))
    assert [c.shape[1] for c in columns] == [32, 32, 26] and columns[0].shape[0] == 1 + 2 + 1 + 2
    for (x, y), cols in zip(batches, columns, strict=True):
        cx, cy = pipeline.batch_from_columns(cols)
        assert torch.equal(cx, x) and torch.equal(cy, y)


class _StepWithoutCapture:
    """What GraphedSGDStep does, minus the capture (no CUDA here): the kept optimizer reset per client, the batch
    made from its columns, and a full batch's step run by the closure *of the client it was "captured" with*, as
    a replayed graph runs that client's kernels on the addresses they read. A later client's loss term that reads
    a tensor of its own, not through ``client.fixed``, is then not seen, as a real replay would not see it."""

    made = 0
    keys: list = []

    def __init__(self, model, key, optimizer_for, make_batch, cols, train_step=None):
        from fedistill.engine.cuda_graphs import plain_train_step

        self.key, self.optimizer, self.make_batch = key, optimizer_for(model), make_batch
        self.train_step = train_step or plain_train_step(key.precision, key.grad_clip)
        type(self).made += 1
        type(self).keys.append(key)

    def step(self, model, cols, train_step=None):
        run = self.train_step if tuple(cols.shape) == self.key.columns_shape else (train_step or self.train_step)
        return run(model, self.optimizer, *self.make_batch(cols), True)


def _fake_graphs(monkeypatch):
    """local_sgd's graph branch with :class:`_StepWithoutCapture` for the capture (one kept step per worker model)."""
    from fedistill.algorithms import local
    from fedistill.engine import cuda_graphs

    steps: dict = {}

    def fake_graphed(model, key, optimizer_for, make_batch, cols, train_step=None, lr=None):
        if model not in steps or steps[model].key != key:
            steps[model] = _StepWithoutCapture(model, key, optimizer_for, make_batch, cols, train_step)
        cuda_graphs.reset_momentum(steps[model].optimizer)
        return steps[model]

    monkeypatch.setattr(local, "graphed_sgd_step", fake_graphed)


def test_the_graph_path_of_local_sgd_trains_like_the_plain_path(digits, monkeypatch):
    """local_sgd's run.cuda_graphs branch (columns, one kept optimizer reset per client, partial batches, the loss
    sum) against the plain loop, two clients one after the other, with momentum and weight decay: the same weights
    and mean losses bit for bit. A stale momentum between clients or a missed partial batch would differ."""
    from fedistill.algorithms import local
    from fedistill.data.pipeline import TensorPipeline
    from fedistill.models.registry import build_model
    from fedistill.protocol import ClientContext

    _StepWithoutCapture.made = 0
    pipeline = TensorPipeline(digits)
    torch.manual_seed(0)
    start = build_model("mlp", (1, 8, 8), digits.num_classes, hidden=(16,))
    settings = dict(lr=0.1, epochs=2, batch_size=16, momentum=0.9, weight_decay=1e-3)
    results = {}
    for graphs in (False, True):
        if graphs:
            _fake_graphs(monkeypatch)
        model = build_model("mlp", (1, 8, 8), digits.num_classes, hidden=(16,))
        model.load_state_dict(start.state_dict())
        losses = []
        for cid, indices in enumerate((torch.arange(0, 40), torch.arange(40, 90))):  # 40 and 50: partial batches
            ctx = ClientContext(cid=cid, train_indices=indices, data=pipeline, model=model,
                                generator=torch.Generator().manual_seed(cid), cuda_graphs=graphs)
            losses.append(local.local_sgd(ctx, **settings).mean_loss)
        results[graphs] = (torch.cat([p.detach().flatten() for p in model.parameters()]), losses)
    assert _StepWithoutCapture.made == 1  # one kept step for both clients
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1] == results[False][1]


def test_a_model_with_dropout_is_refused_before_any_capture():
    """Dropout's masks would come from CUDA's generator inside the graph and the warm-up, not put back: refused with
    the setting to drop, before anything touches the device (so this runs without a GPU)."""
    from fedistill.engine.cuda_graphs import GraphedSGDStep, StepKey

    model = nn.Sequential(nn.Linear(6, 5), nn.Dropout(0.5), nn.Linear(5, 3))
    key = StepKey((1, 4), 0.1, 0.0, 0.0, None, "fp32")
    with pytest.raises(ConfigError, match=r"dropout \(1\); drop run.cuda_graphs"):
        GraphedSGDStep(model, key, torch.optim.SGD(model.parameters(), lr=0.1), lambda cols: None, torch.zeros(1, 4))


# -- loss terms and gradient corrections under run.cuda_graphs (issue 41, item 3) ---------------------------------------
# Per-client tensors (anchors, control variates, class masks, teachers) must be where the captured kernels read them:
# client.fixed's buffers, or modules loaded in place. Checked here without CUDA: the fake capture replays the closure
# of the client it was made with (see _StepWithoutCapture), so a term that read a tensor of its own would be stale.
GRAPHABLE = {
    "fedprox": {"algorithm.mu": 0.1},
    "fedprox_grad_hook": {"algorithm.name": "fedprox", "algorithm.mu": 0.1, "algorithm.implementation": "grad_hook"},
    "fedntd": {},
    "fedlmd": {},
    "fedlmd_tf": {},
    "fedavg_kd": {},
    "fedavg_ls": {},
    "moon": {},
    "scaffold": {},
    "feddyn": {},
    "feddyn_adaptive": {"algorithm.name": "feddyn", "algorithm.adaptive_alpha": True},
    "fedrs": {},
    "fedcurv": {},
    "fednova": {"algorithm.ccvr": "fedntd_quirk"},
    "fedntd+fedprox": {"algorithm.name": "fedntd", "algorithm.plus": {"fedprox": {"mu": 0.1}}},
    "fedgen": {},  # its noise drawn before each step into fixed buffers (prepare_step); round 1 is the plain step
}


def _graphs_against_eager_on_cpu(digits, monkeypatch, rounds=2, **overrides):
    """The global model after each round, eager and through local_sgd's graph branch (fake capture), and the number
    of fake captures made."""
    import dataclasses

    from fedistill.engine import cuda_graphs
    from fedistill.engine.client import ClientRuntime
    from fedistill.models.flat import get_flat
    from fedistill.simulation import Simulation

    # Momentum and weight decay; no lr decay, so one capture serves every round (a decayed lr captures anew each
    # round, and a stale round-level tensor would go unseen); 4 clients of 6 a round, so one worker trains clients
    # one after another; B = 16 on the digits clients leaves partial batches.
    settings = {"local.momentum": 0.9, "local.weight_decay": 1e-3, "local.lr_decay": 1.0, "local.batch_size": 16,
                "clients_per_round": 4, "run.workers": 1, "run.checkpoint_every": 0, **overrides}
    eager = Simulation(small_config(rounds=rounds, **settings), digits)
    models = [get_flat(eager.run_round(r) and eager.server.model) for r in range(1, rounds + 1)]

    _StepWithoutCapture.made, _StepWithoutCapture.keys = 0, []
    _fake_graphs(monkeypatch)
    original = ClientRuntime.context

    def graphed_context(self, cid, rnd, state):
        return dataclasses.replace(original(self, cid, rnd, state), cuda_graphs=True, graph_inputs=cuda_graphs.fixed_input)

    monkeypatch.setattr(ClientRuntime, "context", graphed_context)
    graphed = Simulation(small_config(rounds=rounds, **settings), digits)
    graphed_models = [get_flat(graphed.run_round(r) and graphed.server.model) for r in range(1, rounds + 1)]
    return models, graphed_models, _StepWithoutCapture.made


@pytest.mark.parametrize("case", sorted(GRAPHABLE))
def test_methods_with_loss_terms_train_through_the_graph_branch_bit_for_bit(digits, monkeypatch, case):
    overrides = {"algorithm.name": case, **GRAPHABLE[case]}
    eager, graphed, captures = _graphs_against_eager_on_cpu(digits, monkeypatch, **overrides)
    assert captures >= 1  # the graph branch was taken (a method left eager would make none)
    for rnd, (a, b) in enumerate(zip(eager, graphed, strict=True), start=1):
        assert torch.equal(a, b), f"{case}: round {rnd} differs by {float((a - b).abs().max())}"


def test_a_loss_term_reading_its_own_tensor_is_caught_by_the_fake_replay(digits, monkeypatch):
    """The check above can fail: FedProx with its anchors as plain clones (not through client.fixed) replays the
    first round's anchors in every later round, and the global model differs from the eager run's."""
    from fedistill.algorithms.fedprox import FedProx

    def stale_anchors(client):
        params = [p for p in client.model.parameters() if p.requires_grad]
        return params, [p.detach().clone() for p in params]

    monkeypatch.setattr(FedProx, "_anchored", staticmethod(stale_anchors))
    eager, graphed, captures = _graphs_against_eager_on_cpu(digits, monkeypatch, rounds=2, **{"algorithm.name": "fedprox", "algorithm.mu": 1.0})
    assert captures >= 1
    assert not torch.equal(eager[-1], graphed[-1])


def test_a_method_that_declares_no_graph_key_keeps_the_eager_step(digits, monkeypatch):
    """DemLearn's loss term does not say what it bakes in (no graph_key): the steps that carry it stay eager; only
    the plain step (a client without the term) is captured."""
    eager, graphed, _ = _graphs_against_eager_on_cpu(digits, monkeypatch, rounds=3, **{"algorithm.name": "demlearn"})
    assert all(key.terms == () for key in _StepWithoutCapture.keys)
    assert torch.equal(eager[-1], graphed[-1])
    eager, graphed, _ = _graphs_against_eager_on_cpu(digits, monkeypatch, rounds=2, **{"algorithm.name": "fedprox", "algorithm.mu": 0.1})
    assert _StepWithoutCapture.keys and all(key.terms != () for key in _StepWithoutCapture.keys)  # the check can fail


def test_fixed_inputs_keep_their_address_and_count_only_reallocations():
    """client.fixed's store: the same name and shape is copied in place (a captured graph reads the new values at
    the old address); a new name is not a reallocation; another shape is one, and bumps the generation that is
    part of a capture's key, so a graph that read the old address is captured anew."""
    from fedistill.engine.cuda_graphs import FixedInputs

    store = FixedInputs()
    first = store.put("anchor", torch.arange(4.0))
    assert store.generation == 0
    again = store.put("anchor", torch.full((4,), 7.0))
    assert again.data_ptr() == first.data_ptr() and torch.equal(first, torch.full((4,), 7.0))
    store.put("other", torch.zeros(2))
    assert store.generation == 0
    moved = store.put("anchor", torch.zeros(5))
    assert store.generation == 1 and moved.shape == (5,)
    store.put("anchor", torch.zeros(5, dtype=torch.float64))
    assert store.generation == 2


def test_client_fixed_is_the_identity_without_graphs_and_refuses_a_missing_store(digits):
    from fedistill.data.pipeline import TensorPipeline
    from fedistill.protocol import ClientContext

    value = torch.ones(3)
    ctx = ClientContext(cid=0, train_indices=torch.arange(4), data=TensorPipeline(digits), model=nn.Linear(2, 2),
                        generator=torch.Generator())
    assert ctx.fixed("x", value) is value and ctx.fixed_list("y", [value])[0] is value
    ctx.cuda_graphs = True
    with pytest.raises(RuntimeError, match="graph_inputs"):
        ctx.fixed("x", value)


def test_the_eager_loop_keeps_autocasts_weight_cache_where_a_term_reuses_a_weight(digits):
    """local_sgd's eager loop is one bf16 autocast region per step with the weight cache on, as it always was: a loss
    term that runs the head a second time (FedGen's regulariser) then shares one bf16 copy of the head, whose two
    gradients are summed in bf16 before the cast back. Written out here as a plain loop; the captured step's cache
    off (each use's gradient cast back, summed in fp32) would give other bits, so the check can fail."""
    from fedistill.algorithms.local import local_sgd
    from fedistill.data.pipeline import TensorPipeline
    from fedistill.models.registry import build_model
    from fedistill.protocol import ClientContext

    pipeline = TensorPipeline(digits)
    torch.manual_seed(0)
    start = build_model("mlp", (1, 8, 8), digits.num_classes, hidden=(16,))
    probe = torch.randn(32, 16, generator=torch.Generator().manual_seed(5))

    def term(model, x, y, logits, features):  # the head again, on other features, with gradient
        return 0.5 * model.classify(probe).float().logsumexp(dim=1).mean()

    def fresh():
        model = build_model("mlp", (1, 8, 8), digits.num_classes, hidden=(16,))
        model.load_state_dict(start.state_dict())
        return model

    indices = torch.arange(0, 64)
    model = fresh()
    ctx = ClientContext(cid=0, train_indices=indices, data=pipeline, model=model, generator=torch.Generator().manual_seed(1),
                        precision="bf16")
    local_sgd(ctx, lr=0.1, epochs=1, batch_size=32, extra_loss=term)

    results = {}
    for cache in (True, False):
        by_hand = fresh()
        optimizer = torch.optim.SGD(by_hand.parameters(), lr=0.1, fused=True)
        for x, y in pipeline.epoch_batches(indices, 32, torch.Generator().manual_seed(1)):
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
                logits = by_hand(x)
                loss = F.cross_entropy(logits.float(), y) + term(by_hand, x, y, logits, None)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        results[cache] = torch.cat([p.detach().flatten() for p in by_hand.parameters()])
    trained = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(trained, results[True])
    assert not torch.equal(results[True], results[False])


class _EvaluationWithoutCapture:
    """engine/cuda_graphs.GraphedEvaluation without CUDA: "replaying" runs the captured loop again."""

    made = 0

    def __init__(self, run, key):
        self.run, self.key = run, key
        type(self).made += 1

    def replay(self):
        return self.run()


def _evaluation_case(digits, monkeypatch):
    from fedistill.data.pipeline import TensorPipeline
    from fedistill.engine import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "GraphedEvaluation", _EvaluationWithoutCapture)
    _EvaluationWithoutCapture.made = 0
    torch.manual_seed(0)
    features = int(torch.tensor(digits.input_shape).prod())
    model = nn.Sequential(nn.Flatten(), nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, digits.num_classes))
    return TensorPipeline(digits), model


def test_the_evaluation_graph_is_kept_per_key_and_captured_anew_for_replaced_weights(digits, monkeypatch):
    """graphed_evaluate's key: in-place weight loads replay the same capture; the hits, another batch size or a
    replaced layer (weights at new addresses, which a kept graph would not read) each capture anew; the numbers are
    evaluate's throughout."""
    from fedistill.engine import cuda_graphs
    from fedistill.engine.evaluation import evaluate

    pipeline, model = _evaluation_case(digits, monkeypatch)

    def both(per_sample=False, batch_size=50):
        graphed = cuda_graphs.graphed_evaluate(
            model, lambda: pipeline.test_batches(batch_size), "fp32", per_sample, pipeline.test_tensors, batch_size
        )
        eager = evaluate(model, pipeline.test_batches(batch_size), "fp32", per_sample)
        assert (graphed.accuracy, graphed.loss) == (eager.accuracy, eager.loss)
        assert torch.equal(graphed.predictions, eager.predictions)
        if per_sample:
            assert torch.equal(graphed.correct, eager.correct)

    for _ in range(3):
        both()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)  # loaded in place: same addresses
    assert _EvaluationWithoutCapture.made == 1
    both(per_sample=True)
    both()
    assert _EvaluationWithoutCapture.made == 2  # the per-sample graph and the plain one, both kept
    both(batch_size=32)
    assert _EvaluationWithoutCapture.made == 3
    model[3] = nn.Linear(16, digits.num_classes)
    both(batch_size=32)
    assert _EvaluationWithoutCapture.made == 4
    both(batch_size=32)
    both(per_sample=True)  # a fifth key: the oldest graph is dropped
    assert _EvaluationWithoutCapture.made == 5 and len(cuda_graphs._EVALUATIONS[model]) == cuda_graphs.MAX_EVALUATION_GRAPHS


def test_an_evaluation_that_cannot_be_captured_runs_eagerly_and_says_so_once(digits, monkeypatch):
    from fedistill.engine import cuda_graphs
    from fedistill.engine.evaluation import evaluate

    pipeline, model = _evaluation_case(digits, monkeypatch)
    attempts = []

    def refuse(run, key):
        attempts.append(key)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "GraphedEvaluation", refuse)
    run = lambda: cuda_graphs.graphed_evaluate(model, lambda: pipeline.test_batches(50), "fp32", False, pipeline.test_tensors, 50)  # noqa: E731
    with pytest.warns(UserWarning, match="could not be captured.*runs eagerly"):
        first = run()
    assert first.loss == evaluate(model, pipeline.test_batches(50)).loss
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run().accuracy == first.accuracy
    assert len(attempts) == 1  # not tried again for the same key


def test_one_read_of_the_totals_gives_the_numbers_of_separate_reads(digits):
    """read_totals packs the counts and the loss into one float64 copy: exact for counts below 2**53, so the
    accuracy, loss and histogram are the ones three separate reads give; written out from the totals here."""
    from fedistill.data.pipeline import TensorPipeline
    from fedistill.engine.evaluation import evaluation_totals, read_totals

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(digits.input_shape).prod()), digits.num_classes))
    with torch.inference_mode():
        totals = evaluation_totals(model.eval(), TensorPipeline(digits).test_batches(40), "fp32", per_sample=True)
    result = read_totals(totals)
    assert result.accuracy == int(totals.correct) / totals.count
    assert result.loss == float(totals.loss_sum) / totals.count
    assert result.predictions.dtype == torch.int64 and torch.equal(result.predictions, totals.predicted)
    assert int(result.predictions.sum()) == totals.count == result.correct.numel()
    assert int(result.correct.sum()) == int(totals.correct)


def test_the_learning_rate_is_rounded_to_float32_on_cuda_only():
    """cuda_learning_rate: the fused SGD kernel reads a tensor learning rate as float32 and a Python one as float64,
    so on CUDA both the eager and the captured step take the float32 value; elsewhere the rate is untouched."""
    import numpy as np

    from fedistill.engine.cuda_graphs import cuda_learning_rate

    lr = 0.01 * 0.99**7  # not a float32 number
    assert float(np.float32(lr)) != lr
    assert cuda_learning_rate(lr, torch.device("cuda")) == float(np.float32(lr))
    assert abs(cuda_learning_rate(lr, torch.device("cuda")) - lr) < 6e-8 * lr
    assert cuda_learning_rate(lr, torch.device("cpu")) == lr


def test_a_tensor_learning_rate_is_written_in_place_and_a_python_one_is_refused():
    from fedistill.engine.cuda_graphs import set_tensor_learning_rate, tensor_learning_rate

    model = _model()
    rate = tensor_learning_rate(0.1, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=rate, momentum=0.9)
    address = rate.data_ptr()
    set_tensor_learning_rate(optimizer, 0.05)
    assert optimizer.param_groups[0]["lr"].data_ptr() == address  # where a captured kernel reads it
    assert float(optimizer.param_groups[0]["lr"]) == float(torch.tensor(0.05, dtype=torch.float32))
    with pytest.raises(TypeError, match="Python number"):
        set_tensor_learning_rate(torch.optim.SGD(model.parameters(), lr=0.1), 0.05)
