"""FedCurv (Shoham et al., 2019): elastic weight consolidation across clients. Card: spec/fedcurv.md.

After training, each client estimates the diagonal Fisher ``u_k`` at its weights and uploads ``u_k`` and
``v_k = u_k ⊙ w_k``. The server stores the latest pair of every client and sends client k the sums over the
*other* clients, ``P_k = Σ u_j`` and ``Q_k = Σ u_j ⊙ ŵ_j``; the client adds ``λ (⟨P_k, w²⟩ − 2 ⟨Q_k, w⟩)`` to
its loss (card §3). The reference code's in-place aliasing bug is not reproduced (card ambiguity 1).

``fisher="batch"`` (default) is the reference estimator λ was tuned with: the mean of squared mini-batch
gradients. ``fisher="per_sample"`` is the true empirical Fisher the card offers as an option (ambiguity 3):
the mean over the same samples of each sample's squared gradient, computed batched with ``torch.func``
(``vmap`` of ``grad`` of a ``functional_call``). It is larger by up to ~B on the gradient-noise part, so λ
tuned for one does not carry over to the other.

``own_stats="client"`` is the card's compact form (§2, "server memory ... or only U, V if clients subtract
their own stats"): the server keeps only the float64 sums ``U, V`` instead of ``2|w|`` per client that ever
uploaded (K = 100 MNIST-CNN clients: 1.3 GB), and each client keeps its own last ``(u_k, v_k)`` as client
state (on disk with ``run.client_state=disk``). The server sends ``U, V``; the client forms ``P_k = U − u_k``
and ``Q_k = V − v_k`` itself and uploads the changes ``Δu_k, Δv_k``, which the server adds to the sums. Same
bytes each way; the sums are updated instead of recomputed, in float64, so the two modes agree to float32
rounding (tested).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import functional_call, grad, vmap

from ..engine.cohort import params_vector
from ..engine.state_store import as_stored
from ..losses import curvature_penalty
from ..models.flat import flat_parameters, split_like, trainable_parameters
from ..registry import ALGORITHMS
from .base import ClientContext, Message, RoundInfo, ServerContext
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss, LocalResult


class FedCurvParams(FedAvgParams):
    lam: float = Field(1.0, ge=0.0, description="λ (FedLMD Table 6: 1 or 2)")
    fisher_samples: int = Field(500, ge=1, description="s: stop the Fisher pass after the first batch past s samples")
    fisher: Literal["batch", "per_sample"] = Field(
        "batch",
        description="diagonal Fisher estimator: mean of squared mini-batch gradients (reference code, λ tuned "
        "with it) or mean of per-sample squared gradients (true empirical Fisher); card ambiguity 3",
    )
    own_stats: Literal["server", "client"] = Field(
        "server",
        description="who keeps each client's last (u_k, v_k): the server (card pseudo-code, 2|w| per client) or "
        "the client itself, the server keeping only the sums (card §2, compact)",
    )


# Per-sample gradients are materialised for a chunk of samples at a time: about this many floats at most.
PER_SAMPLE_FLOATS = 1 << 26


def fisher_diagonal(
    client: ClientContext, batch_size: int, budget: int, estimator: Literal["batch", "per_sample"] = "batch"
) -> tuple[torch.Tensor, int]:
    """Diagonal Fisher estimate at the current weights (card §3); returns (u, batches used).

    Eval mode, augmented shuffled training batches (reference estimator, card ambiguities 3-4); stops after
    the first batch where the samples seen exceed ``budget``. ``batch``: ``u = mean_b (g_b ⊙ g_b)`` over the
    batches' mean gradients; ``per_sample``: ``u = mean_i (g_i ⊙ g_i)`` over the same samples' own gradients.
    """
    if estimator not in ("batch", "per_sample"):
        raise ValueError(f"unknown Fisher estimator {estimator!r}")
    model = client.model
    params = trainable_parameters(model)
    was_training = model.training
    model.eval()
    acc = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    seen = batches = 0
    squared_sums = _per_sample_squared_sums(model) if estimator == "per_sample" else None
    for x, y in client.data.epoch_batches(client.train_indices, batch_size, client.generator):
        if squared_sums is None:
            grads = torch.autograd.grad(F.cross_entropy(model(x).float(), y), params)
            for a, g in zip(acc, grads):
                a.add_(g.float() * g.float())
        else:
            for a, s in zip(acc, squared_sums(x, y)):
                a.add_(s)
        seen += int(y.shape[0])
        batches += 1
        if seen > budget:
            break
    model.train(was_training)
    terms = batches if squared_sums is None else seen  # a mean over batches, or over samples
    u = torch.cat([a.reshape(-1) for a in acc]).cpu() / max(terms, 1)
    return u, batches


def _per_sample_squared_sums(model: torch.nn.Module):
    """A function ``(x, y) -> [Σ_i g_i ⊙ g_i per trainable tensor]`` with g_i the gradient of sample i's CE.

    One ``vmap`` over the batch instead of a backward pass per sample; the batch is cut into chunks so that
    at most ~``PER_SAMPLE_FLOATS`` per-sample gradient entries exist at once (ResNet-18 at B = 50 would
    otherwise hold 50 copies of its 11M parameters). Parameters that are not trained and buffers are held
    fixed in the functional call.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trained = {n: p.detach() for n, p in named}
    fixed = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    fixed.update(dict(model.named_buffers()))
    chunk = max(1, PER_SAMPLE_FLOATS // max(1, sum(p.numel() for _, p in named)))

    def sample_loss(weights, x, y):
        logits = functional_call(model, (weights, fixed), (x.unsqueeze(0),))
        return F.cross_entropy(logits.float(), y.unsqueeze(0))

    per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    def squared_sums(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        sums = [torch.zeros_like(p, dtype=torch.float32) for _, p in named]
        for xs, ys in zip(x.split(chunk), y.split(chunk)):
            grads = per_sample_grads(trained, xs, ys)
            for s, (n, _) in zip(sums, named):
                s.add_(grads[n].float().pow(2).sum(0))
        return sums

    return squared_sums


@ALGORITHMS.register("fedcurv")
class FedCurv(FedAvg):
    """FedCurv: FedAvg plus a Fisher-weighted penalty toward the other clients' last models."""

    name = "fedcurv"
    Params = FedCurvParams
    adds_proximal_term = True  # λ Σ_j u_j ⊙ (w − ŵ_j)²: a quadratic pull toward the others' weights

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        size = flat_parameters(server.model).numel()
        if self.params.own_stats == "client":
            server.state["fedcurv_U"] = torch.zeros(size, dtype=torch.float64)
            server.state["fedcurv_V"] = torch.zeros(size, dtype=torch.float64)
            return
        server.state["fedcurv_u"] = {}  # client -> latest u_k
        server.state["fedcurv_v"] = {}  # client -> latest v_k
        server.state["fedcurv_U"] = torch.zeros(size)
        server.state["fedcurv_V"] = torch.zeros(size)

    def broadcast_extras(self, server: ServerContext, info: RoundInfo, cid: int) -> dict[str, Any]:
        if self.params.own_stats == "client":  # everyone's sums; the client subtracts its own
            return {"fisher_sum_u": server.state["fedcurv_U"].float(), "fisher_sum_v": server.state["fedcurv_V"].float()}
        U, V = server.state["fedcurv_U"], server.state["fedcurv_V"]
        own_u, own_v = server.state["fedcurv_u"].get(cid), server.state["fedcurv_v"].get(cid)
        # New tensors per client: U and V are never modified here (card §4).
        p = U - own_u if own_u is not None else U.clone()
        q = V - own_v if own_v is not None else V.clone()
        return {"fisher_p": p, "fisher_q": q}

    def after_aggregate(self, server: ServerContext, info: RoundInfo, replies: list[Message], cids: list[int]) -> dict[str, float]:
        if self.params.own_stats == "client":
            for reply in replies:
                server.state["fedcurv_U"] += reply["fisher_du"].double()
                server.state["fedcurv_V"] += reply["fisher_dv"].double()
            return {}
        for cid, reply in zip(cids, replies):
            server.state["fedcurv_u"][cid] = reply["fisher_u"]
            server.state["fedcurv_v"][cid] = reply["fisher_v"]
        # Recompute the sums over every stored client instead of add/subtract (no float drift; card §3).
        stored = sorted(server.state["fedcurv_u"])
        server.state["fedcurv_U"] = torch.stack([server.state["fedcurv_u"][c] for c in stored]).double().sum(0).float()
        server.state["fedcurv_V"] = torch.stack([server.state["fedcurv_v"][c] for c in stored]).double().sum(0).float()
        return {}

    # -- client ---------------------------------------------------------------------------------
    def _others(self, client: ClientContext, msg: Message) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P_k, Q_k)``: the other clients' summed statistics (card §3)."""
        if self.params.own_stats == "server":
            p, q = msg["fisher_p"], msg["fisher_q"]
        else:
            own_u, own_v = client.state.get("fedcurv_u"), client.state.get("fedcurv_v")
            if own_u is None:
                p, q = msg["fisher_sum_u"], msg["fisher_sum_v"].clone()
            else:
                p, q = msg["fisher_sum_u"] - own_u, msg["fisher_sum_v"] - own_v
        # P_k is a sum of squared gradients, so never negative; a difference of float sums can leave entries a
        # rounding below 0, where λ P_k w² would turn concave and push w away (card §3). A new tensor either way.
        return p.clamp_min(0.0), q

    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss:
        params = trainable_parameters(client.model)
        others_u, others_v = self._others(client, msg)
        p_sum = split_like(client.fixed("fedcurv.p", others_u), params)
        q_sum = split_like(client.fixed("fedcurv.q", others_v), params)
        lam = self.params.lam
        return lambda model, x, y, logits, features: curvature_penalty(params, p_sum, q_sum, lam)

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[object, dict[str, torch.Tensor]] | None:
        """The same penalty on a cohort step (engine/cohort.py): P_k and Q_k as each client's rows."""
        if self.params.grad_clip is not None:
            return None
        others_u, others_v = self._others(client, msg)
        lam = self.params.lam

        def curvature(params, x, y, logits, mask, fixed):
            return curvature_penalty([params_vector(params)], [fixed["fedcurv.p"]], [fixed["fedcurv.q"]], lam)

        return curvature, {"fedcurv.p": others_u, "fedcurv.q": others_v}

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        return ()  # P_k and Q_k through client.fixed

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        # After training, so the Fisher pass cannot change the training batches (card §7).
        u, _ = fisher_diagonal(client, self.local.batch_size, self.params.fisher_samples, self.params.fisher)
        v = u * flat_parameters(client.model)
        if self.params.own_stats == "server":
            return {"fisher_u": u, "fisher_v": v}
        old_u, old_v = client.state.get("fedcurv_u"), client.state.get("fedcurv_v")
        # The changes of the values the client keeps (rounded when states are stored in bf16): the server's
        # U, V stay the sums of the clients' kept u_k, v_k instead of drifting by the rounding.
        u, v = as_stored(u, client.state_dtype), as_stored(v, client.state_dtype)
        client.state["fedcurv_u"], client.state["fedcurv_v"] = u, v
        if old_u is None:
            return {"fisher_du": u.clone(), "fisher_dv": v.clone()}
        return {"fisher_du": u - old_u, "fisher_dv": v - old_v}
