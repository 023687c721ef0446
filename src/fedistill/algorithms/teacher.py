"""The frozen global model as a distillation teacher on the client (FedNTD, FedLMD, FedAvg+KD).

The teacher of a round is the broadcast global model ``w_g^{t-1}`` (fedntd.md §3, fedlmd.md ambiguity 5),
frozen and in eval mode. It costs one forward per batch and one model in memory per process.
"""

from __future__ import annotations

import copy

import torch

from ..models.flat import set_flat
from .base import ClientContext


def bf16_exact(model: torch.nn.Module) -> bool:
    """Whether a bf16 copy of ``model`` computes bit for bit what ``model`` computes under bf16 autocast.

    True for the models whose forward is only convolutions, linear layers, ReLU, max-pooling and flatten (the
    FedNTD/FedLMD CNN, the digits CNN, the MLPs): autocast casts the weights and inputs of convolutions and
    linear layers to bf16 and the rest see bf16 tensors, exactly as in a bf16 module. Models with
    normalisation layers are not: autocast runs some of those in fp32 (tests/test_speed_paths.py checks both).
    """
    from ..models.cnn import DigitsCNN, FedAvgNet
    from ..models.mlp import MLP

    return type(model) in (FedAvgNet, DigitsCNN, MLP)


class GlobalTeacher:
    """One frozen teacher module per process, reloaded from each round's broadcast (card §2).

    A deep copy of the worker model is made once, on first use, and then only overwritten with ``set_flat``:
    never a copy per client or per batch. Its forward runs in eval mode under inference mode (no autograd
    graph, no saved activations); the logits are cloned out so the loss may use them in autograd.

    Under bf16 precision the copy is kept in bf16 when that is exact (:func:`bf16_exact`): the weights are
    rounded once per client instead of autocast rounding them again at every batch (the teacher is frozen for
    the whole local update), with the same logits, bit for bit.
    """

    def __init__(self) -> None:
        self._model: torch.nn.Module | None = None

    def load(self, client: ClientContext, weights: torch.Tensor) -> torch.nn.Module:
        if self._model is None:
            self._model = copy.deepcopy(client.model).requires_grad_(False)
            if client.precision == "bf16" and bf16_exact(self._model):
                self._model.to(torch.bfloat16)
        set_flat(self._model, weights)  # copy_ rounds to bf16 as autocast's cast does (to nearest even)
        return self._model.eval()

    @staticmethod
    def logits(teacher: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            if x.is_floating_point() and next(teacher.parameters()).dtype == torch.bfloat16:
                x = x.to(torch.bfloat16)
            out = teacher(x)
        return out.clone()
