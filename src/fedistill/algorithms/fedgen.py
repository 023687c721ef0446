"""FedGen (Zhu, Hong & Zhou, ICML 2021): a server-learned feature generator regularises the clients.
Card: spec/fedgen.md.

Every classifier of the zoo splits into ``extract`` (features) and its last linear layer ``classifier``, the
head h (card §3). After aggregation the server trains a small conditional generator
``G(ε, y) = Linear → BN1d → ReLU → Linear`` (:class:`~fedistill.models.generators.FeatureGenerator`) so that
the round's uploaded heads, each weighted per label by how much of that label its client processed
(``ω_{y,k}``), classify ``G(ε, y)`` as y, plus a diversity term (card §3, ``TrainGenerator``). The generator
is broadcast every round with the model (its parameters and BN running statistics as one flat tensor, so it
counts in the bytes) together with ``α_t`` and ``β_t``. From the card's round t ≥ 1 the client adds two
terms to its CE: its head must classify generated features of uniformly drawn labels, and its predictions on
real inputs are pulled toward what its own head says about generated features of the same labels. The global
model itself is FedAvg's: nothing is distilled into it on the server.

Round indexing: the engine's rounds are 1-based and the card's t is 0-based, so engine round r is the card's
t = r − 1. Round 1 (t = 0) is CE only: a FedGen client update equals FedAvg's bit for bit there.

Label counts: a client reports, in FedFTG's ``label_counts`` reply field (M int64), the labels of the samples
it processed this round (``label_counts="processed"``, the official code's counting, card ambiguity 2): the
local loop visits every sample once per epoch, so that is ``E · n_k^y``. The server adds the code's prior of
1 to every count: ``c_k^y = 1 + label_counts``.

Server state (tensors only, so a checkpoint loads with ``weights_only=True`` and a resumed run is exact):
``fedgen_generator`` (flat float32: parameters and BN running statistics), and the persistent Adam's moments
``fedgen_adam_exp_avg``, ``fedgen_adam_exp_avg_sq`` (flat over the parameters) and ``fedgen_adam_step``. The
ExponentialLR(0.98) schedule is a function of the round (``lr_t = lr_0 · 0.98^t``), so it needs no state.
Randomness: the server's labels and noise come from ``make_generator(seed, FEDGEN, round)``, the generator's
initial weights from ``derive_seed(seed, FEDGEN, 0)``; a client's generated samples use its own round stream.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from ..engine.seeding import FEDGEN, make_generator
from ..errors import ConfigError
from ..losses import (
    class_ensemble_weights,
    diversity_loss,
    fedgen_client_regulariser,
    fedgen_teacher_loss,
    qualified_labels,
    stacked_head_logits,
)
from ..models.flat import float_state, set_flat
from ..models.generators import FeatureGenerator, draw_noise
from ..registry import ALGORITHMS
from .base import ClientContext, Message, RoundInfo, ServerContext
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss, LocalResult, autocast_context, fused
from .server_modules import PersistentModule, label_counts

GENERATOR_KEY = "fedgen_generator"
ADAM_KEYS = ("fedgen_adam_exp_avg", "fedgen_adam_exp_avg_sq", "fedgen_adam_step")


class FedGenParams(FedAvgParams):
    variant: Literal["paper", "htfllib"] = Field(
        "paper",
        description="paper: whole models averaged, one architecture (the paper's and its code's); htfllib: HtFLlib's "
        "heterogeneous form, own extractors, a shared head and the generator (card §8; its defaults are HtFLlib's)",
    )
    # generator (card §5, MNIST config; the feature size L is the model's, the head's input size)
    noise_dim: int = Field(32, ge=1, description="d, noise size (MNIST/EMNIST 32, CIFAR 64)")
    hidden_dim: int = Field(256, ge=1, description="H, hidden width (MNIST/EMNIST 256, CIFAR 512)")
    noise: Literal["gaussian", "uniform"] = Field(
        "gaussian", description="ε ~ N(0, I) (paper), or U[0,1) as the official code draws it (card ambiguity 1)"
    )
    # server: TrainGenerator
    generator_steps: int = Field(50, ge=0, description="generator Adam steps per round (0 = no generator training)")
    generator_batch_size: int = Field(32, ge=1, description="B of the server's generator steps")
    generator_lr: float = Field(3e-4, gt=0.0, description="ensemble_lr (MNIST 3e-4; EMNIST 1e-4)")
    generator_weight_decay: float = Field(1e-2, ge=0.0, description="Adam weight decay of the generator")
    generator_lr_decay: float = Field(0.98, gt=0.0, le=1.0, description="ExponentialLR γ, one step per round")
    alpha_ens: float = Field(1.0, ge=0.0, description="α_ens, weight of the heads' weighted CE")
    eta_ens: float = Field(1.0, ge=0.0, description="η_ens, weight of the diversity loss")
    cls_weighting: Literal["per_sample", "batch_scalar"] = Field(
        "per_sample", description="ω per sample, or the code's mean(CE)·mean(ω) per client (card ambiguity 3)"
    )
    # clients
    regularization: bool = Field(True, description="False: plain CE at every round (the card's t = 0 behaviour)")
    generative_alpha: float = Field(10.0, ge=0.0, description="α₀, weight of the generative CE (EMNIST: 10)")
    generative_beta: float = Field(10.0, ge=0.0, description="β₀, weight of the latent KL (EMNIST: 1)")
    coefficient_decay: float = Field(0.98, gt=0.0, le=1.0, description="α_t = max(floor, α₀ · decay^t), same for β")
    coefficient_floor: float = Field(1e-4, ge=0.0, description="lower bound of α_t and β_t")
    gen_batch_size: int = Field(32, ge=1, description="B_g, generated samples of the generative CE per step")
    label_counts: Literal["processed", "dataset"] = Field(
        "processed", description="c_k from the samples processed this round (code), or from n_k (card ambiguity 2)"
    )


def htfllib_defaults(tree: dict[str, Any]) -> dict[str, Any]:
    """``variant: htfllib``'s defaults (spec/fedgen.md §8): HtFLlib's client settings (SGD 0.01, batch 10, one epoch,
    per-client test splits) and the flags of its pre-tuned ``total.sh`` FedGen line (``-nd 32 -glr 0.1 -hd 512 -se
    100``), the generator's batches the client batch size (``self.batch_size`` on both sides), U[0,1) noise, a
    fresh Adam without decay, the generative CE at weight 1 and no latent KL, counts from the datasets."""
    from .hetero import HTFLLIB_DEFAULTS

    local = tree.get("local") if isinstance(tree.get("local"), dict) else {}
    batch = local.get("batch_size", HTFLLIB_DEFAULTS["local"]["batch_size"])
    algorithm = {
        "noise_dim": 32, "hidden_dim": 512, "noise": "uniform", "generator_steps": 100, "generator_batch_size": batch,
        "generator_lr": 0.1, "generator_weight_decay": 0.0, "generator_lr_decay": 1.0, "eta_ens": 0.0,
        "generative_alpha": 1.0, "generative_beta": 0.0, "coefficient_decay": 1.0, "gen_batch_size": batch,
        "label_counts": "dataset",
    }  # fmt: skip
    return {**copy.deepcopy(HTFLLIB_DEFAULTS), "algorithm": algorithm}


def head_slices(model: nn.Module) -> tuple[slice, slice]:
    """Where ``model.classifier.weight`` and ``.bias`` sit in the model's flat vector (models/flat.py order)."""
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Linear) or head.bias is None:
        raise ConfigError("fedgen needs a model whose last layer `classifier` is a Linear layer with a bias")
    found: dict[int, slice] = {}
    offset = 0
    for t in float_state(model):
        if t is head.weight or t is head.bias:
            found[id(t)] = slice(offset, offset + t.numel())
        offset += t.numel()
    return found[id(head.weight)], found[id(head.bias)]


