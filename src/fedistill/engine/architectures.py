"""Which model each client trains: one architecture for all, a cyclic list, a model group, or a seeded random mix.

FedICT's heterogeneous settings (spec/experiments-fedict.md §4): five clients with A^C_1..A^C_5 (client k
gets ``model.clients[k mod 5]``, the code's "client index mod 5"), and the TMD setting where every client
independently draws u ~ U[0,1) and takes the first model whose cumulative probability exceeds u
(``client_mix: {fd_mlp64: 0.1, fd_mlp32: 0.3, fd_mlp16: 0.6}`` is the card's u < 0.1 -> A^C_8,
u < 0.4 -> A^C_7, else A^C_6). A model group (``model.group``, HtFLlib's HtFE groups) cycles like
``model.clients``: client k gets member ``k mod M``, as HtFLlib's ``args.models[cid % len(args.models)]``. The
assignment depends only on (seed, client id, config), so the server, every worker process and every Flower client
compute the same one without talking.

Whether a method can train an assignment is read from what it declares it exchanges
(:class:`~fedistill.protocol.Exchange`), never from its name: averaged weights need one architecture; features
added across clients need one feature dimension; every kind where clients keep their own models reports personal
accuracy. The errors name the method's declared uploads and, as a way out, the registered methods that fit.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ..errors import ConfigError
from ..protocol import Exchange, exchange_of
from .seeding import ASSIGNMENT, derive_seed


def client_architectures(cfg: Any, num_clients: int) -> list[str]:
    """The model name of every client 0..num_clients-1."""
    model = cfg.model
    cycle = model.clients or model.group_members()
    if cycle:
        return [cycle[k % len(cycle)] for k in range(num_clients)]
    if model.client_mix:
        names = list(model.client_mix)
        cumulative = np.cumsum([model.client_mix[n] for n in names])
        draws = np.random.default_rng(derive_seed(cfg.seed, ASSIGNMENT)).random(num_clients)
        # side="right": u equal to a boundary goes to the next model, as in the card's strict "u < 0.1"
        picks = np.minimum(np.searchsorted(cumulative, draws, side="right"), len(names) - 1)
        return [names[int(i)] for i in picks]
    return [cfg.model_name()] * num_clients


def shared_model_name(cfg: Any) -> str:
    """The shared model's architecture (``Exchange.shared_model``): ``model.shared``, or the assignment's first
    member (client 0's architecture: HtFLlib's ``models[0]``)."""
    return cfg.model.shared or client_architectures(cfg, 1)[0]


def assignment_key(cfg: Any) -> str:
    """The config key that gives the clients their architectures (what an error about them names)."""
    model = cfg.model
    for key in ("group", "client_mix", "clients"):
        if getattr(model, key):
            return f"model.{key}"
    return "model.name"


def methods_where(test: Callable[[Exchange], bool]) -> str:
    """The registered methods whose declared exchange passes ``test``, for an error's way out (read from the
    registry: the engine names no method itself)."""
    from ..registry import ALGORITHMS

    return ", ".join(name for name in ALGORITHMS.names() if test(exchange_of(ALGORITHMS.get(name))))


def check_architectures(cfg: Any, algorithm: Any, num_clients: int) -> list[str]:
    """The assignment, refused where the algorithm cannot use it (one clear error before any work).

    What the algorithm declares it exchanges (:class:`~fedistill.protocol.Exchange`) decides: averaged weights
    need one architecture; a server predictor needs ``model.server``; methods whose clients keep their own
    models have no global model to test, so their accuracy is personal."""
    names = client_architectures(cfg, num_clients)
    exchange = exchange_of(algorithm)
    method = cfg.algorithm.display_name()
    if (exchange.global_model or exchange.one_architecture) and len(set(names)) > 1:
        key = "model.group" if cfg.model.group else "model.clients"
        raise ConfigError(
            f"{key}: {method} averages {'weights' if exchange.global_model else exchange.uploads}, so every client needs the same architecture; this config gives "
            f"{sorted(set(names))}. Use one model (model.name), or a method whose clients keep models of their own "
            f"({methods_where(lambda e: e.own_models)})"
        )
    if not exchange.server_predictor and cfg.model.server is not None:
        # Not an error: a table's preset (FedICT's) sets the server predictor for every method it compares,
        # the weight-averaging baselines included. Said once, and the run's header leaves it out.
        import logging

        logging.getLogger("fedistill.engine").warning(
            "model.server (%s) is not used: %s exchanges %s and trains no server predictor; only %s do",
            cfg.model.server, method, exchange.uploads, methods_where(lambda e: e.server_predictor),
        )  # fmt: skip
    if exchange.server_predictor and cfg.model.server is None:
        raise ConfigError(
            f"model.server: {method} trains a server predictor on the clients' {exchange.uploads}; name it (e.g. "
            "fd_server_resnet56 for image clients, fd_server_mlp for fd_mlp clients)"
        )
    if exchange.own_models:
        if not cfg.partition.per_client_test:
            raise ConfigError(
                f"partition.per_client_test: {method} has no global model to test (its clients keep their own models "
                f"and exchange {exchange.uploads}); its accuracy is each client's own model on its own test split, so "
                "set partition.per_client_test: true"
            )
        if cfg.accuracy_metric() != "personal":
            raise ConfigError(f"eval.metric: {method} reports personal accuracy only; use auto or personal")
    return names


def check_client_models(cfg: Any, algorithm: Any, models: Mapping[str, Any]) -> None:
    """Refuse, in one line, client models that cannot make what the algorithm uploads: rows of features added
    across clients (``Exchange.common_feature``) need ``extract`` and one ``feature_dim`` for every architecture.
    ``models``: one built model per architecture name."""
    exchange = exchange_of(algorithm)
    key, method = assignment_key(cfg), cfg.algorithm.display_name()
    reason = algorithm.refuse_models(models)
    if reason:
        raise ConfigError(f"{key}: {method} {reason}")
    if not exchange.common_feature:
        return
    lacking = [name for name, model in models.items() if not (hasattr(model, "extract") and hasattr(model, "feature_dim"))]
    if lacking:
        raise ConfigError(f"{key}: {method} uploads {exchange.uploads}, which needs a model with a feature extractor "
                          f"(extract, feature_dim); {lacking} has none")  # fmt: skip
    dims = {name: int(model.feature_dim) for name, model in models.items()}
    if len(set(dims.values())) > 1:
        raise ConfigError(
            f"{key}: {method} uploads {exchange.uploads}, which are averaged across clients, so every client model "
            f"needs one feature dimension; got {dims} (a model group gives its members one, e.g. model.group_kwargs: "
            "{feature_dim: 512})"
        )
