"""FedRS (Li & Zhan, KDD 2021): restricted softmax. Card: spec/fedrs.md.

Each client scales the logits of the classes it does not hold by ``α`` before its CE (binary mode, the
paper's), so their classifier rows are not pushed down by data that never shows them. Evaluation uses
the unscaled model; server and aggregation are FedAvg's.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
from pydantic import Field

from ..engine.cohort import LOGIT_SCALE
from ..losses import restricted_softmax_scaling
from ..registry import ALGORITHMS
from .base import ClientContext
from .fedavg import FedAvg, FedAvgParams


class FedRSParams(FedAvgParams):
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="scale of missing-class logits (FedLMD Table 6: 0.5 or 0.9)")
    mode: Literal["binary", "proportional"] = Field("binary", description="paper (binary) or FedRepo (proportional)")


@ALGORITHMS.register("fedrs")
class FedRS(FedAvg):
    """FedRS: FedAvg whose clients train through a restricted softmax."""

    name = "fedrs"
    Params = FedRSParams

    def logit_transform(self, client: ClientContext) -> Callable[[torch.Tensor], torch.Tensor]:
        labels = client.data.dataset.train_y[client.train_indices]  # the client's full local split (card §4)
        counts = torch.bincount(labels, minlength=client.data.num_classes)
        scale = client.fixed("fedrs.scale", restricted_softmax_scaling(counts, self.params.alpha, self.params.mode).to(client.device))
        return lambda logits: logits * scale[None, :]

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[object, dict[str, torch.Tensor]] | None:
        """On a cohort step (engine/cohort.py) s_k is the client's row of logit scales."""
        if self.params.grad_clip is not None:
            return None
        labels = client.data.dataset.train_y[client.train_indices]
        counts = torch.bincount(labels, minlength=client.data.num_classes)
        return None, {LOGIT_SCALE: restricted_softmax_scaling(counts, self.params.alpha, self.params.mode).to(client.device)}

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        return ()  # s_k through client.fixed
