"""FML, Federated Mutual Learning (Shen et al., 2020; HtFLlib's ``FML``): a shared meme model, averaged by the
server, trained on every client together with the client's private model by deep mutual learning. Card:
spec/fml.md.

Each client keeps a private model of its own architecture (never sent) and, each round it is selected, forks the
server's meme (F1) into the engine's shared-model worker (``model.shared``, by default the assignment's first
member: HtFLlib's ``models[0]``; its initial weights from their own seeded stream, card ambiguity 7). Then per
batch, both models in train mode (F2-F4):

    L_priv = α CE(z, y) + (1 − α) KL̄(q ‖ p),   L_meme = β CE(u, y) + (1 − β) KL̄(p ‖ q)

(:func:`~fedistill.losses.mutual_learning_losses`); by default, as HtFLlib, the targets are not detached and the
two backward passes accumulate, so both models take the gradient of L_priv + L_meme; each model's gradient is
clipped to total norm 10 on its own; one plain-SGD step of each at the client's rate. The client uploads its meme
(F5); the server takes the unweighted mean of the arrived memes (F6; ``weighting="samples"``: n_k-weighted).
Evaluation: the private model after its update (personal model "local", card §3 "Inference").

``variant="paper"`` (the authors' code) sets ``detach_targets``, ``kl_reduction="batchmean"`` and no clipping,
each also settable alone. Bytes (card §5): 4·|φ| up per arrived client (+ 8 for n_k with ``weighting="samples"``),
4·|φ| down per selected client, whatever the private architectures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from ..losses import mutual_learning_losses
from ..models.flat import get_flat, set_flat
from ..protocol import Exchange, metric_items
from ..registry import ALGORITHMS
from .base import Algorithm, AlgorithmParams, ClientContext, Message, RoundInfo, ServerContext
from .hetero import (
    SAMPLES_KEY,
    HtFLlibClientDefaults,
    init_shared_state,
    keep_own_model,
    load_own_model,
    mean_of_uploads,
    train_parts_jointly,
)
from .local import autocast_context

MEME_KEY = "meme"  # server state and both messages: the meme's flat weights


class FMLParams(AlgorithmParams):
    alpha: float = Field(0.5, ge=0, le=1, description="α, the private model's CE weight; 1 − α on KL(meme ‖ private) (HtFLlib total.sh -al 0.5)")
    beta: float = Field(0.5, ge=0, le=1, description="β, the meme's CE weight; 1 − β on KL(private ‖ meme) (HtFLlib total.sh -bt 0.5)")
    variant: Literal["htfllib", "paper"] = Field(
        "htfllib", description="htfllib: targets not detached, KL mean over |b|·C, clip 10; paper: the authors' DML"
    )
    detach_targets: bool | None = Field(None, description="each KL's target a constant; unset: by the variant (htfllib: no)")
    kl_reduction: Literal["mean", "batchmean"] | None = Field(
        None, description="mean over |b|·C (HtFLlib) or over |b| (the authors); unset: by the variant"
    )
    clip_norm: float | None = Field(10.0, gt=0, description="each model's gradient clipped to this total norm (HtFLlib); null: none")
    weighting: Literal["uniform", "samples"] = Field("uniform", description="the server's mean of the memes (HtFLlib and the authors: uniform)")
    eval_model: Literal["private", "meme"] = Field(
        "private", description="scored on each client's test split: its private model (HtFLlib) or the new global meme"
    )

    def resolved(self) -> tuple[bool, str, float | None]:
        """(detach_targets, kl_reduction, clip_norm) after the variant: an explicit setting wins."""
        paper = self.variant == "paper"
        detach = self.detach_targets if self.detach_targets is not None else paper
        reduction = self.kl_reduction or ("batchmean" if paper else "mean")
        clip = None if paper and "clip_norm" not in self.model_fields_set else self.clip_norm
        return detach, reduction, clip


@ALGORITHMS.register("fml")
class FML(HtFLlibClientDefaults, Algorithm):
    """FML: a shared meme model averaged by the server, trained with each private model by mutual learning."""

    name = "fml"
    Params = FMLParams
    exchange: ClassVar[Exchange] = Exchange("shared sub-model", "the meme model's weights", shared_model=True)
    personal_model: ClassVar[str] = "local"  # the private model after its update, on its own test split

    def __init__(self, params: FMLParams, local: Any) -> None:
        super().__init__(params, local)
        if params.eval_model == "meme":  # the global meme after aggregation, sent to each client to score
            self.personal_model = "assembled"

    # -- server ---------------------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        init_shared_state(server, MEME_KEY, self.name)

    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        return Message({MEME_KEY: server.state[MEME_KEY]})  # (F1)

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        mean = mean_of_uploads(replies, MEME_KEY, self.params.weighting, self.name)  # (F6): plain by default
        if mean is not None:
            server.state[MEME_KEY] = mean
        return {}

    # -- client ---------------------------------------------------------------------------------------------
    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        private, meme = client.model, client.shared_model
        if meme is None:
            raise ValueError("fml: the engine gave the client no shared model (Exchange.shared_model)")
        load_own_model(client)
        set_flat(meme, msg[MEME_KEY])  # (F1): fork the global meme
        detach, reduction, clip = self.params.resolved()

        def batch_loss(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with autocast_context(client.precision, client.device):
                z, u = private(x), meme(x)
            loss_private, loss_meme = mutual_learning_losses(
                z.float(), u.float(), y, self.params.alpha, self.params.beta, reduction, detach
            )  # (F2)
            return loss_private + loss_meme, loss_private  # (F3): HtFLlib's two backward passes, accumulated

        # (F4): both models at the client's rate, each gradient clipped on its own
        mean_loss = train_parts_jointly(client, [(private, info.lr), (meme, info.lr)], self.local, clip, batch_loss)
        keep_own_model(client)
        upload: dict[str, Any] = {MEME_KEY: get_flat(meme)}  # (F5)
        if self.params.weighting == "samples":
            upload[SAMPLES_KEY] = int(client.num_samples)
        return Message({**upload, **metric_items(mean_loss, client.num_samples)})

    # -- eval_model="meme": the global meme on the client's test split ----------------------------------------
    def assemble_personal_model(self, client: ClientContext, msg: Message) -> None:
        if client.shared_model is None:
            raise ValueError("fml: the engine gave the client no shared model (Exchange.shared_model)")
        set_flat(client.shared_model, msg[MEME_KEY])

    def personal_predictor(self, client: ClientContext) -> Any:
        return client.shared_model if self.params.eval_model == "meme" else client.model
