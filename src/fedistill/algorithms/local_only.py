"""Local: every client trains alone, no federation (HtFLlib's ``Local``). Card: spec/local-alone.md.

The floor of every heterogeneous table. Client k keeps its own model θ_k (its own architecture: ``model.clients``,
``model.group``, or ``model.name`` for all) as a flat vector in its state, and each round it is selected runs E
epochs of mini-batch SGD on the mean cross-entropy of its own batches (card Eq. L1) with the run's ordinary
per-(seed, round, client) shuffled batches (card ambiguity 2). Nothing travels: the broadcast is empty and the
reply holds only the training loss as an uncounted metric report, so both byte counts are 0 (card §4). Accuracy is
personal: θ_k on client k's own test split right after its update (the clients of the round; with every client
selected, as in the protocol, all of them).

Defaults are HtFLlib's pre-tuned client settings (:data:`~fedistill.algorithms.hetero.HTFLLIB_DEFAULTS`: plain SGD,
lr 0.01, batch 10, one epoch), filled only where the user left them unset.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..protocol import Exchange, metric_items
from ..registry import ALGORITHMS
from .base import Algorithm, AlgorithmParams, ClientContext, Message, RoundInfo, ServerContext
from .hetero import HtFLlibClientDefaults, load_own_model, train_own_model


class LocalOnlyParams(AlgorithmParams):
    """No parameter of its own (card §5): the run's ``local`` settings are the whole method."""


@ALGORITHMS.register("local_only")
class LocalOnly(HtFLlibClientDefaults, Algorithm):
    """Local: every client trains its own model alone and nothing travels (HtFLlib's Local)."""

    name = "local_only"
    Params = LocalOnlyParams
    exchange: ClassVar[Exchange] = Exchange("nothing")
    personal_model: ClassVar[str] = "local"  # θ_k after its update, on its own test split


    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        return Message()  # 0 bytes down (card §4)

    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        load_own_model(client)
        result = train_own_model(client, info.lr, self.local)
        return Message(metric_items(result.mean_loss, client.num_samples))  # 0 bytes up: a report, not traffic

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        return {}  # nothing to aggregate
