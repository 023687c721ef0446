"""Combining parameter-averaging methods from the configuration (DESIGN.md, "composition").

Every FedAvg-family method is FedAvg plus ingredients (:class:`~fedistill.algorithms.fedavg.FedAvg`'s hooks):
a client loss term, a logit transform, a gradient correction, reply and broadcast fields, an aggregation
rule, a correction of the aggregate, a server optimiser and server-state updates. The papers combine them
(FedLMD+Prox+AvgM in FedLMD Table 5, SCAFFOLD+FedFTG, FedDyn+FedFTG), so a configuration may too::

    algorithm:
      name: fedntd          # the base method
      beta: 1.0             # its parameters
      plus:                 # methods whose ingredients are added, each with its own parameters
        fedprox: {mu: 0.01}
        fedavgm: {server_momentum: 0.9}

:class:`Composite` calls every part's hooks: loss terms are summed, logit transforms and gradient
corrections are chained in the listed order, reply and broadcast fields are merged, server refiners
(FedFTG) run in the listed order, server-state updates all run. An aggregation rule (FedNova) and a server
optimiser (FedAvgM, FedAdam) can each come from one part only; two parts that both define one are refused,
since there is no single meaning for "both".

Settings every part has (FedAvg's ``weighting`` and ``grad_clip``) take one value for the whole combination,
resolved per setting in this order, and then written into every part's parameters (and the composite's own),
so the aggregation rule, the local training and every other hook use the same value:

1. the value the user set explicitly on any part (on the base or under ``plus``); parts that set it must
   agree, else the configuration is refused;
2. if nobody set it, the value of a part whose own default differs from FedAvg's (FedDyn's card chose
   ``weighting: uniform``, so FedDyn added to any method brings its uniform mean); two such parts with
   different defaults are refused;
3. else FedAvg's default.

FedNova's normaliser ``a_k`` counts plain (momentum) SGD steps; with a proximal or quadratic local term
(FedProx, FedDyn, FedCurv) each step also contracts toward an anchor and the normaliser is a different one
(Wang et al. 2020: ``a = [1 − (1 − ημ)^τ]/(ημ)`` without momentum), so a part that ``assumes_plain_sgd`` is
refused next to a part that ``adds_proximal_term``.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch

from ..engine.cohort import GRADIENT_OFFSET, LOGIT_SCALE
from ..errors import ConfigError
from .aggregate import ServerOptimizer
from .base import ClientContext, Message, RoundInfo, ServerContext
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss, LocalResult, prepare_hook

# Hooks that only one part may define: they replace, rather than add to, FedAvg's behaviour.
EXCLUSIVE_HOOKS = {"combine": "aggregation rule", "server_optimizer": "server optimiser", "private_mask": "private-parameter mask"}
# Hooks that read or build whole-model vectors (the broadcast weights, control variates over every parameter,
# corrections of the combined vector): next to a private-parameter mask (MTFL), whose messages and server
# vectors hold the shared entries only, their vectors would not line up.
WHOLE_VECTOR_HOOKS = ("broadcast_extras", "reply_extras", "adjust_combined", "after_aggregate", "refine")
# FedAvg's parameters that every part has and that must hold one value for the whole combination.
SHARED_SETTINGS = tuple(FedAvgParams.model_fields)


def _defines(part: FedAvg, hook: str) -> bool:
    return getattr(type(part), hook) is not getattr(FedAvg, hook)


def _show(value: Any) -> str:
    return "null" if value is None else str(value)


def resolve_shared_settings(parts: list[FedAvg]) -> dict[str, Any]:
    """The value of each shared setting for the combination (module docstring: explicit, owner, FedAvg)."""
    resolved: dict[str, Any] = {}
    for key in SHARED_SETTINGS:
        having = [p for p in parts if key in type(p.params).model_fields]
        explicit = [(p, getattr(p.params, key)) for p in having if key in p.params.model_fields_set]
        if explicit:
            first, value = explicit[0]
            for other, other_value in explicit[1:]:
                if other_value != value:
                    raise ConfigError(
                        f"algorithm.plus: {first.name} sets {key}={_show(value)} and {other.name} sets "
                        f"{key}={_show(other_value)}; set the same value on both or on one only"
                    )
            resolved[key] = value
            continue
        fedavg_default = FedAvgParams.model_fields[key].get_default()
        owners = [(p, type(p.params).model_fields[key].get_default()) for p in having]
        owners = [(p, d) for p, d in owners if d != fedavg_default]
        for other, other_default in owners[1:]:
            if other_default != owners[0][1]:
                raise ConfigError(
                    f"algorithm.plus: {owners[0][0].name} defaults to {key}={_show(owners[0][1])} and {other.name} "
                    f"to {key}={_show(other_default)}; set {key} explicitly on one of them"
                )
        resolved[key] = owners[0][1] if owners else fedavg_default
    return resolved


class Composite(FedAvg):
    """FedAvg whose ingredients come from several methods (the first is the base, the rest are added)."""

    def __init__(self, parts: list[FedAvg]) -> None:
        if not parts:
            raise ValueError("a composite needs at least one part")
        for part in parts:
            if not isinstance(part, FedAvg):
                raise ConfigError(
                    f"algorithm.plus: {part.name} is not a parameter-averaging method and cannot be combined this way"
                )
            # A part that replaces a whole round function would be silently bypassed here: refuse it.
            replaced = [f for f in ("broadcast", "aggregate", "local_update") if _defines(part, f)]
            if replaced:
                raise ConfigError(f"algorithm.plus: {part.name} replaces {', '.join(replaced)} and cannot be combined")
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            raise ConfigError(f"algorithm.plus: each method may appear once (got {' + '.join(names)})")
        self.owners: dict[str, FedAvg] = {}
        for hook, what in EXCLUSIVE_HOOKS.items():
            defining = [p for p in parts if _defines(p, hook)]
            if len(defining) > 1:
                raise ConfigError(
                    f"algorithm.plus: {defining[0].name} and {defining[1].name} both define the {what}; "
                    "combine at most one of them with the others"
                )
            self.owners[hook] = defining[0] if defining else parts[0]
        if _defines(self.owners["private_mask"], "private_mask"):
            masker = self.owners["private_mask"]
            for part in parts:
                clash = [h for h in WHOLE_VECTOR_HOOKS if _defines(part, h)]
                if part is not masker and clash:
                    raise ConfigError(
                        f"algorithm.plus: {part.name} cannot be combined with {masker.name}: its {', '.join(clash)} "
                        f"work on whole-model vectors, and {masker.name} keeps some entries on the clients (only the "
                        "shared ones travel and are aggregated); combine it with loss terms or a server optimiser only"
                    )
        plain_sgd = [p for p in parts if p.assumes_plain_sgd]
        proximal = [p for p in parts if p.adds_proximal_term]
        if plain_sgd and proximal:
            raise ConfigError(
                f"algorithm.plus: {plain_sgd[0].name} cannot be combined with {proximal[0].name}: its normaliser a_k "
                f"counts plain momentum-SGD steps, and {proximal[0].name}'s proximal term makes every local step also "
                "contract toward the anchor, which needs a different normaliser"
            )
        # One value of weighting and grad_clip for every part (module docstring).
        shared = resolve_shared_settings(parts)
        for part in parts:
            update = {k: v for k, v in shared.items() if k in type(part.params).model_fields}
            part.params = part.params.model_copy(update=update)
        super().__init__(parts[0].params, parts[0].local)
        self.parts = parts
        self.name = "+".join(names)
        self.needs_features = any(p.needs_features for p in parts)
        self.adds_proximal_term = bool(proximal)
        # A part whose personalised model is not the global one (MTFL's assembled (θ, P_k)) decides it.
        self.personal_model = next((p.personal_model for p in parts if p.personal_model != "global"), "global")
        self.assumes_plain_sgd = bool(plain_sgd)

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        for part in self.parts:
            part.init_server(server)

    def server_optimizer(self, server: ServerContext) -> ServerOptimizer:
        return self.owners["server_optimizer"].server_optimizer(server)

    def combine(self, global_vec: torch.Tensor, replies: list[Message]) -> torch.Tensor:
        return self.owners["combine"].combine(global_vec, replies)

    def private_mask(self, model: torch.nn.Module) -> torch.Tensor | None:
        return self.owners["private_mask"].private_mask(model)

    def adjust_combined(
        self, server: ServerContext, global_vec: torch.Tensor, combined: torch.Tensor, replies: list[Message]
    ) -> torch.Tensor:
        for part in self.parts:
            combined = part.adjust_combined(server, global_vec, combined, replies)
        return combined

    def broadcast_extras(self, server: ServerContext, info: RoundInfo, cid: int) -> dict[str, Any]:
        return self._merge("broadcast", [p.broadcast_extras(server, info, cid) for p in self.parts])

    def refine(self, server: ServerContext, info: RoundInfo, replies: list[Message], cids: list[int]) -> dict[str, float]:
        # In the listed order: each refiner starts from the model the previous one left.
        return self._merge("metric", [p.refine(server, info, replies, cids) for p in self.parts])

    def after_aggregate(self, server: ServerContext, info: RoundInfo, replies: list[Message], cids: list[int]) -> dict[str, float]:
        return self._merge("metric", [p.after_aggregate(server, info, replies, cids) for p in self.parts])

    # -- client ---------------------------------------------------------------------------------
    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss | None:
        terms = [t for t in (p.extra_loss(client, msg) for p in self.parts) if t is not None]
        if not terms:
            return None
        if len(terms) == 1:
            return terms[0]

        def summed(model, x, y, logits, features):
            total = terms[0](model, x, y, logits, features)
            for term in terms[1:]:
                total = total + term(model, x, y, logits, features)
            return total

        hooks = [h for h in map(prepare_hook, terms) if h is not None]
        if hooks:  # each part's per-step draws, in the listed order

            def prepare_step(m: int) -> None:
                for hook in hooks:
                    hook(m)

            summed.prepare_step = prepare_step

        return summed

    def logit_transform(self, client: ClientContext) -> Callable[[torch.Tensor], torch.Tensor] | None:
        transforms = [t for t in (p.logit_transform(client) for p in self.parts) if t is not None]
        if not transforms:
            return None

        def chained(logits: torch.Tensor) -> torch.Tensor:
            for transform in transforms:
                logits = transform(logits)
            return logits

        return chained

    def grad_correction(self, client: ClientContext, msg: Message) -> Callable[[torch.nn.Module], None] | None:
        corrections = [c for c in (p.grad_correction(client, msg) for p in self.parts) if c is not None]
        if not corrections:
            return None

        def chained(model: torch.nn.Module) -> None:
            for correction in corrections:
                correction(model)

        return chained

    def reply_extras(self, client: ClientContext, info: RoundInfo, msg: Message, result: LocalResult) -> dict[str, Any]:
        return self._merge("reply", [p.reply_extras(client, info, msg, result) for p in self.parts])

    def cohort_batches(self) -> bool:
        return all(getattr(part, "cohort_batches", lambda: False)() for part in self.parts)

    def cohort_term(self, client: ClientContext, msg: Message) -> tuple[Any, dict[str, torch.Tensor]] | None:
        """The parts' cohort terms together (engine/cohort.py), as the sequential hooks combine them: loss terms
        summed in the listed order, gradient offsets added, logit scales multiplied (each part's transform is a
        per-class scale, so chaining them is their product), one teacher (every part's is the round's global
        model). None, so that the clients train sequentially, when a part's step cannot batch or two parts hold
        another fixed row under one name."""
        plans = [getattr(part, "cohort_term", lambda c, m: None)(client, msg) for part in self.parts]
        if any(plan is None for plan in plans):
            return None
        terms = [term for term, _ in plans if term is not None]
        fixed: dict[str, torch.Tensor] = {}
        for _, rows in plans:
            for key, value in rows.items():
                if key not in fixed:
                    fixed[key] = value
                elif key == GRADIENT_OFFSET:
                    fixed[key] = fixed[key] + value
                elif key == LOGIT_SCALE:
                    fixed[key] = fixed[key] * value
                elif key != "teacher" or not torch.equal(fixed[key], value):
                    return None
        if not terms:
            return None, fixed
        if len(terms) == 1:
            return terms[0], fixed

        def summed(params, x, y, logits, mask, rows):
            total = terms[0](params, x, y, logits, mask, rows)
            for term in terms[1:]:
                total = total + term(params, x, y, logits, mask, rows)
            return total

        summed.needs_teacher = any(getattr(t, "needs_teacher", False) for t in terms)
        summed.needs_features = any(getattr(t, "needs_features", False) for t in terms)
        summed.frozen_features = tuple(k for t in terms for k in getattr(t, "frozen_features", ()))
        return summed, fixed

    def graph_key(self, client: ClientContext, msg: Message) -> Hashable | None:
        # Capturable when every part is; the parts' keys together describe the chained closures.
        keys = [p.graph_key(client, msg) for p in self.parts]
        return None if any(k is None for k in keys) else tuple(keys)

    def _merge(self, what: str, dicts: list[dict[str, Any]]) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, fields in zip(self.parts, dicts):
            for key, value in fields.items():
                if key in merged:
                    raise ConfigError(f"algorithm.plus: {self.name} cannot be combined: two parts send the {what} field {key!r}")
                merged[key] = value
        return merged
