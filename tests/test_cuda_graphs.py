"""``run.cuda_graphs`` (engine/cuda_graphs.py): what can be checked without a GPU.

The capture itself needs CUDA (tests/test_cuda.py runs it against the eager step on a GPU). Its correctness rests
on one argument that holds on any device: a kept SGD optimizer whose momentum buffers are zeroed follows a new
optimizer's trajectory bit for bit, so one optimizer can live with the captured graph across clients.
"""

from __future__ import annotations

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
    made from its columns, the graph's eager step."""

    made = 0

    def __init__(self, model, key, optimizer_for, make_batch, cols):
        from fedistill.engine.cuda_graphs import eager_sgd_step

        self.key, self.optimizer, self.make_batch, self.eager = key, optimizer_for(model), make_batch, eager_sgd_step
        type(self).made += 1

    def step(self, model, cols):
        return self.eager(model, self.optimizer, *self.make_batch(cols), self.key.precision, self.key.grad_clip)


def test_the_graph_path_of_local_sgd_trains_like_the_plain_path(digits, monkeypatch):
    """local_sgd's run.cuda_graphs branch (columns, one kept optimizer reset per client, partial batches, the loss
    sum) against the plain loop, two clients one after the other, with momentum and weight decay: the same weights
    and mean losses bit for bit. A stale momentum between clients or a missed partial batch would differ."""
    from fedistill.algorithms import local
    from fedistill.data.pipeline import TensorPipeline
    from fedistill.engine import cuda_graphs
    from fedistill.models.registry import build_model
    from fedistill.protocol import ClientContext

    steps: dict = {}

    def fake_graphed(model, key, optimizer_for, make_batch, cols):
        if model not in steps or steps[model].key != key:
            steps[model] = _StepWithoutCapture(model, key, optimizer_for, make_batch, cols)
        cuda_graphs.reset_momentum(steps[model].optimizer)
        return steps[model]

    pipeline = TensorPipeline(digits)
    torch.manual_seed(0)
    start = build_model("mlp", (1, 8, 8), digits.num_classes, hidden=(16,))
    settings = dict(lr=0.1, epochs=2, batch_size=16, momentum=0.9, weight_decay=1e-3)
    results = {}
    for graphs in (False, True):
        if graphs:
            monkeypatch.setattr(local, "graphed_sgd_step", fake_graphed)
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
