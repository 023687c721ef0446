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
