"""pFedMe (Dinh, Tran, Nguyen, NeurIPS 2020). Card: spec/fmtl-baselines.md §3 (protocol §0).

Personalisation through Moreau envelopes. Client k's personalised model is the proximal point

    θ̂_k(w) = argmin_θ { f_k(θ) + (λ/2)‖θ − w‖² }                 (the paper's inner problem, Eq. 7)

of a local copy w of the global model; w then moves toward θ (the paper's local update, Eq. 8) and the
server averages the w's (Alg. 1). Per round t, client k (card §3):

    w_{k,0} = w_t ; θ ← w_t                          θ persists across the inner loop
    for j = 0..J−1   (J mini-batches: every batch of every local epoch, E·⌈n_k/B⌉)
        draw mini-batch D_j
        repeat K times:  θ ← θ − η_p·( ∇f_k(θ; D_j) + λ(θ − w_{k,j}) + μ_wd·θ )
        w_{k,j+1} = w_{k,j} − η·λ·(w_{k,j} − θ)
    upload w_{k,J};  keep θ_k := θ                   (the personalised model)
    server: w_{t+1} = (1 − β)·w_t + β·Σ_k p_k w_{k,J}

η is the round's client lr (``local.lr`` with its decay, RoundInfo.lr), μ_wd is ``local.weight_decay``,
λ, η_p, K and β are this method's parameters. Each client evaluates exactly J·K gradients per round.

Resolutions of what the card and the paper leave open (card §3 "Ambiguities", and ours):

- The personalised model is θ_k (``personal_model = "local"``): ``local_update`` leaves θ in ``client.model``,
  where the engine evaluates it on the client's test split right after the update.
- θ starts every round from w_t: it is not kept between rounds (card: ``θ ← w_t``).
- BatchNorm running statistics belong to θ: the model is in train mode during the inner loop, so each of the
  K forward passes per batch updates them. The uploaded vector holds w_{k,J} in its trainable entries and
  **θ's running statistics at the end of the round** in its other entries (w has no statistics of its own);
  the server averages those plainly, as :class:`~fedistill.algorithms.fedavg.FedAvg` does for every server
  optimiser. So with BatchNorm, β (and the β = 0 invariant) acts on the trainable parameters only.
- ``train_loss`` is the cross-entropy alone (no proximal or weight-decay term), averaged over all J·K
  gradient evaluations, each weighted by its batch size.
- ``grad_clip`` (FedAvg's setting) clips the cross-entropy gradient before the proximal and weight-decay
  terms are added, the order in which local SGD clips before the optimizer adds weight decay.
- A parameter the forward pass does not reach has a zero CE gradient; its proximal and weight-decay terms
  still apply (plain SGD would skip it altogether).
- Local momentum is refused: the card's inner solver and w-update are momentum-free (protocol §0).

pFedMe replaces FedAvg's local loop, so it cannot be combined with other methods (``algorithm.plus``
refuses a part that replaces ``local_update``, compose.py); the server side is FedAvg's with the β-mixing
server optimiser :class:`ServerMixing`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from ..errors import ConfigError
from ..models.flat import float_state, set_flat, trainable_parameters
from ..registry import ALGORITHMS
from .aggregate import ServerOptimizer
from .base import ClientContext, Message, RoundInfo, ServerContext
from .fedavg import FedAvg, FedAvgParams
from .local import LocalResult, autocast_context


class PFedMeParams(FedAvgParams):
    lam: float = Field(
        15.0,
        ge=0.0,
        description="λ, weight of the proximal term (λ/2)‖θ − w‖² (spec/fmtl-baselines.md §3: 15, FedICT = pFedMe's "
        "MNIST setting)",
    )
    personal_lr: float = Field(
        0.09,
        ge=0.0,
        description="η_p, step size of the K inner steps on θ (spec/fmtl-baselines.md §3: 0.09, pFedMe code default)",
    )
    inner_steps: int = Field(
        5, ge=1, description="K, inner steps on θ per mini-batch (spec/fmtl-baselines.md §3: 5, pFedMe code default)"
    )
    beta: float = Field(
        1.0,
        ge=0.0,
        description="β, server mixing w_{t+1} = (1 − β)·w_t + β·Σ_k p_k w_k (spec/fmtl-baselines.md §3: 1 = plain "
        "weighted averaging; pFedMe's paper also studies β > 1)",
    )


class ServerMixing(ServerOptimizer):
    """pFedMe's server step (card §3): ``w_{t+1} = (1 − β)·w_t + β·aggregate``.

    Computed in float64 from the float32 vectors, so β = 1 returns the aggregate and β = 0 the old global
    vector bit for bit (``0·x`` and ``1·x`` are exact, and so is adding a zero). It keeps no state.
    """

    def __init__(self, beta: float) -> None:
        self.beta = float(beta)

    def step(self, state: dict[str, Any], global_vec: torch.Tensor, aggregate: torch.Tensor) -> torch.Tensor:
        mixed = global_vec.double() * (1.0 - self.beta) + aggregate.double() * self.beta
        return mixed.float()


@ALGORITHMS.register("pfedme")
class PFedMe(FedAvg):
    """pFedMe: clients solve a proximal (Moreau-envelope) problem for θ_k, the server averages their w_k."""
    @classmethod
    def config_defaults(cls, tree: dict[str, Any]) -> dict[str, Any]:
        """Momentum-free inner steps and w-update (protocol §0): the run's default momentum 0.9 would be refused."""
        return {"local": {"momentum": 0.0}}

    name = "pfedme"
    Params = PFedMeParams
    personal_model = "local"  # θ_k, left in client.model by local_update (card §3 "UA model")

    def __init__(self, params: PFedMeParams, local: Any) -> None:
        super().__init__(params, local)
        if local.momentum != 0.0:
            # The card's inner solver and w-update are plain gradient steps (protocol §0: momentum-free SGD);
            # silently dropping the configured momentum would run something other than what was asked for.
            raise ConfigError(
                f"local.momentum: pfedme runs momentum-free inner steps (spec/fmtl-baselines.md §0, §3), got "
                f"{local.momentum}; set local.momentum: 0"
            )

    def server_optimizer(self, server: ServerContext) -> ServerOptimizer:
        return ServerMixing(self.params.beta)

    def step_sizes(self) -> dict[str, float]:
        """η_p: each inner step contracts θ − θ* only while η_p·(λ + curvature) < 2 (with λ = 15 and η_p = 0.09,
        curvature above 7.2 already diverges), so a diverging pFedMe usually needs a smaller personal_lr."""
        return {"algorithm.personal_lr": self.params.personal_lr}

    # -- client ---------------------------------------------------------------------------------
    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        p = self.params
        model = client.model
        set_flat(model, msg["weights"])  # θ ← w_t (parameters and BatchNorm statistics)
        model.train()  # BN statistics of θ follow the inner loop (card §3 ambiguity)
        theta = trainable_parameters(model)  # θ lives in the model: the forward passes use it directly
        # w_{k,j}: a separate copy of the trainable parameters, in the parameters' own (fp32 master) dtype.
        w = [t.detach().clone() for t in theta]
        # θ − w (or w − θ), rebuilt in place at every use: the only scratch memory of the loop.
        gap = [torch.empty_like(t) for t in theta]
        lam, eta_p, mu_wd, eta = p.lam, p.personal_lr, self.local.weight_decay, info.lr

        loss_sum = torch.zeros((), dtype=torch.float64, device=client.device)
        evaluations = seen = 0
        for _ in range(self.local.epochs):
            for x, y in client.data.epoch_batches(client.train_indices, self.local.batch_size, client.generator):
                for _ in range(p.inner_steps):
                    with autocast_context(client.precision, client.device):
                        loss = F.cross_entropy(model(x).float(), y)
                    for t in theta:
                        t.grad = None
                    loss.backward()
                    if p.grad_clip is not None:  # the CE gradient alone, as local SGD clips before weight decay
                        torch.nn.utils.clip_grad_norm_(theta, p.grad_clip)
                    self._inner_step(theta, w, gap, lam, eta_p, mu_wd)
                    # On-device accumulation; one .item() at the end (no sync per step).
                    loss_sum += loss.detach().double() * y.shape[0]
                    evaluations += 1
                    seen += int(y.shape[0])
                with torch.no_grad():
                    # w_{k,j+1} = w_{k,j} − η·λ·(w_{k,j} − θ)   (paper Eq. 8: w moves toward the new θ)
                    if lam != 0.0 and eta != 0.0:
                        torch._foreach_copy_(gap, w)
                        torch._foreach_sub_(gap, theta)
                        torch._foreach_add_(w, gap, alpha=-eta * lam)
        for t in theta:
            t.grad = None  # no stale gradient left on the reused worker module

        result = LocalResult(
            steps=evaluations,  # θ steps, one per gradient evaluation (J·K)
            samples_seen=seen,
            mean_loss=float(loss_sum / seen) if seen else float("nan"),
        )
        return Message(
            weights=self._upload(model, theta, w),
            num_samples=client.num_samples,
            train_loss=result.mean_loss,
            **self.reply_extras(client, info, msg, result),
        )

    @staticmethod
    @torch.no_grad()
    def _inner_step(
        theta: list[torch.Tensor], w: list[torch.Tensor], gap: list[torch.Tensor], lam: float, eta_p: float, mu_wd: float
    ) -> None:
        """θ ← θ − η_p·(∇f + λ(θ − w) + μ_wd·θ), in place, through the gradients autograd just allocated."""
        for t in theta:
            if t.grad is None:  # not reached by the forward pass: zero CE gradient (module docstring)
                t.grad = torch.zeros_like(t)
        grads = [t.grad for t in theta]
        # Weight decay first, then the step, in the order SGD applies them: with λ = 0 the path is SGD's.
        if mu_wd != 0.0:
            torch._foreach_add_(grads, theta, alpha=mu_wd)
        if lam != 0.0:
            # λ(θ − w) from the difference, not λθ − λw: the latter cancels badly when λ is large.
            torch._foreach_copy_(gap, theta)
            torch._foreach_sub_(gap, w)
            torch._foreach_add_(grads, gap, alpha=lam)
        torch._foreach_add_(theta, grads, alpha=-eta_p)

    @staticmethod
    @torch.no_grad()
    def _upload(model: torch.nn.Module, theta: list[torch.Tensor], w: list[torch.Tensor]) -> torch.Tensor:
        """The flat vector in ``get_flat``'s layout: w_{k,J} for the trainable parameters, θ's values (BatchNorm
        running statistics) elsewhere. Matched by tensor identity, so it does not rely on state_dict and
        parameters() listing the tensors in the same order."""
        local_copy = {id(t): wt for t, wt in zip(theta, w)}
        pieces = [local_copy.get(id(t), t).detach().reshape(-1).float().cpu() for t in float_state(model)]
        return torch.cat(pieces)
