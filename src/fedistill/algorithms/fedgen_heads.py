"""FedGen in HtFLlib's heterogeneous form (``fedgen`` with ``variant: htfllib``; HtFLlib's ``FedGen``, servergen.py
and clientgen.py). Card: spec/fedgen.md §8.

The paper's FedGen (fedgen.py) averages whole models, so every client needs one architecture. HtFLlib's form lets
each client keep an extractor of its own and shares only what every member of a model group has in common, the head
Linear(d, C) over the group's feature dimension d, as LG-FedAvg does, plus a feature generator G(ε, y) the server
learns from the heads:

Client k, each round it is selected (H1-H3):

1. replaces its head by the broadcast global head (every round, the first included);
2. trains E epochs of SGD on ``CE(f_k(x), y) + α · CE(h_k(G(ε, ŷ)), ŷ)`` per batch, with ŷ drawn in proportion
   to the label counts the server broadcast and ε ~ U[0,1) (HtFLlib's draw), B_g of them per step; the generated
   features reach the head only (the generator is not trained on the client) and are made with the generator in
   train mode, batch statistics, as HtFLlib's clients use the module they load (ambiguity H-3). No term before the
   server has heard any counts (round 1, ambiguity H-1);
3. uploads its trained head, n_k and its label counts.

The server (H4-H5) keeps each client's last reported counts, then trains G for ``generator_steps`` steps of a fresh
Adam (``generator_lr``) on ``CE(Σ_k w_k h_k(G(ε, ŷ)), ŷ)``, w_k = n_k / Σ n_j over the round's uploads, ŷ drawn in
proportion to the summed counts of every client heard from; then averages the heads with the same w_k. Inference:
the client's own extractor with the new global head (personal model "assembled").

Bytes: up 4·(dC + C) + 8 + 8C; down 4·(dC + C), and from round 2 the generator (4·(its parameters and BN
statistics)) and 8C for the counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..engine.seeding import FEDGEN, FEDGEN_HEAD, make_generator
from ..errors import ConfigError
from ..losses import stacked_head_logits
from ..models.flat import get_flat, set_flat
from ..models.generators import FeatureGenerator, draw_noise
from ..protocol import Exchange, metric_items
from .base import Algorithm, ClientContext, Message, RoundInfo, ServerContext
from .hetero import SAMPLES_KEY, HtFLlibClientDefaults, global_head, load_own_model, mean_of_uploads, train_own_model
from .server_modules import PersistentModule, label_counts

HEAD_KEY = "fedgen_head"  # server state and broadcast: the global head Linear(d, C), flat (weight, then bias)
GENERATOR_KEY = "fedgen_generator"  # the feature generator, flat (parameters and BatchNorm statistics)
COUNTS_KEY = "fedgen_label_counts"  # server state: (K, C) int64, each client's last reported label counts
SUMMED_COUNTS_KEY = "fedgen_counts"  # broadcast: (C,) int64, the counts summed over the clients heard from
REPLY_COUNTS_KEY = "label_counts"

# The paper form's settings that have no counterpart here, with the value that means "absent": a run that sets
# another is refused, not silently ignored.
PAPER_ONLY: dict[str, tuple[Any, str]] = {
    "cls_weighting": ("per_sample", "per-label teacher weights ω (HtFLlib weights each head by n_k / Σ n_j)"),
    "generative_beta": (0.0, "a latent KL term (HtFLlib's clients add the generative CE alone)"),
    "eta_ens": (0.0, "a diversity term (HtFLlib's generator loss is the heads' CE alone)"),
}


def draw_labels(counts: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """n labels drawn with replacement in proportion to ``counts`` (HtFLlib's ``np.random.choice`` over its
    ``qualified_labels``, the list with each label repeated by its count)."""
    return torch.multinomial(counts.double(), n, replacement=True, generator=generator)


def ensemble_head_loss(
    features: torch.Tensor, labels: torch.Tensor, head_weights: torch.Tensor, head_biases: torch.Tensor, shares: torch.Tensor
) -> torch.Tensor:
    """The server's generator loss (card §8, H4): ``CE( Σ_k w_k (W_k z + b_k), y )`` over a batch of generated
    features z, heads ``(K, C, d)`` and ``(K, C)``, shares w ``(K,)`` summing to 1."""
    logits = stacked_head_logits(features, head_weights, head_biases)
    return F.cross_entropy((shares[:, None, None] * logits).sum(0), labels)


class FedGenHeads(HtFLlibClientDefaults, Algorithm):
    """FedGen, HtFLlib's heterogeneous form: a shared head and a server-learned feature generator."""

    name = "fedgen"
    exchange: ClassVar[Exchange] = Exchange(
        "shared sub-model", "the head Linear(d, C) and label counts (a feature generator comes down)", common_feature=True
    )
    personal_model: ClassVar[str] = "assembled"  # its own extractor with the new global head

    def __init__(self, params: Any, local: Any) -> None:
        refused = [key for key, (absent, _) in PAPER_ONLY.items() if getattr(params, key) != absent]
        if refused:
            raise ConfigError(
                f"fedgen variant htfllib has no {'; no '.join(PAPER_ONLY[k][1] for k in refused)}: set "
                f"{', '.join(f'algorithm.{k}={PAPER_ONLY[k][0]}' for k in refused)} or leave it unset, or use variant paper"
            )
        for key in ("generator_batch_size", "gen_batch_size"):
            if getattr(params, key) < 2:  # the generator runs in train mode here: BatchNorm needs two rows
                raise ConfigError(f"algorithm.{key}: fedgen variant htfllib draws its generated batches with the "
                                  "generator in train mode (batch statistics), which needs at least 2 rows; got 1")  # fmt: skip
        super().__init__(params, local)
        self._head = PersistentModule(HEAD_KEY, FEDGEN_HEAD, global_head("fedgen"))
        self._generator = PersistentModule(GENERATOR_KEY, FEDGEN, self._build_generator)
        self._client_generator: FeatureGenerator | None = None

    def _build_generator(self, server: Any) -> FeatureGenerator:
        if server.feature_dim <= 0:
            raise ValueError("fedgen: the server needs the clients' common feature dimension (ServerContext.feature_dim)")
        return FeatureGenerator(self.params.noise_dim, server.num_classes, server.feature_dim, self.params.hidden_dim)

    def coefficient(self, rnd: int) -> float:
        """α_t = max(floor, α₀ · decay^(t)) for engine round ``rnd`` (t = rnd − 1; HtFLlib: α = 1, no decay)."""
        p = self.params
        return max(p.coefficient_floor, p.generative_alpha * p.coefficient_decay ** (rnd - 1))

    # -- server ---------------------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        self._head.init_state(server)
        self._generator.init_state(server)
        if COUNTS_KEY not in server.state:
            server.state[COUNTS_KEY] = torch.zeros(server.num_clients, server.num_classes, dtype=torch.int64)

    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        items: dict[str, Any] = {HEAD_KEY: self._head.init_state(server)}  # (H1), the first round too
        summed = server.state[COUNTS_KEY].sum(0)
        if int(summed.sum()) > 0:  # from the round after the first reports (H-1)
            items[GENERATOR_KEY] = self._generator.init_state(server)
            items[SUMMED_COUNTS_KEY] = summed
        return Message(items)

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        p = self.params
        arrived = [cid for cid in sorted(replies) if HEAD_KEY in replies[cid]]
        if not arrived:
            return {}
        table = server.state[COUNTS_KEY]
        for cid in arrived:
            table[cid] = replies[cid][REPLY_COUNTS_KEY].to(torch.int64)
        metrics: dict[str, float] = {}
        if p.generator_steps > 0:  # (H4) on the heads as uploaded, before they are averaged (HtFLlib's order)
            metrics["fedgen_generator_loss"] = self._train_generator(server, info, [replies[c] for c in arrived])
        server.state[HEAD_KEY] = mean_of_uploads(replies, HEAD_KEY, "samples", self.name)  # (H5)
        return metrics

    def _train_generator(self, server: ServerContext, info: RoundInfo, uploads: list[Message]) -> float:
        p = self.params
        num_classes, device = server.num_classes, server.device
        heads = torch.stack([u[HEAD_KEY].float() for u in uploads]).to(device)
        head_weights = heads[:, : -num_classes].reshape(len(uploads), num_classes, -1)
        head_biases = heads[:, -num_classes:]
        samples = torch.tensor([float(u[SAMPLES_KEY]) for u in uploads], dtype=torch.float64)
        shares = (samples / samples.sum()).float().to(device)
        counts = server.state[COUNTS_KEY].sum(0)
        generator = self._generator.load(server)
        generator.train()
        optimizer = torch.optim.Adam(  # a fresh Adam every round (HtFLlib builds one in each train_generator call)
            generator.parameters(), lr=p.generator_lr * p.generator_lr_decay ** (info.round - 1),
            betas=(0.9, 0.999), weight_decay=p.generator_weight_decay,
        )  # fmt: skip
        rng = make_generator(server.seed, FEDGEN, info.round)
        total = torch.zeros((), device=device)  # summed on the device: no host wait per step
        for _ in range(p.generator_steps):
            labels = draw_labels(counts, p.generator_batch_size, rng).to(device)
            eps = draw_noise(p.generator_batch_size, p.noise_dim, p.noise, rng).to(device)
            loss = p.alpha_ens * ensemble_head_loss(generator(eps, labels), labels, head_weights, head_biases, shares)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
        self._generator.store(server, generator)
        return float(total) / p.generator_steps

    # -- client ---------------------------------------------------------------------------------------------
    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        p = self.params
        self.assemble_personal_model(client, msg)  # (H1): own extractor, the global head
        regulariser = None
        alpha = self.coefficient(info.round)
        if p.regularization and GENERATOR_KEY in msg and alpha > 0:
            generator = self._client_generator
            if generator is None:
                generator = FeatureGenerator(p.noise_dim, client.data.num_classes, int(client.model.feature_dim), p.hidden_dim)
                self._client_generator = generator = generator.to(client.device).requires_grad_(False)
            set_flat(generator, msg[GENERATOR_KEY])
            generator.train()  # batch statistics, as HtFLlib's clients use the generator they load (H-3)
            counts, rng, device = msg[SUMMED_COUNTS_KEY], client.generator, client.device

            def regulariser(model: Any, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, features: Any) -> torch.Tensor:
                labels = draw_labels(counts, p.gen_batch_size, rng).to(device)
                eps = draw_noise(p.gen_batch_size, p.noise_dim, p.noise, rng).to(device)
                with torch.no_grad():  # the generator is not trained here; its features reach the head only
                    generated = generator(eps, labels)
                return alpha * F.cross_entropy(model.classify(generated).float(), labels)  # (H2)

        result = train_own_model(client, info.lr, self.local, extra_loss=regulariser)
        counts = label_counts(client)
        if p.label_counts == "processed":
            counts = counts * self.local.epochs  # the loop visits each sample once per epoch
        upload = {HEAD_KEY: get_flat(client.model.classifier), SAMPLES_KEY: int(client.num_samples), REPLY_COUNTS_KEY: counts}
        return Message({**upload, **metric_items(result.mean_loss, client.num_samples)})  # (H3)

    # -- personalised evaluation: the own extractor with the new global head ----------------------------------
    def assemble_personal_model(self, client: ClientContext, msg: Message) -> None:
        load_own_model(client)
        if HEAD_KEY in msg:
            set_flat(client.model.classifier, msg[HEAD_KEY])
