"""FedCurv (Shoham et al., 2019): elastic weight consolidation across clients. Card: spec/fedcurv.md.

After training, each client estimates the diagonal Fisher ``u_k`` at its weights and uploads ``u_k`` and
``v_k = u_k ⊙ w_k``. The server stores the latest pair of every client and sends client k the sums over the
*other* clients, ``P_k = Σ u_j`` and ``Q_k = Σ u_j ⊙ ŵ_j``; the client adds ``λ (⟨P_k, w²⟩ − 2 ⟨Q_k, w⟩)`` to
its loss (card §3). The reference code's in-place aliasing bug is not reproduced (card ambiguity 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from ..losses import curvature_penalty
from ..models.flat import flat_parameters, trainable_parameters
from ..registry import ALGORITHMS
from .base import ClientContext, Message, RoundInfo, ServerContext
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss, LocalResult


class FedCurvParams(FedAvgParams):
    lam: float = Field(1.0, ge=0.0, description="λ (FedLMD Table 6: 1 or 2)")
    fisher_samples: int = Field(500, ge=1, description="s: stop the Fisher pass after the first batch past s samples")


def fisher_diagonal(client: ClientContext, batch_size: int, budget: int) -> tuple[torch.Tensor, int]:
    """Mean of squared mini-batch gradients at the current weights (card §3); returns (u, batches used).

    Eval mode, augmented shuffled training batches (reference estimator, card ambiguities 3-4); stops after
    the first batch where the samples seen exceed ``budget``.
    """
    model = client.model
    params = trainable_parameters(model)
    was_training = model.training
    model.eval()
    acc = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    seen = batches = 0
    for x, y in client.data.epoch_batches(client.train_indices, batch_size, client.generator):
        grads = torch.autograd.grad(F.cross_entropy(model(x).float(), y), params)
        for a, g in zip(acc, grads):
            a.add_(g.float() * g.float())
        seen += int(y.shape[0])
        batches += 1
        if seen > budget:
            break
    model.train(was_training)
    u = torch.cat([a.reshape(-1) for a in acc]).cpu() / max(batches, 1)
    return u, batches


@ALGORITHMS.register("fedcurv")
class FedCurv(FedAvg):
    """FedCurv: FedAvg plus a Fisher-weighted penalty toward the other clients' last models."""

    name = "fedcurv"
    Params = FedCurvParams

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        size = flat_parameters(server.model).numel()
        server.state["fedcurv_u"] = {}  # client -> latest u_k
        server.state["fedcurv_v"] = {}  # client -> latest v_k
        server.state["fedcurv_U"] = torch.zeros(size)
        server.state["fedcurv_V"] = torch.zeros(size)

    def broadcast_extras(self, server: ServerContext, info: RoundInfo, cid: int) -> dict[str, Any]:
        U, V = server.state["fedcurv_U"], server.state["fedcurv_V"]
        own_u, own_v = server.state["fedcurv_u"].get(cid), server.state["fedcurv_v"].get(cid)
        # New tensors per client: U and V are never modified here (card §4).
        p = U - own_u if own_u is not None else U.clone()
        q = V - own_v if own_v is not None else V.clone()
        return {"fisher_p": p, "fisher_q": q}

    def after_aggregate(self, server: ServerContext, info: RoundInfo, replies: list[Message], cids: list[int]) -> dict[str, float]:
        for cid, reply in zip(cids, replies):
            server.state["fedcurv_u"][cid] = reply["fisher_u"]
            server.state["fedcurv_v"][cid] = reply["fisher_v"]
        # Recompute the sums over every stored client instead of add/subtract (no float drift; card §3).
        stored = sorted(server.state["fedcurv_u"])
        server.state["fedcurv_U"] = torch.stack([server.state["fedcurv_u"][c] for c in stored]).double().sum(0).float()
        server.state["fedcurv_V"] = torch.stack([server.state["fedcurv_v"][c] for c in stored]).double().sum(0).float()
        return {}

    # -- client ---------------------------------------------------------------------------------
    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss:
        params = trainable_parameters(client.model)
        sizes = [p.numel() for p in params]
        p_sum = [t.view_as(p).to(p.device) for t, p in zip(msg["fisher_p"].split(sizes), params)]
        q_sum = [t.view_as(p).to(p.device) for t, p in zip(msg["fisher_q"].split(sizes), params)]
        lam = self.params.lam
        return lambda model, x, y, logits, features: curvature_penalty(params, p_sum, q_sum, lam)

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        # After training, so the Fisher pass cannot change the training batches (card §7).
        u, _ = fisher_diagonal(client, self.local.batch_size, self.params.fisher_samples)
        return {"fisher_u": u, "fisher_v": u * flat_parameters(client.model)}