@ALGORITHMS.register("fedgen")
class FedGen(FedAvg):
    """FedGen: clients regularised by a generator the server learns from their heads (htfllib variant: a shared head).

    The paper's form is FedAvg with the generator; ``variant: htfllib`` builds HtFLlib's heterogeneous form instead
    (fedgen_heads.py: clients keep their own extractors and share the head)."""

    name = "fedgen"
    Params = FedGenParams

    def __new__(cls, params: FedGenParams | None = None, local: Any = None) -> Any:
        """``variant: htfllib`` builds HtFLlib's heterogeneous form instead (fedgen_heads.py), a method of its own
        that shares no code path with this one but the generator and the noise."""
        if cls is FedGen and params is not None and params.variant == "htfllib":
            from .fedgen_heads import FedGenHeads

            return FedGenHeads(params, local)
        return super().__new__(cls)

    @classmethod
    def config_defaults(cls, tree: dict[str, Any]) -> dict[str, Any]:
        """Plain SGD on the clients (spec/fedgen.md §5, the code's pFedIBOptimizer): with the run's default
        momentum 0.9 and α₀ = β₀ = 10 the regularised clients collapse to chance from round 2 (benchmarks/
        RESULTS.md, DaFKD's reduced Table 1; the 2-round bench sizing on MNIST: 9.99 %). A run that sets
        local.momentum keeps it. ``variant: htfllib``: HtFLlib's client defaults and its pre-tuned FedGen flags
        (card §8)."""
        section = tree.get("algorithm")
        if isinstance(section, dict) and section.get("variant") == "htfllib":
            return htfllib_defaults(tree)
        return {"local": {"momentum": 0.0}}

    def __init__(self, params: FedGenParams, local: Any) -> None:
        super().__init__(params, local)
        self._generator = PersistentModule(
            GENERATOR_KEY, FEDGEN, lambda server: self.build_feature_generator(server.model, server.num_classes)
        )
        self._client_generator: FeatureGenerator | None = None
        self._heads: tuple[slice, slice] | None = None

    # -- shared ---------------------------------------------------------------------------------
    def coefficients(self, rnd: int) -> tuple[float, float]:
        """``(α_t, β_t)`` for engine round ``rnd`` (card t = rnd − 1): ``max(floor, x₀ · decay^t)``."""
        p = self.params
        decay = p.coefficient_decay ** (rnd - 1)
        return max(p.coefficient_floor, p.generative_alpha * decay), max(p.coefficient_floor, p.generative_beta * decay)

    def build_feature_generator(self, model: nn.Module, num_classes: int) -> FeatureGenerator:
        head = getattr(model, "classifier", None)
        if not isinstance(head, nn.Linear):
            raise ConfigError("fedgen needs a model whose last layer `classifier` is a Linear layer")
        return FeatureGenerator(self.params.noise_dim, num_classes, head.in_features, self.params.hidden_dim)

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        self._initial_state(server)

    def _initial_state(self, server: ServerContext) -> None:
        """w⁰ from its own seeded stream (server_modules.PersistentModule) and an Adam that has not stepped yet."""
        size = sum(q.numel() for q in self._generator.initial(server).parameters())
        self._generator.init_state(server)
        server.state[ADAM_KEYS[0]] = torch.zeros(size)
        server.state[ADAM_KEYS[1]] = torch.zeros(size)
        server.state[ADAM_KEYS[2]] = torch.zeros((), dtype=torch.float64)

    def broadcast_extras(self, server: ServerContext, info: RoundInfo, cid: int) -> dict[str, Any]:
        if GENERATOR_KEY not in server.state:
            self._initial_state(server)
        alpha, beta = self.coefficients(info.round)
        # Every round, round 1 included (card §2): the generator is part of the download.
        return {"generator": server.state[GENERATOR_KEY], "generative_alpha": alpha, "generative_beta": beta}

    def refine(self, server: ServerContext, info: RoundInfo, replies: list[Message], cids: list[int]) -> dict[str, float]:
        """TrainGenerator on the round's uploads (card §4). The global model is not touched (β_ens = 0)."""
        p = self.params
        if p.generator_steps == 0:
            return {}
        started = time.perf_counter()
        if GENERATOR_KEY not in server.state:
            self._initial_state(server)
        counts = 1.0 + torch.stack([r["label_counts"].double() for r in replies])  # c_k^y ≥ 1 (K, M)
        qualified = qualified_labels(counts)
        if not bool(qualified.any()):
            return {}  # nobody processed a sample: no label to learn
        device = server.device
        weights = class_ensemble_weights(counts).to(device)  # ω_{y,k}, columns sum to 1
        w_slice, b_slice = self._heads or head_slices(server.model)
        self._heads = (w_slice, b_slice)
        num_classes = server.num_classes
        # The heads θ_k^p only, copied out of the uploads (which stay as sent): (K, M, L) and (K, M).
        head_w = torch.stack([r["weights"][w_slice] for r in replies]).to(device).view(len(replies), num_classes, -1)
        head_b = torch.stack([r["weights"][b_slice] for r in replies]).to(device)

        generator = self._generator.load(server)
        generator.train()
        params = list(generator.parameters())
        optimizer = torch.optim.Adam(
            params,
            lr=p.generator_lr * p.generator_lr_decay ** (info.round - 1),  # ExponentialLR stepped once per round
            betas=(0.9, 0.999),
            weight_decay=p.generator_weight_decay,
            **fused(device),
        )
        self._load_adam(server, optimizer, params)
        rng = make_generator(server.seed, FEDGEN, info.round)
        labels_q = torch.nonzero(qualified).flatten()
        teacher_sum = torch.zeros((), device=device)
        diversity_sum = torch.zeros((), device=device)
        for _ in range(p.generator_steps):
            y = labels_q[torch.randint(labels_q.numel(), (p.generator_batch_size,), generator=rng)].to(device)
            eps = draw_noise(p.generator_batch_size, p.noise_dim, p.noise, rng).to(device)
            with autocast_context(server.precision, device):
                features = generator(eps, y)
            # Every head at once: (K, B, M) logits of the frozen heads on the generated features.
            logits = stacked_head_logits(features.float(), head_w, head_b)
            teacher = fedgen_teacher_loss(logits, y, weights, p.cls_weighting)
            diversity = diversity_loss(features, eps)
            loss = p.alpha_ens * teacher + p.eta_ens * diversity
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            teacher_sum += teacher.detach()
            diversity_sum += diversity.detach()
        self._generator.store(server, generator)
        self._store_adam(server, optimizer, params)
        return {
            "fedgen_teacher_loss": float(teacher_sum) / p.generator_steps,
            "fedgen_diversity": float(diversity_sum) / p.generator_steps,
            "fedgen_refine_seconds": time.perf_counter() - started,
        }

    @staticmethod
    def _load_adam(server: ServerContext, optimizer: torch.optim.Adam, params: list[nn.Parameter]) -> None:
        """The persistent Adam state from its flat tensors (a state with step 0 is a fresh Adam's)."""
        step = server.state[ADAM_KEYS[2]]
        if float(step) == 0:
            return
        sizes = [q.numel() for q in params]
        avg = server.state[ADAM_KEYS[0]].split(sizes)
        avg_sq = server.state[ADAM_KEYS[1]].split(sizes)
        state = {
            i: {"step": step.float().clone(), "exp_avg": a.view_as(q).clone(), "exp_avg_sq": s.view_as(q).clone()}
            for i, (q, a, s) in enumerate(zip(params, avg, avg_sq))
        }
        saved = optimizer.state_dict()
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})

    @staticmethod
    def _store_adam(server: ServerContext, optimizer: torch.optim.Adam, params: list[nn.Parameter]) -> None:
        states = [optimizer.state[q] for q in params]
        server.state[ADAM_KEYS[0]] = torch.cat([s["exp_avg"].detach().reshape(-1).float().cpu() for s in states])
        server.state[ADAM_KEYS[1]] = torch.cat([s["exp_avg_sq"].detach().reshape(-1).float().cpu() for s in states])
        server.state[ADAM_KEYS[2]] = torch.as_tensor(float(states[0]["step"]), dtype=torch.float64)

    # -- client ---------------------------------------------------------------------------------
    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss | None:
        if not self.params.regularization or client.round <= 1:
            return None  # card t = 0: CE only (FedAvg's update, bit for bit)
        p = self.params
        generator = self._client_generator
        if generator is None:
            generator = self.build_feature_generator(client.model, client.data.num_classes).to(client.device)
            self._client_generator = generator.requires_grad_(False)
        set_flat(generator, msg["generator"])
        generator.eval()  # the server's BN running statistics (card ambiguity 7)
        alpha, beta = float(msg["generative_alpha"]), float(msg["generative_beta"])
        ratio = p.gen_batch_size / self.local.batch_size  # B_g / B (official gen_ratio)
        num_classes = client.data.num_classes
        rng, device = client.generator, client.device
        drawn: dict[str, torch.Tensor] = {}

        def prepare_step(m: int) -> None:
            # The step's noise and labels, drawn on the host from the client's stream before the step (local_sgd's
            # prepare hook) in the order the step used to draw them; through client.fixed, so that a captured
            # step reads each step's draws (one buffer set per batch size: a partial batch has its own graph).
            drawn[f"eps.{m}"] = client.fixed(f"fedgen.eps.{m}", draw_noise(m, p.noise_dim, p.noise, rng).to(device))
            drawn["sampled"] = client.fixed("fedgen.sampled", torch.randint(num_classes, (p.gen_batch_size,), generator=rng).to(device))
            drawn["eps_g"] = client.fixed("fedgen.eps_g", draw_noise(p.gen_batch_size, p.noise_dim, p.noise, rng).to(device))

        def regulariser(model, x, y, logits, features):
            with torch.no_grad():  # the generator is not trained on the client
                latent_features = generator(drawn[f"eps.{y.shape[0]}"], y)  # the real batch's labels: the KL's target
                generated_features = generator(drawn["eps_g"], drawn["sampled"])
                latent_logits = model.classify(latent_features)  # the client's current head, a target only
            generated_logits = model.classify(generated_features)  # gradient reaches the head only
            return fedgen_client_regulariser(logits, latent_logits, generated_logits, drawn["sampled"], alpha, beta, ratio)

        regulariser.prepare_step = prepare_step
        return regulariser

    def graph_key(self, client: ClientContext, msg: Message) -> tuple:
        # The generator is one module loaded in place, the draws go through client.fixed; α_t and β_t are this
        # round's Python numbers (the term is absent in round 1: the plain step).
        if not self.params.regularization or client.round <= 1:
            return ()
        return (float(msg["generative_alpha"]), float(msg["generative_beta"]))

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        counts = label_counts(client)
        if self.params.label_counts == "processed":
            # The loop visits each sample once per epoch (algorithms/local.py), so the processed labels are E·n_k.
            counts = counts * self.local.epochs
            if int(counts.sum()) != result.samples_seen:
                raise RuntimeError("fedgen: the local loop did not process every sample once per epoch")
        return {"label_counts": counts}
