"""Which model each client trains: one architecture for all, a cyclic list, or a seeded random mix.

FedICT's heterogeneous settings (spec/experiments-fedict.md §4): five clients with A^C_1..A^C_5 (client k
gets ``model.clients[k mod 5]``, the code's "client index mod 5"), and the TMD setting where every client
independently draws u ~ U[0,1) and takes the first model whose cumulative probability exceeds u
(``client_mix: {fd_mlp64: 0.1, fd_mlp32: 0.3, fd_mlp16: 0.6}`` is the card's u < 0.1 -> A^C_8,
u < 0.4 -> A^C_7, else A^C_6). The assignment depends only on (seed, client id, config), so the server,
every worker process and every Flower client compute the same one without talking.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .seeding import ASSIGNMENT, derive_seed


def client_architectures(cfg: Any, num_clients: int) -> list[str]:
    """The model name of every client 0..num_clients-1."""
    model = cfg.model
    if model.clients:
        return [model.clients[k % len(model.clients)] for k in range(num_clients)]
    if model.client_mix:
        names = list(model.client_mix)
        cumulative = np.cumsum([model.client_mix[n] for n in names])
        draws = np.random.default_rng(derive_seed(cfg.seed, ASSIGNMENT)).random(num_clients)
        # side="right": u equal to a boundary goes to the next model, as in the card's strict "u < 0.1"
        picks = np.minimum(np.searchsorted(cumulative, draws, side="right"), len(names) - 1)
        return [names[int(i)] for i in picks]
    return [cfg.model_name()] * num_clients


def check_architectures(cfg: Any, algorithm: Any, num_clients: int) -> list[str]:
    """The assignment, refused where the algorithm cannot use it (one clear error before any work)."""
    names = client_architectures(cfg, num_clients)
    exchange = getattr(algorithm, "exchange", "weights")
    if exchange == "weights" and len(set(names)) > 1:
        raise ConfigError(
            f"model.clients: {cfg.algorithm.display_name()} averages weights, so every client needs the same "
            f"architecture; this config gives {sorted(set(names))}. Use one model (model.name), or a "
            "federated-distillation method (fedgkt, feddkc, fedict)"
        )
    if exchange == "weights" and cfg.model.server is not None:
        # Not an error: a table's preset (FedICT's) sets the server predictor for every method it compares,
        # the weight-averaging baselines included. Said once, and the run's header leaves it out.
        import logging

        logging.getLogger("fedistill.engine").warning(
            "model.server (%s) is not used: %s trains one model, %s, on the clients and the server; only fedgkt, "
            "feddkc and fedict train a server predictor", cfg.model.server, cfg.algorithm.display_name(), cfg.model_name(),
        )
    if exchange == "knowledge":
        if cfg.model.server is None:
            raise ConfigError(
                f"model.server: {cfg.algorithm.display_name()} trains a server predictor on the clients' features; "
                "name it (e.g. fd_server_resnet56 for image clients, fd_server_mlp for fd_mlp clients)"
            )
        if not cfg.partition.per_client_test:
            raise ConfigError(
                f"partition.per_client_test: {cfg.algorithm.display_name()} has no global model to test; its accuracy "
                "is each client's own model on its own test split, so set partition.per_client_test: true"
            )
        if cfg.accuracy_metric() != "personal":
            raise ConfigError(f"eval.metric: {cfg.algorithm.display_name()} reports personal accuracy only; use auto or personal")
    return names
