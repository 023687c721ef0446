"""FedDKC (Wu et al., ACM TIST 2024): distributed knowledge congruence. Card: spec/feddkc.md.

FedGKT (:mod:`.fedgkt`) with one change on the server: before distilling from a client's uploaded logits,
the server refines every knowledge vector onto a common statistic, so that heterogeneous clients whose
models are more or less confident give congruent targets (card §1). Two refinements (card §3):

* **KKR** (kernel-based, the FedICT paper's choice): ``p = softmax(z / (S·τ))`` mapped affinely so that its
  peak equals ``T`` (ranking kept; a fixed fallback for near-uniform vectors);
* **SKR** (searching-based): ``softmax(z / s*)`` with the temperature ``s*`` found by bisection so that the
  entropy equals ``H*`` bits.

The refined vector is the teacher as it is; only the server's output is softened by τ (A4):
``L_s = CE(o, y) + β τ² KL(φ(z) ‖ σ_τ(o))``. The client side, the messages and the traffic are FedGKT's.
The card's values are tied to C = 10 (T = 0.12, H* = 3.2 bits); for other class counts the same relative
setting is used (A5): ``T = 1.2 / C`` and ``H* = (3.2 / log2 10) · log2 C``, unless set.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from ..losses import distillation_kl_from_probs, kkr_refine, skr_refine
from ..registry import ALGORITHMS
from .base import ServerContext
from .fedgkt import FedGKT, FedGKTParams


class FedDKCParams(FedGKTParams):
    refinement: Literal["kkr", "skr"] = Field("kkr", description="KKR (peak probability) or SKR (entropy)")
    peak: float | None = Field(None, gt=0, le=1, description="KKR's target peak T; null = 1.2/C (0.12 for 10 classes)")
    kkr_scale: float = Field(0.05, gt=0, description="KKR's pre-softmax scale S of the client logits (code; 1 = softmax(z/τ))")
    target_entropy_bits: float | None = Field(
        None, gt=0, description="SKR's target entropy H* in bits; null = 0.9633·log2 C (3.2 for 10 classes)"
    )


@ALGORITHMS.register("feddkc")
class FedDKC(FedGKT):
    """FedDKC: FedGKT with the server distilling from refined client knowledge (KKR or SKR)."""

    name = "feddkc"
    Params = FedDKCParams

    def refined_teacher(self, client_logits: torch.Tensor, num_classes: int) -> torch.Tensor:
        """φ(z): the refined local knowledge the server distils from (no gradient, card invariant 6)."""
        p = self.params
        if p.refinement == "kkr":
            peak = p.peak if p.peak is not None else 1.2 / num_classes
            if not 1.0 / num_classes < peak <= 1.0:
                raise ValueError(f"algorithm.params.peak: must lie in (1/C, 1] = ({1.0 / num_classes:.4g}, 1], got {peak}")
            return kkr_refine(client_logits, peak, scale=p.kkr_scale, tau=p.temperature)
        target = p.target_entropy_bits
        if target is None:
            target = (3.2 / math.log2(10)) * math.log2(num_classes)
        if not 0 < target < math.log2(num_classes):
            raise ValueError(
                f"algorithm.params.target_entropy_bits: must lie in (0, log2 C) = (0, {math.log2(num_classes):.4g}), got {target}"
            )
        return skr_refine(client_logits, target)

    def server_distillation(
        self, server: ServerContext, cid: int, outputs: torch.Tensor, client_logits: torch.Tensor
    ) -> torch.Tensor:
        p = self.params
        teacher = self.refined_teacher(client_logits, outputs.shape[1]).to(outputs.device)
        return self.server_kd_weight * distillation_kl_from_probs(outputs, teacher, p.temperature)
