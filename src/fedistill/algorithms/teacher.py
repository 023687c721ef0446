"""The frozen global model as a distillation teacher on the client (FedNTD, FedLMD, FedAvg+KD).

The teacher of a round is the broadcast global model ``w_g^{t-1}`` (fedntd.md §3, fedlmd.md ambiguity 5),
frozen and in eval mode. It costs one forward per batch and one model in memory per process.
"""

from __future__ import annotations

import copy

import torch

from ..models.flat import set_flat
from .base import ClientContext


class GlobalTeacher:
    """One frozen teacher module per process, reloaded from each round's broadcast (card §2).

    A deep copy of the worker model is made once, on first use, and then only overwritten with ``set_flat``:
    never a copy per client or per batch. Its forward runs in eval mode under inference mode (no autograd
    graph, no saved activations); the logits are cloned out so the loss may use them in autograd.
    """

    def __init__(self) -> None:
        self._model: torch.nn.Module | None = None

    def load(self, client: ClientContext, weights: torch.Tensor) -> torch.nn.Module:
        if self._model is None:
            self._model = copy.deepcopy(client.model).requires_grad_(False)
        set_flat(self._model, weights)
        return self._model.eval()

    @staticmethod
    def logits(teacher: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = teacher(x)
        return out.clone()
