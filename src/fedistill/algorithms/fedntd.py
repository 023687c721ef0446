"""FedNTD (Lee et al., NeurIPS 2022): not-true distillation. Card: spec/fedntd.md.

Clients add ``β · τ² · KL(q̃_t || q̃_s)`` on the not-true classes, with the teacher the frozen global
weights of the round (card §3); server and aggregation are FedAvg's. ``teacher_free=True`` is FedNTD-Tf
(uniform teacher, FedLMD Table 2).
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..engine.cohort import with_teacher
from ..losses import not_true_distillation
from ..models.flat import get_flat
from ..registry import ALGORITHMS
from .base import ClientContext, Message
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss
from .teacher import GlobalTeacher


class FedNTDParams(FedAvgParams):
    beta: float = Field(1.0, ge=0.0, description="β, weight of the NTD term (FedLMD Table 6: 1-3)")
    tau: float = Field(1.0, gt=0.0, description="temperature τ")
    teacher_free: bool = Field(False, description="FedNTD-Tf: uniform not-true teacher")


@ALGORITHMS.register("fedntd")
class FedNTD(FedAvg):
    """FedNTD: FedAvg plus not-true distillation from the round's global model."""

    name = "fedntd"
    Params = FedNTDParams
    resident_weights = True  # checked for run.resident_weights (protocol.Algorithm)

    def __init__(self, params, local) -> None:
        super().__init__(params, local)
        self._teacher = GlobalTeacher()

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        return ()  # the teacher is one module loaded in place; β, τ and teacher_free are fixed for the run

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[object, dict[str, torch.Tensor]] | None:
        """The same term on a cohort step (engine/cohort.py): the teacher is the client's received weights."""
        if self.params.grad_clip is not None:
            return None
        beta, tau, teacher_free = self.params.beta, self.params.tau, self.params.teacher_free

        def ntd(params, x, y, logits, mask, fixed):
            return beta * not_true_distillation(logits, None if teacher_free else fixed["teacher_logits"], y, tau, weights=mask)

        return (ntd, {}) if teacher_free else (with_teacher(ntd), {"teacher": get_flat(client.model)})

    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss:
        beta, tau = self.params.beta, self.params.tau
        teacher = None if self.params.teacher_free else self._teacher.load(client, msg["weights"])

        def ntd(model, x, y, logits, features):
            teacher_logits = None if teacher is None else GlobalTeacher.logits(teacher, x)
            return beta * not_true_distillation(logits, teacher_logits, y, tau)

        return ntd
