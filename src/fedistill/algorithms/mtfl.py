"""MTFL (Mills, Hu and Min, IEEE TPDS 2021): FedAvg with private BatchNorm patches. Card:
spec/fmtl-baselines.md §4.

Multi-task FL keeps a few "patch" values of every model on its client, so each client owns a personalised
model: the averaged shared weights θ plus its own patch P_k. The card's setting (MTFL code "yb") keeps the
BatchNorm affine parameters γ and β private; the running mean and variance are shared and averaged. It is
FedAvg plus one ingredient, a private-parameter mask (:meth:`FedAvg.private_mask`): the broadcast and the
uploads carry only θ (so |W_sh| excludes the 2·Σ channels of the patches), the server aggregates only θ (with
FedAvg's rule, or the server optimiser of a method added with ``algorithm.plus``, e.g. FedAdam for
MTFL(FedAdam)), and P_k lives in the client's state across rounds, starting from the initial model's γ, β.

Personalised model (UA): (θ_{t+1}, P_k), assembled on the client after the round's aggregation and evaluated on
its test split. The MTFL code evaluates the downloaded model at the start of the next round instead,
(θ_t, P_k) with P_k from the client's previous round; with full participation that is the same model one round
index later (card ambiguity). Without BatchNorm layers nothing is private and MTFL is FedAvg bit for bit.
The server's own model keeps the initial γ, β, so its test-set accuracy ("global") is not a meaningful number
for MTFL; the paper reports UA only.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..models.flat import batchnorm_mask
from ..registry import ALGORITHMS
from .fedavg import FedAvg, FedAvgParams


class MTFLParams(FedAvgParams):
    private: Literal["bn_affine", "bn_all"] = Field(
        "bn_affine",
        description="the patch kept on each client: BatchNorm γ and β (the card's 'yb', default), or also the "
        "BatchNorm running statistics",
    )


@ALGORITHMS.register("mtfl")
class MTFL(FedAvg):
    """MTFL(FedAvg): FedAvg whose BatchNorm patches stay on the clients."""

    name = "mtfl"
    Params = MTFLParams
    personal_model = "assembled"

    def private_mask(self, model: torch.nn.Module) -> torch.Tensor | None:
        return batchnorm_mask(model, statistics=self.params.private == "bn_all")
