"""Server-side modules that persist across rounds (the generators of FedFTG, FedDF and FedGen).

A checkpoint holds only tensors and plain data (engine/checkpoint.py: it is read with
``weights_only=True``), so a module's weights live in ``server.state[key]`` as one flat vector (BatchNorm
statistics included) and the module itself is built once per process and reloaded from that vector. Its
initial weights come from its own seeded stream ``derive_seed(seed, tag, 0)`` (rounds are 1-based, so the
tag's round streams never collide with it): every (re)start builds the same θ⁰, and a resumed run equals an
uninterrupted one.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..engine.seeding import cpu_seeded, derive_seed
from ..models.flat import get_flat, set_flat
from .base import ClientContext, ServerContext


class PersistentModule:
    """One server module whose weights persist in ``server.state[key]`` (see the module docstring)."""

    def __init__(self, key: str, seed_tag: int, build: Callable[[ServerContext], nn.Module]) -> None:
        self.key = key
        self.seed_tag = seed_tag
        self.build = build
        self._module: nn.Module | None = None

    def initial(self, server: ServerContext) -> nn.Module:
        """A new module with θ⁰ from its own stream (the global RNG is left untouched)."""
        with cpu_seeded(derive_seed(server.seed, self.seed_tag, 0)):
            return self.build(server)

    def init_state(self, server: ServerContext) -> torch.Tensor:
        """θ⁰ into the server state (once); returns the stored vector."""
        if self.key not in server.state:
            server.state[self.key] = get_flat(self.initial(server))
        return server.state[self.key]

    def load(self, server: ServerContext) -> nn.Module:
        """The reused module holding the stored weights."""
        vector = self.init_state(server)
        if self._module is None:
            module = self.initial(server).to(server.device)
            if is_channels_last(server.model):  # as the run's models (run.channels_last): FedFTG's fine-tune
                module = module.to(memory_format=torch.channels_last)  # took 9.9 s instead of 11.6 s on CPU
            self._module = module
        set_flat(self._module, vector)  # copies into the tensors, keeping their memory format
        return self._module

    def store(self, server: ServerContext, module: nn.Module) -> None:
        server.state[self.key] = get_flat(module)


def is_channels_last(model: nn.Module) -> bool:
    """Whether ``model``'s convolution weights are stored channels-last (a 1-channel kernel is both formats)."""
    return any(
        t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
        for t in model.parameters()
    )


def label_counts(client: ClientContext) -> torch.Tensor:
    """The client's label histogram n_k (M int64 counts): what FedFTG, FedDF and FedGen upload."""
    labels = client.data.dataset.train_y[client.train_indices]
    return torch.bincount(labels.cpu(), minlength=client.data.num_classes).to(torch.int64)
