"""``run.precision: bf16`` (every MNIST result in benchmarks/RESULTS.md uses it).

bf16 means ``torch.autocast(dtype=bfloat16)`` around the forward passes of local training *and* of the
server's evaluation, with float32 master weights, optimizer and aggregation (algorithms/local.py).
"""

from __future__ import annotations

import torch
from conftest import small_config, without_timings

from fedistill.algorithms.local import evaluate
from fedistill.simulation import Simulation
from fedistill.models.flat import get_flat


def _config(precision: str, rounds: int):
    # iid over 10 clients so that four rounds suffice (about 80% in bf16): the check costs seconds, not minutes
    settings = {"partition.scheme": "iid", "partition.num_clients": 10, "local.epochs": 2, "run.precision": precision}
    return small_config(rounds=rounds, clients_per_round=5, **settings)


def _record_classifier_outputs(model: torch.nn.Module, seen: set) -> None:
    """Note (output dtype, autocast on, autocast dtype) of every forward of the model's last linear layer."""

    def hook(module, inputs, output):
        seen.add((output.dtype, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

    model.classifier.register_forward_hook(hook)


def test_bf16_fedavg_learns_is_deterministic_and_trains_and_evaluates_under_bf16_autocast(digits):
    sim = Simulation(_config("bf16", 4), digits)
    train, evaluation = set(), set()
    _record_classifier_outputs(sim.client_runtime.worker, train)  # the clients' reused worker: training only
    _record_classifier_outputs(sim.server.model, evaluation)  # the global model: evaluation only
    history = sim.run()

    bf16 = {(torch.bfloat16, True, torch.bfloat16)}
    assert train == bf16, train
    assert evaluation == bf16, evaluation
    for model in (sim.server.model, sim.client_runtime.worker):  # fp32 master weights
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert get_flat(sim.server.model).dtype == torch.float32
    accuracy = history[-1]["test_accuracy"]
    assert accuracy > 60.0, accuracy  # far above chance (10%)

    # The reported test loss is the bf16 one: an fp32 evaluation of the same weights differs slightly.
    fp32 = evaluate(sim.server.model, sim.server_runtime.test_pipeline.test_batches(100), "fp32")
    assert fp32.loss != history[-1]["test_loss"]
    assert abs(fp32.loss - history[-1]["test_loss"]) < 0.05 and abs(100 * fp32.accuracy - accuracy) < 2.0

    again = Simulation(_config("bf16", 4), digits)
    again_history = again.run()
    assert torch.equal(get_flat(sim.server.model), get_flat(again.server.model))  # bitwise
    assert without_timings(history) == without_timings(again_history)


def test_fp32_runs_do_not_autocast(digits):
    """The hook above tells the two apart: without bf16 the classifier's output is float32, autocast off."""
    sim = Simulation(_config("fp32", 1), digits)
    seen: set = set()
    _record_classifier_outputs(sim.server.model, seen)
    sim.server_runtime.evaluate_global()
    assert {(dtype, on) for dtype, on, _ in seen} == {(torch.float32, False)}
