"""FedLMD and FedLMD-Tf (Lu et al., ACM MM 2023): label-masking distillation. Card: spec/fedlmd.md.

Each client computes its majority labels ``M_k`` once from its own label counts (never sent), then trains
with ``CE + β τ² mean_b ℓ_LMD``: the frozen global model of the round is the teacher on the labels the
client is weak at (``A(y) = [C] \\ (M_k ∪ {y})``), and the student is normalised over ``[C] \\ {y}``, so it
also drains mass from non-target majority labels (card §3). FedLMD-Tf replaces the teacher by a uniform
distribution over ``A(y)`` and costs nothing extra. ``switch_round = R`` runs Tf for rounds ``t ≤ R`` and
FedLMD afterwards (Fig. 8): R = 0 is FedLMD, R ≥ T is FedLMD-Tf. Server and bytes are FedAvg's; +Prox and
+AvgM are ``algorithm.plus`` (algorithms/compose.py).

The ablations of Tables 1-2 are here too: FedAvg+KD (``fedavg_kd``: full-softmax KD from the global model)
and FedAvg+LS (``fedavg_ls``: label smoothing 0.1); FedNTD-Tf is ``fedntd`` with ``teacher_free=true``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..engine.cohort import with_teacher
from ..losses import knowledge_distillation, label_masking_distillation, label_smoothing_term, majority_labels
from ..models.flat import get_flat
from ..registry import ALGORITHMS
from .base import ClientContext, Message
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss
from .teacher import GlobalTeacher


class FedLMDParams(FedAvgParams):
    beta: float = Field(1.0, ge=0.0, description="β, weight of the LMD term (card §5; Table 6: 1, or 2 with τ=3)")
    tau: float = Field(1.0, gt=0.0, description="temperature τ (card §5)")
    switch_round: int = Field(
        0, ge=0, description="R: rounds t ≤ R run FedLMD-Tf, later rounds FedLMD (0 = FedLMD; ≥ rounds = Tf; Fig. 8)"
    )
    majority_rule: Literal["code", "paper"] = Field(
        "code", description="M_k: n_kc > n_k/C (code) or n_kc ≥ n_k/|Y_k| (paper) (card ambiguity 1)"
    )


@ALGORITHMS.register("fedlmd")
class FedLMD(FedAvg):
    """FedLMD: FedAvg plus label-masking distillation from the round's global model."""

    name = "fedlmd"
    Params = FedLMDParams
    resident_weights = True  # checked for run.resident_weights (protocol.Algorithm)

    def __init__(self, params, local) -> None:
        super().__init__(params, local)
        self._teacher = GlobalTeacher()
        self._majority: dict[int, torch.Tensor] = {}  # client -> M_k, computed once per process

    def majority(self, client: ClientContext) -> torch.Tensor:
        """``M_k`` from the client's whole training split, computed once (card §3; static, on the client)."""
        if client.cid not in self._majority:
            labels = client.data.dataset.train_y[client.train_indices]
            counts = torch.bincount(labels, minlength=client.data.num_classes)
            self._majority[client.cid] = majority_labels(counts, self.params.majority_rule).to(client.device)
        return self._majority[client.cid]

    def teacher_free(self, round_: int) -> bool:
        return round_ <= self.params.switch_round

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[object, dict[str, torch.Tensor]] | None:
        """The same term on a cohort step (engine/cohort.py): M_k a fixed row per client, the teacher the client's
        received weights (none while teacher-free)."""
        if self.params.grad_clip is not None:
            return None
        beta, tau, teacher_free = self.params.beta, self.params.tau, self.teacher_free(client.round)

        def lmd(params, x, y, logits, mask, fixed):
            teacher_logits = None if teacher_free else fixed["teacher_logits"]
            return beta * label_masking_distillation(logits, teacher_logits, y, fixed["majority"], tau, weights=mask)

        fixed = {"majority": self.majority(client)}
        return (lmd, fixed) if teacher_free else (with_teacher(lmd), {**fixed, "teacher": get_flat(client.model)})

    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss:
        beta, tau = self.params.beta, self.params.tau
        majority = client.fixed("fedlmd.majority", self.majority(client))
        # Tf for rounds t ≤ R, FedLMD after (card §3, "Tf→LMD switch").
        teacher = None if self.teacher_free(client.round) else self._teacher.load(client, msg["weights"])

        def lmd(model, x, y, logits, features):
            teacher_logits = None if teacher is None else GlobalTeacher.logits(teacher, x)
            return beta * label_masking_distillation(logits, teacher_logits, y, majority, tau)

        return lmd

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        # M_k through client.fixed, the teacher loaded in place; with or without a teacher is a closure's shape.
        return (self.teacher_free(client.round),)



class FedLMDTfParams(FedAvgParams):
    beta: float = Field(1.0, ge=0.0, description="β (card §5; large β hurts Tf, Fig. 9)")
    tau: float = Field(1.0, gt=0.0, description="τ (card §5; larger τ helps Tf, Fig. 9)")
    majority_rule: Literal["code", "paper"] = Field("code", description="M_k rule (card ambiguity 1)")


@ALGORITHMS.register("fedlmd_tf")
class FedLMDTf(FedLMD):
    """FedLMD-Tf: label-masking distillation toward a uniform teacher on the minority labels (no teacher)."""

    name = "fedlmd_tf"
    Params = FedLMDTfParams
    resident_weights = True  # checked for run.resident_weights (protocol.Algorithm)

    def teacher_free(self, round_: int) -> bool:
        return True


class KDParams(FedAvgParams):
    beta: float = Field(1.0, ge=0.0, description="β (not stated in the paper; card §3 uses 1)")
    tau: float = Field(1.0, gt=0.0, description="τ (not stated in the paper; card §3 uses 1)")


@ALGORITHMS.register("fedavg_kd")
class FedAvgKD(FedAvg):
    """FedAvg+KD (FedLMD Table 1): full-softmax distillation from the round's global model."""

    name = "fedavg_kd"
    Params = KDParams

    def __init__(self, params, local) -> None:
        super().__init__(params, local)
        self._teacher = GlobalTeacher()

    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss:
        beta, tau = self.params.beta, self.params.tau
        teacher = self._teacher.load(client, msg["weights"])
        return lambda model, x, y, logits, features: beta * knowledge_distillation(
            logits, GlobalTeacher.logits(teacher, x), tau
        )

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[object, dict[str, torch.Tensor]] | None:
        if self.params.grad_clip is not None:
            return None
        beta, tau = self.params.beta, self.params.tau

        def kd(params, x, y, logits, mask, fixed):
            return beta * knowledge_distillation(logits, fixed["teacher_logits"], tau, weights=mask)

        return with_teacher(kd), {"teacher": get_flat(client.model)}

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        return ()  # the teacher is one module loaded in place


class LSParams(FedAvgParams):
    epsilon: float = Field(0.1, ge=0.0, lt=1.0, description="label smoothing ε (FedLMD Table 2: 0.1)")


@ALGORITHMS.register("fedavg_ls")
class FedAvgLS(FedAvg):
    """FedAvg+LS (FedLMD Table 2): cross-entropy with label smoothing (PyTorch convention)."""

    name = "fedavg_ls"
    Params = LSParams

    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss:
        eps = self.params.epsilon
        return lambda model, x, y, logits, features: label_smoothing_term(logits, y, eps)

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[object, dict[str, torch.Tensor]] | None:
        if self.params.grad_clip is not None:
            return None
        eps = self.params.epsilon
        return (lambda params, x, y, logits, mask, fixed: label_smoothing_term(logits, y, eps, weights=mask)), {}

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        return ()  # reads the batch only
