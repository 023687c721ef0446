"""FedMRL (Yi et al., NeurIPS 2024; HtFLlib's ``FedMRL``): a shared small model's feature and the private
model's feature, concatenated, are fused by a private projector into one Matryoshka representation whose first s
dimensions feed the shared head and whose whole feeds the private head. Card: spec/fedmrl.md.

The shared model g (``model.shared``, by default the assignment's first member, built with ``feature_dim = s``:
HtFLlib's ``BaseHeadSplit(args, 0, feature_dim=s)``, card M7) travels and is averaged whole, extractor and head
(M4-M5: the plain mean; ``weighting="samples"`` as an option). Client k, each round it is selected, forks it (M1),
takes its projector P_k = Linear(s + d, d) (by default its *initial* P_k^0 every round, as HtFLlib, which never
saves the trained one: card ambiguity 1; ``keep_projector=True`` keeps the trained one), and per batch (M2-M3)

    v = [g_ex(x); e_k(x)],  m = P_k(v),  u = g_hd(m[:, :s]),  z = h_k(m),  L = CE(z, y) + CE(u, y)

(:func:`~fedistill.losses.matryoshka_loss`), one plain-SGD step of the private model, the projector and the shared
model. Inference (M6): argmax h_k(P_k([g_ex(x; ψ_t); e_k(x)])) with the new global shared model (personal model
"assembled"); ``eval_head="shared"`` scores g_hd on the first s dimensions instead.

P_k^0 is drawn from the client's own stream ``make_generator(seed, FEDMRL, 0, cid)`` with PyTorch's default Linear
initialisation (weights and bias uniform in ±1/sqrt(s + d)): the same in every round, process and resume.
``variant="paper"`` (the authors' code): kept projector, sample weighting, gradients clipped at 50 per part.
Bytes (card §5): 4·|ψ| each way per client (+ 8 up for n_k with sample weighting); P_k and θ_k never travel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from ..engine.seeding import FEDMRL
from ..losses import matryoshka_loss
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
    run_long_linear_init,
    train_parts_jointly,
)
from .local import autocast_context

SHARED_KEY = "shared"  # server state and both messages: the shared model's flat weights (extractor and head)
PROJECTOR_KEY = "projector"  # client state with keep_projector: the trained P_k (weight then bias)


HTFLLIB_SUB_FEATURE_DIM = 128  # HtFLlib's -sfd


class FedMRLParams(AlgorithmParams):
    sub_feature_dim: int | None = Field(
        None, ge=1, description="s, the shared model's feature width and the small doll's size; unset: HtFLlib's 128, or "
        "the narrowest private feature where that is narrower (the 64-wide digit models)"
    )
    variant: Literal["htfllib", "paper"] = Field(
        "htfllib", description="htfllib: projector reset every round, plain mean, no clipping; paper: the authors' code"
    )
    keep_projector: bool | None = Field(None, description="keep the trained projector across rounds; unset: by the variant (htfllib: no)")
    weighting: Literal["uniform", "samples"] | None = Field(None, description="the server's mean; unset: by the variant (htfllib: uniform)")
    clip_norm: float | None = Field(None, gt=0, description="each part's gradient clipped to this norm; unset: by the variant (paper: 50)")
    eval_head: Literal["private", "shared"] = Field("private", description="the head scored at evaluation (M6)")

    def resolved(self) -> tuple[bool, str, float | None]:
        """(keep_projector, weighting, clip_norm) after the variant: an explicit setting wins."""
        paper = self.variant == "paper"
        keep = self.keep_projector if self.keep_projector is not None else paper
        weighting = self.weighting or ("samples" if paper else "uniform")
        clip = self.clip_norm if self.clip_norm is not None else (50.0 if paper else None)
        return keep, weighting, clip


class FusedPredictor(nn.Module):
    """FedMRL's inference (M6): the private head on P_k([g_ex(x); e_k(x)]), or the shared head on its first s
    dimensions (``head="shared"``)."""

    def __init__(self, private: nn.Module, shared: nn.Module, projector: nn.Linear, s: int, head: str = "private") -> None:
        super().__init__()
        self.private, self.shared, self.projector, self.s, self.head = private, shared, projector, s, head

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(torch.cat([self.shared.extract(x), self.private.extract(x)], dim=1))  # shared first (M2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.fused(x)
        return self.private.classifier(m) if self.head == "private" else self.shared.classifier(m[:, : self.s])


def initial_projector(client: ClientContext, s: int, d: int) -> torch.Tensor:
    """P_k^0 as a flat vector (weight (d, s + d) then bias (d,)), from the client's own run-long stream."""
    return run_long_linear_init(client, FEDMRL, d, s + d, bias=True)


