"""algorithms/server_modules.py: server modules persisting in server.state (FedFTG, FedDF, FedGen generators)."""

from __future__ import annotations

import torch
from torch import nn

from fedistill.algorithms.base import ServerContext
from fedistill.algorithms.server_modules import PersistentModule
from fedistill.engine.seeding import derive_seed


def _server(seed: int) -> ServerContext:
    return ServerContext(model=nn.Linear(2, 2), state={}, generator=torch.Generator(), num_classes=2, seed=seed)


def test_initial_weights_come_from_the_tag_stream_and_leave_the_global_rng_alone():
    module = PersistentModule("g", seed_tag=9, build=lambda server: nn.Linear(3, 4))
    server = _server(seed=5)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    stored = module.init_state(server).clone()
    assert torch.equal(torch.rand(1), before)  # the global stream did not move
    torch.manual_seed(derive_seed(5, 9, 0))
    expected = nn.Linear(3, 4)  # built by hand from the documented stream
    assert torch.equal(stored, torch.cat([expected.weight.reshape(-1), expected.bias]))
    assert not torch.equal(stored, PersistentModule("g", 9, lambda s: nn.Linear(3, 4)).init_state(_server(seed=6)))


def test_load_reuses_one_module_and_store_round_trips_through_the_state():
    builds = []
    module = PersistentModule("g", 1, lambda server: builds.append(1) or nn.Linear(2, 3))
    server = _server(seed=0)
    first = module.load(server)
    with torch.no_grad():
        first.weight.add_(1.0)
    module.store(server, first)
    again = module.load(server)
    assert again is first and len(builds) == 2  # θ⁰ for the state and the one reused module; nothing per round
    assert torch.equal(server.state["g"], torch.cat([first.weight.reshape(-1), first.bias]).detach())
    fresh_server = _server(seed=0)
    fresh_server.state["g"] = server.state["g"].clone()
    other = PersistentModule("g", 1, lambda s: nn.Linear(2, 3)).load(fresh_server)  # a resumed process
    assert torch.equal(other.weight, first.weight)


def test_a_channels_last_run_gets_a_channels_last_module_with_the_same_stored_weights():
    def build(server):
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 3))

    nchw = ServerContext(model=nn.Conv2d(3, 8, 3), state={}, generator=torch.Generator(), num_classes=2, seed=3)
    last = ServerContext(
        model=nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last), state={}, generator=torch.Generator(),
        num_classes=2, seed=3,
    )  # fmt: skip
    plain = PersistentModule("g", 1, build).load(nchw)
    fast = PersistentModule("g", 1, build).load(last)
    assert plain[1].weight.is_contiguous() and not plain[1].weight.is_contiguous(memory_format=torch.channels_last)
    assert fast[1].weight.is_contiguous(memory_format=torch.channels_last) and not fast[1].weight.is_contiguous()
    assert torch.equal(nchw.state["g"], last.state["g"])  # the same θ⁰, whatever the layout
    x = torch.randn(2, 3, 9, 9)
    torch.testing.assert_close(fast(x.contiguous(memory_format=torch.channels_last)), plain(x), rtol=1e-5, atol=1e-5)
