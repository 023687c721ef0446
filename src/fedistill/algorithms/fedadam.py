"""FedAdam (Reddi et al., ICLR 2021). Card: spec/fmtl-baselines.md §2.

FedAvg's clients; the server applies an Adam-type step (no bias correction) to the averaged model change.
"""

from __future__ import annotations

from pydantic import Field

from ..registry import ALGORITHMS
from .aggregate import ServerAdam, ServerOptimizer
from .base import ServerContext
from .fedavg import FedAvg, FedAvgParams


class FedAdamParams(FedAvgParams):
    server_lr: float = Field(1e-2, gt=0, description="η (FedICT gives none; MTFL's FedAdam runs use 1e-2)")
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.99, ge=0, lt=1)
    tau: float = Field(1e-3, ge=0, description="adaptivity τ added to √v")


@ALGORITHMS.register("fedadam")
class FedAdam(FedAvg):
    """FedAdam: FedAvg with Adam on the server's pseudo-gradient."""

    name = "fedadam"
    Params = FedAdamParams
    resident_weights = True  # checked for run.resident_weights (protocol.Algorithm)

    def server_optimizer(self, server: ServerContext) -> ServerOptimizer:
        # BatchNorm statistics get the plain mean afterwards, in FedAvg.aggregate (fmtl-baselines.md §2).
        p = self.params
        return ServerAdam(p.server_lr, p.beta1, p.beta2, p.tau)
