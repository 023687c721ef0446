"""FedICT (Wu et al., IEEE TPDS 2024): federated multi-task distillation. Card: spec/fedict.md.

FedGKT's protocol (:mod:`.fedgkt`) with two knowledge corrections that keep local and global knowledge
apart on purpose, and FedICT's traffic: the labels, the label distribution d^k and the sample count N^k
travel once, with a client's first upload (Alg. 1 l.6-9, A14); afterwards only features and logits go up.

* **FPKD** on the client (Eqs. 8, 10, 11): ``+ λ τ² Σ_r w^k_r g_r log(g_r / l_r)`` with
  ``w^k = softmax(d^k / T)``, so the local model leans towards its own frequent classes.
* **LKA** on the server (Eqs. 9, 12-14), per client k:
  ``sim``: the plain KL weighted ``β + μ s_k`` with ``s_k = cos(d^S, d^k)``;
  ``balance``: ``+ μ τ² Σ_r v^k_r l_r log(l_r / g_r)`` with ``v^k = softmax((d^S − d^k) / U)``.

``d^S = Σ_k N^k d^k / Σ_k N^k`` over the clients whose setup the server has (all of them after round 1
when every client takes part, as in the paper; with partial participation, those seen so far). The
weights are computed in float64 from the uploaded vectors and cast (card "Numerics"). With λ = μ = 0 the
run is FedGKT's, step for step (card invariant 7; tested).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..losses import (
    distillation_kl,
    fpkd_class_weights,
    global_label_distribution,
    label_distribution,
    lka_balance_weights,
    lka_similarity,
)
from ..registry import ALGORITHMS
from .base import ClientContext, Message, ServerContext
from .fedgkt import LABELS, FedGKT, FedGKTParams

DISTRIBUTION, COUNT = "distribution", "count"


class FedICTParams(FedGKTParams):
    variant: Literal["sim", "balance"] = Field("sim", description="LKA by similarity (Eq. 12) or class balance (Eq. 13)")
    fpkd_weight: float = Field(1.5, ge=0, description="λ of Eq. 8")
    lka_weight: float = Field(1.5, ge=0, description="μ of Eq. 9")
    fpkd_temperature: float = Field(3.0, gt=0, description="T of Eq. 11")
    lka_temperature: float = Field(7.0, gt=0, description="U of Eq. 14")
    fpkd_weights: Literal["softmax", "linear"] = Field(
        "softmax", description="w^k of Eq. 11 (softmax), or the authors' code's d^k/T (card A4)"
    )
    lka_weights: Literal["softmax", "linear"] = Field(
        "softmax", description="v^k of Eq. 14 (softmax), or the authors' code's (d^S − d^k)/U, possibly negative (card A5)"
    )
    distribution_ablation: Literal["none", "uniform", "normal", "exponential"] = Field(
        "none",
        description="Table VIII's D_meta@: replace d^k by softmax(ξ), ξ_c i.i.d. U(0,3), N(0, variance 3) or "
        "exponential with rate 3, one draw per client (experiments-fedict.md §7)",
    )


@ALGORITHMS.register("fedict")
class FedICT(FedGKT):
    """FedICT: federated multi-task distillation with class-weighted client (FPKD) and server (LKA) knowledge."""

    name = "fedict"
    Params = FedICTParams
    labels_every_round = False

    # -- client: FPKD -------------------------------------------------------------------------------------
    def client_distribution(self, client: ClientContext) -> torch.Tensor:
        """d^k (Eq. 7) of the client's training labels, or Table VIII's random stand-in, float64.

        The random one is drawn once, at the client's first round, from its own stream, and kept in its state.
        """
        ablation = self.params.distribution_ablation
        if ablation == "none":
            return label_distribution(client.data.dataset.train_y[client.train_indices], client.data.num_classes)
        if "ablation_distribution" not in client.state:
            c, g = client.data.num_classes, client.generator
            if ablation == "uniform":
                xi = 3.0 * torch.rand(c, generator=g, dtype=torch.float64)
            elif ablation == "normal":
                xi = 3.0**0.5 * torch.randn(c, generator=g, dtype=torch.float64)
            else:  # exponential with rate 3: inverse CDF of a uniform draw
                xi = -torch.log1p(-torch.rand(c, generator=g, dtype=torch.float64)) / 3.0
            client.state["ablation_distribution"] = torch.softmax(xi, dim=0)
        return client.state["ablation_distribution"]

    def _class_weights(self, client: ClientContext) -> torch.Tensor:
        """w^k of Eq. 11 (cached per client for the round)."""
        key = (client.cid, client.round)
        if getattr(self, "_weights_key", None) != key:
            self._weights_key = key
            self._weights = fpkd_class_weights(
                self.client_distribution(client), self.params.fpkd_temperature, self.params.fpkd_weights
            ).float()
        return self._weights

    def client_distillation(self, client: ClientContext, logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        p = self.params
        weights = self._class_weights(client).to(logits.device)
        plain = p.kd_weight * distillation_kl(logits, teacher, p.temperature)
        return plain + p.fpkd_weight * distillation_kl(logits, teacher, p.temperature, class_weights=weights)

    def setup_payload(self, client: ClientContext, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """d^k (C float32), N^k (one int32) and Y^k (N^k int32): 4·(C + 1 + N^k) bytes, once (card §2)."""
        distribution = self.client_distribution(client)
        return {
            DISTRIBUTION: distribution.float(),
            COUNT: torch.tensor([labels.numel()], dtype=torch.int32),
            LABELS: labels,
        }

    # -- server: LKA --------------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        super().init_server(server)
        server.state.setdefault("distributions", {})  # cid -> (C,) float64 d^k
        server.state.setdefault("counts", {})  # cid -> N^k

    def receive_setup(self, server: ServerContext, cid: int, reply: Message) -> None:
        if DISTRIBUTION in reply:
            server.state["distributions"][cid] = reply[DISTRIBUTION].double()
            server.state["counts"][cid] = int(reply[COUNT][0])

    def _global_distribution(self, server: ServerContext) -> torch.Tensor:
        cids = sorted(server.state["distributions"])
        key = tuple(cids)
        if getattr(self, "_global_key", None) != key:
            distributions = torch.stack([server.state["distributions"][c] for c in cids])
            counts = torch.tensor([server.state["counts"][c] for c in cids], dtype=torch.float64)
            self._global_key, self._global = key, global_label_distribution(distributions, counts)
        return self._global

    def server_distillation(
        self, server: ServerContext, cid: int, outputs: torch.Tensor, client_logits: torch.Tensor
    ) -> torch.Tensor:
        p = self.params
        local = server.state["distributions"][cid]
        glob = self._global_distribution(server)
        # server_kd_weight: β (paper, Eq. 9 over Eq. 4), 1 in the code's loss style, where β weighs the CE.
        if p.variant == "sim":
            weight = self.server_kd_weight + p.lka_weight * lka_similarity(glob, local)
            return weight * distillation_kl(outputs, client_logits, p.temperature)
        v = lka_balance_weights(glob, local, p.lka_temperature, p.lka_weights).float().to(outputs.device)
        plain = self.server_kd_weight * distillation_kl(outputs, client_logits, p.temperature)
        return plain + p.lka_weight * distillation_kl(outputs, client_logits, p.temperature, class_weights=v)
