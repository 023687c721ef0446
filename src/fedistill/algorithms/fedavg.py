"""FedAvg (McMahan et al. 2017) and FedAvgM (Hsu et al. 2019). Card: spec/fedavg.md.

Clients run plain local SGD from the broadcast weights and return them with their sample count; the
server takes the sample-weighted mean (card §3). FedAvgM changes only the server: the pseudo-gradient
``w_g - w_agg`` goes through heavy-ball momentum (:class:`~fedistill.algorithms.aggregate.ServerMomentum`).
Other parameter-averaging methods reuse this class with other ingredients.

Whatever the aggregation rule and the server optimiser, the entries of the flat vector that are not
trainable parameters (BatchNorm running statistics, other float buffers) get the plain ``p_k``-weighted
mean of the clients' values: momentum, Adam steps, FedNova's extrapolation or FedDyn's correction act on
parameters only. A running variance pushed by a server step can turn negative, and its network then
outputs NaN. The rule is applied once, at the end of :meth:`FedAvg.aggregate`, which every
parameter-averaging method and every combination goes through.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Literal, Mapping

import torch
from pydantic import Field

from ..models.flat import get_flat, num_flat, set_flat, trainable_mask
from ..registry import ALGORITHMS
from .aggregate import ServerMomentum, ServerOptimizer, aggregation_weights, weighted_mean
from .base import Algorithm, AlgorithmParams, ClientContext, Message, RoundInfo, ServerContext
from .local import ExtraLoss, LocalResult, local_sgd


# Client-state key of the entries a private mask keeps on the client (FedAvg.private_mask).
PRIVATE_WEIGHTS = "private_weights"


class FedAvgParams(AlgorithmParams):
    weighting: Literal["samples", "uniform"] = Field("samples", description="aggregation weights p_k (card ambiguity 1)")
    grad_clip: float | None = Field(None, gt=0, description="clip the local gradient norm (FedFTG code uses 10)")


@ALGORITHMS.register("fedavg")
class FedAvg(Algorithm):
    """FedAvg: sample-weighted mean of locally trained weights."""

    name = "fedavg"
    Params = FedAvgParams
    resident_weights = True  # checked for run.resident_weights (protocol.Algorithm)
    needs_features = False  # extra_loss receives the penultimate features (MOON)
    # Traits that Composite checks (compose.py): the local loss has a proximal/quadratic term pulling the
    # weights toward an anchor (FedProx, FedDyn, FedCurv); the aggregation assumes the clients ran plain
    # momentum SGD on the CE alone (FedNova's normaliser a_k).
    adds_proximal_term = False
    assumes_plain_sgd = False

    def server_optimizer(self, server: ServerContext) -> ServerOptimizer:
        """Turns (old global, combined client weights) into the new global model (FedAvg: the latter)."""
        return ServerOptimizer()

    def combine(self, global_vec: torch.Tensor, replies: list[Message]) -> torch.Tensor:
        """The clients' weights combined into one vector (FedAvg: the p_k-weighted mean, card §3)."""
        weights = aggregation_weights([int(r["num_samples"]) for r in replies], self.params.weighting)
        return weighted_mean([r["weights"] for r in replies], weights)

    def adjust_combined(
        self, server: ServerContext, global_vec: torch.Tensor, combined: torch.Tensor, replies: list[Message]
    ) -> torch.Tensor:
        """A server-side correction of the combined vector before the optimiser (FedDyn's ``− h/α``)."""
        return combined

    def broadcast_extras(self, server: ServerContext, info: RoundInfo, cid: int) -> dict[str, Any]:
        """Fields sent with the weights (SCAFFOLD: the server control variate; FedCurv: the others' stats)."""
        return {}

    def refine(self, server: ServerContext, info: RoundInfo, replies: list[Message], cids: list[int]) -> dict[str, float]:
        """A server refiner: change ``server.model`` after aggregation, before :meth:`after_aggregate` (FedFTG's
        data-free fine-tuning); returns metrics. FedAvg: nothing."""
        return {}

    def after_aggregate(self, server: ServerContext, info: RoundInfo, replies: list[Message], cids: list[int]) -> dict[str, float]:
        """Server-state updates once the new global model is set (SCAFFOLD's c, FedCurv's stored stats)."""
        return {}

    def private_mask(self, model: torch.nn.Module) -> torch.Tensor | None:
        """True for the entries of the flat vector that never leave the client (MTFL's BatchNorm patches).

        None (FedAvg): everything is shared. With a mask, the broadcast and the replies carry the shared entries
        only, the server aggregates in that subspace, and each client keeps its private entries in its state
        (:data:`PRIVATE_WEIGHTS`), starting from the initial model's values.
        """
        return None

    def _private(self, model: torch.nn.Module) -> torch.Tensor | None:
        """:meth:`private_mask` of this architecture, computed once; None when nothing is private."""
        cached = getattr(self, "_private_cache", None)
        size = num_flat(model)
        if cached is None or cached[0] != size:
            mask = self.private_mask(model)
            self._private_cache = cached = (size, mask if mask is not None and bool(mask.any()) else None)
        return cached[1]

    def load_weights(self, client: ClientContext, shared: torch.Tensor) -> None:
        """Put the received weights into ``client.model``, with the client's own private entries where a
        private mask says so (the initial model's values until the client has trained once)."""
        mask = self._private(client.model)
        if mask is None:
            set_flat(client.model, shared)
            return
        full = torch.empty(mask.numel(), dtype=torch.float32)
        full[~mask] = shared
        private = client.state.get(PRIVATE_WEIGHTS)
        full[mask] = private if private is not None else client.initial_weights[mask]
        set_flat(client.model, full)

    def upload_weights(self, client: ClientContext) -> torch.Tensor:
        """The trained ``client.model`` as a reply vector: its shared entries; private ones go to the client state."""
        flat = get_flat(client.model)
        mask = self._private(client.model)
        if mask is None:
            return flat
        client.state[PRIVATE_WEIGHTS] = flat[mask].clone()
        return flat[~mask]

    def assemble_personal_model(self, client: ClientContext, msg: Message) -> None:
        """The global model, with the client's private entries where there are any (MTFL: (θ_{t+1}, P_k))."""
        self.load_weights(client, msg["weights"])

    # -- server ---------------------------------------------------------------------------------
    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        # The global model does not change within a round: flatten it once, send the same vector.
        if getattr(self, "_broadcast_round", None) != info.round:
            vec, private = get_flat(server.model), self._private(server.model)
            self._broadcast_round, self._broadcast_vec = info.round, vec if private is None else vec[~private]
        return Message(weights=self._broadcast_vec, **self.broadcast_extras(server, info, cid))

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        cids = sorted(replies)
        ordered = [replies[c] for c in cids]
        full = get_flat(server.model)
        private = self._private(server.model)
        # With private entries the whole server side works in the shared subspace; the private entries of the
        # server's model stay as they were (the initial values): no client's patch ever reaches it.
        global_vec = full if private is None else full[~private]
        combined = self.adjust_combined(server, global_vec, self.combine(global_vec, ordered), ordered)
        new_global = self.server_optimizer(server).step(server.state, global_vec, combined)
        new_global = self._average_statistics(server, new_global, ordered)
        if private is not None:
            full[~private] = new_global
            new_global = full
        set_flat(server.model, new_global)
        server.aggregate = new_global.detach().clone()  # ŵ, before the refiner's step (engine: server-step metrics)
        self._broadcast_round = None
        # A server refiner (FedFTG) changes the new global model before the base method's server state is
        # updated, so that state refers to the model actually broadcast (spec/fedftg.md ambiguity 13).
        metrics = self.refine(server, info, ordered, cids)
        return {**metrics, **self.after_aggregate(server, info, ordered, cids)}

    def _average_statistics(
        self, server: ServerContext, new_global: torch.Tensor, replies: list[Message]
    ) -> torch.Tensor:
        """``new_global`` with its non-trainable entries replaced by the plain weighted mean of the replies."""
        trainable = getattr(self, "_trainable", None)
        if trainable is None or trainable.numel() != new_global.numel():
            # Computed once: the mask depends on the model's architecture only (restricted to the shared entries).
            trainable = trainable_mask(server.model)
            private = self._private(server.model)
            trainable = self._trainable = trainable if private is None else trainable[~private]
            self._all_trainable = bool(trainable.all())
        if self._all_trainable:
            return new_global  # no buffers (MNIST CNN, MLP): nothing to do, the vector is unchanged
        # FedAvg's own mean over whole vectors, so where FedAvg's combine produced the vector the entries are
        # bit-identical to it (a mean over the selected entries alone may round differently).
        plain = FedAvg.combine(self, new_global, replies)
        return torch.where(trainable.to(new_global.device), new_global, plain)

    # -- client ---------------------------------------------------------------------------------
    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss | None:
        """A loss term added to the client's CE this round (None for FedAvg).

        Called after the broadcast weights ``msg["weights"]`` are loaded into ``client.model``, so a term
        can anchor on them. Methods that are FedAvg plus one local term (FedProx, ...) override only this.
        """
        return None

    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        self.load_weights(client, msg["weights"])
        result = local_sgd(
            client,
            lr=info.lr,
            epochs=self.local.epochs,
            batch_size=self.local.batch_size,
            momentum=self.local.momentum,
            weight_decay=self.local.weight_decay,
            extra_loss=self.extra_loss(client, msg),
            logit_transform=self.logit_transform(client),
            with_features=self.needs_features,
            before_step=self.grad_correction(client, msg),
            grad_clip=self.params.grad_clip,
            graph_key=self.graph_key(client, msg),  # after the hooks: it describes the closures they built
        )
        return self.reply(client, info, msg, result)

    def reply(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> Message:
        """The client's reply once its model is trained (``client.model`` holds the trained weights)."""
        return Message(
            weights=self.upload_weights(client),
            num_samples=client.num_samples,
            train_loss=result.mean_loss,
            **self.reply_extras(client, info, msg, result),
        )

    def cohort_reply(self, client: ClientContext, info: RoundInfo, msg: Message, *, steps: int, samples_seen: int, mean_loss: float | torch.Tensor) -> Message:
        """The reply of a client a cohort step trained (engine/executors.py ``CohortExecutor``; ``client.model``
        holds its trained weights): :meth:`reply` with the step counts the sequential loop would report."""
        return self.reply(client, info, msg, LocalResult(steps=steps, samples_seen=samples_seen, mean_loss=mean_loss))

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[Any, dict[str, torch.Tensor]] | None:
        """This round's client step for cohort training (engine/cohort.py, ``run.cohort``), called after the
        broadcast weights are loaded: ``(loss term or None, this client's fixed tensors)``, or None when the step
        cannot be batched, so that the client trains sequentially. FedAvg's plain step batches; a method that adds
        a loss term, logit transform or gradient correction, or a gradient clip, does not unless it says how
        (FedProx does)."""
        return (None, {}) if self.cohort_batches() else None

    def cohort_batches(self) -> bool:
        """Whether this method's client step, as configured, batches in a cohort: what :meth:`cohort_term` answers
        in every round, known before the first (``run.cohort=auto`` decides with it, engine/cohort_choice.py;
        tests/test_cohort.py checks the two agree for every method). FedAvg's plain step does, and a method that
        says how its step batches (overrides :meth:`cohort_term`); a gradient clip never does, nor a method that
        adds a loss term, logit transform, gradient correction or a step of its own without saying how."""
        if self.params.grad_clip is not None:
            return False
        if type(self).cohort_term is not FedAvg.cohort_term:
            return True
        hooks = ("extra_loss", "logit_transform", "grad_correction", "local_update")  # local_update: a step of its own
        return not self.needs_features and all(getattr(type(self), hook) is getattr(FedAvg, hook) for hook in hooks)

    def logit_transform(self, client: ClientContext) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A transform of the logits the client's CE sees (FedRS); None for FedAvg."""
        return None

    def grad_correction(self, client: ClientContext, msg: Message) -> Callable[[torch.nn.Module], None] | None:
        """A function applied to the gradients before every local step (SCAFFOLD); None for FedAvg."""
        return None

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        """Extra fields of the client's reply (FedNova: its local steps; SCAFFOLD: its control-variate change)."""
        return {}

    def graph_key(self, client: ClientContext, msg: Message) -> Hashable | None:
        """What this method's loss term, logit transform and gradient correction bake into a captured client
        step as Python values, or None when they cannot be captured (``run.cuda_graphs``, engine/cuda_graphs.py).

        A method may return a key only if its closures read every per-client tensor through ``client.fixed``
        (or from persistent modules loaded in place, as the teachers are) and make no host round-trip; the key
        holds the Python values that shape the closure (a structure flag, a per-client scalar): a client with
        another key captures anew. Here: ``()`` when the method adds none of the three (the plain step), None
        when it does and does not say more, so its step stays eager.
        """
        adds = [hook for hook in ("extra_loss", "logit_transform", "grad_correction") if getattr(type(self), hook) is not getattr(FedAvg, hook)]
        return None if adds else ()


class FedAvgMParams(FedAvgParams):
    server_momentum: float = Field(0.7, ge=0.0, lt=1.0, description="β_m (reference-repo default; card §5)")
    server_lr: float = Field(1.0, gt=0.0, description="η_s")


@ALGORITHMS.register("fedavgm")
class FedAvgM(FedAvg):
    """FedAvgM: FedAvg with heavy-ball server momentum on the pseudo-gradient."""

    name = "fedavgm"
    Params = FedAvgMParams
    resident_weights = True  # checked for run.resident_weights (protocol.Algorithm)

    def server_optimizer(self, server: ServerContext) -> ServerOptimizer:
        return ServerMomentum(self.params.server_momentum, self.params.server_lr)