@ALGORITHMS.register("fedmrl")
class FedMRL(HtFLlibClientDefaults, Algorithm):
    """FedMRL: a shared small model fused with each private model by a private projector into nested representations."""

    name = "fedmrl"
    Params = FedMRLParams
    exchange: ClassVar[Exchange] = Exchange("shared sub-model", "the shared small model's weights", shared_model=True)
    personal_model: ClassVar[str] = "assembled"  # its private model and projector with the new global shared model

    def __init__(self, params: FedMRLParams, local: Any) -> None:
        super().__init__(params, local)
        self._projectors: dict[tuple[int, int], nn.Linear] = {}  # one reused worker per shape
        # s as resolved against the client models (_resolve_s: the engine asks for the shared model's options, on
        # the server and in every client runtime, before any round)
        self._s = params.sub_feature_dim or HTFLLIB_SUB_FEATURE_DIM

    def _resolve_s(self, models: Mapping[str, nn.Module]) -> int:
        """s: as set, or HtFLlib's 128 capped by the narrowest private feature (kept for the client steps)."""
        widths = [int(getattr(m, "feature_dim", 0)) for m in models.values()]
        self._s = self.params.sub_feature_dim or min([HTFLLIB_SUB_FEATURE_DIM, *widths])
        return self._s

    def refuse_models(self, models: Mapping[str, nn.Module]) -> str | None:
        s = self._resolve_s(models)
        narrow = {name: int(getattr(m, "feature_dim", 0)) for name, m in models.items() if not hasattr(m, "extract")
                  or int(m.feature_dim) < s}  # fmt: skip
        if narrow:
            return (f"fuses a {s}-wide shared feature into each private one, which must be at least as wide (card "
                    f"ambiguity 4); got {narrow}: lower algorithm.sub_feature_dim or widen the models")  # fmt: skip
        return None

    def shared_model_options(self, client_models: Mapping[str, nn.Module]) -> dict[str, Any]:
        return {"feature_dim": self._resolve_s(client_models)}  # (M7)

    # -- server ---------------------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        init_shared_state(server, SHARED_KEY, self.name)

    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        return Message({SHARED_KEY: server.state[SHARED_KEY]})  # (M1)

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        mean = mean_of_uploads(replies, SHARED_KEY, self.params.resolved()[1], self.name)  # (M5): head included
        if mean is not None:
            server.state[SHARED_KEY] = mean
        return {}

    # -- client ---------------------------------------------------------------------------------------------
    def _load(self, client: ClientContext, msg: Message) -> FusedPredictor:
        """The private model, the forked shared model (M1) and the projector, loaded into the reused workers."""
        private, shared = client.model, client.shared_model
        if shared is None:
            raise ValueError("fedmrl: the engine gave the client no shared model (Exchange.shared_model)")
        s, d = self._s, int(private.feature_dim)
        if s > d:
            raise ValueError(f"fedmrl: sub_feature_dim s = {s} exceeds the private feature width d = {d} (card ambiguity 4)")
        load_own_model(client)
        set_flat(shared, msg[SHARED_KEY])
        projector = self._projectors.get((s, d))
        if projector is None:
            projector = self._projectors[(s, d)] = nn.Linear(s + d, d).to(client.device)
        kept = client.state.get(PROJECTOR_KEY) if self.params.resolved()[0] else None
        set_flat(projector, kept if kept is not None else initial_projector(client, s, d))
        return FusedPredictor(private, shared, projector, s, self.params.eval_head)

    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        fused = self._load(client, msg)
        keep, weighting, clip = self.params.resolved()
        s = self._s

        def batch_loss(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with autocast_context(client.precision, client.device):
                m = fused.fused(x)  # (M2)
                z, u = fused.private.classifier(m), fused.shared.classifier(m[:, :s])
            loss = matryoshka_loss(z.float(), u.float(), y)
            return loss, loss

        # (M3): the private model, the projector and the shared model at the client's rate
        parts = [(fused.private, info.lr), (fused.projector, info.lr), (fused.shared, info.lr)]
        mean_loss = train_parts_jointly(client, parts, self.local, clip, batch_loss)
        keep_own_model(client)
        if keep:
            client.state[PROJECTOR_KEY] = get_flat(fused.projector)
        upload: dict[str, Any] = {SHARED_KEY: get_flat(fused.shared)}  # (M4)
        if weighting == "samples":
            upload[SAMPLES_KEY] = int(client.num_samples)
        return Message({**upload, **metric_items(mean_loss, client.num_samples)})

    # -- personalised evaluation (M6): private model and projector with the new global shared model ------------
    def assemble_personal_model(self, client: ClientContext, msg: Message) -> None:
        self._evaluated = (client.cid, self._load(client, msg))

    def personal_predictor(self, client: ClientContext) -> nn.Module:
        cid, predictor = getattr(self, "_evaluated", (None, None))
        if cid != client.cid or predictor is None:
            raise ValueError("fedmrl: personal_predictor before assemble_personal_model for this client")
        return predictor
