"""The in-process simulation with the methods plugged in: the composition root of a simulated run.

The engine (``fedistill.engine``) runs any :class:`~fedistill.protocol.Algorithm` it is handed and imports
nothing from ``algorithms/``; this module hands it the registry's builder
(:func:`fedistill.algorithms.build.make_algorithm`, which also composes ``algorithm.plus`` parts). Use
:class:`Simulation` as ``Simulation(cfg, dataset).run()``; :class:`ServerRuntime` and :class:`ClientRuntime`
are the engine's halves with the same wiring (the Flower apps build theirs the same way).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .algorithms.build import make_algorithm
from .config import Config
from .data.dataset import Dataset
from .engine import client as _client
from .engine import loop as _loop
from .engine import server as _server
from .engine.federation import Federation, build_federation
from .engine.server import build_model_for, kl_from_uniform, round_info
from .engine.summary import personal_metrics, summarise

__all__ = [
    "ClientRuntime",
    "Federation",
    "ServerRuntime",
    "Simulation",
    "build_federation",
    "build_model_for",
    "kl_from_uniform",
    "make_algorithm",
    "personal_metrics",
    "round_info",
    "summarise",
]


class Simulation(_loop.RoundLoop):
    """``cfg.rounds`` rounds in this process, the configured method built by :func:`make_algorithm`."""

    def __init__(
        self,
        cfg: Config,
        dataset: Dataset,
        run_dir: Path | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        federation: Federation | None = None,
    ) -> None:
        super().__init__(cfg, dataset, run_dir, on_round, federation, algorithm_factory=make_algorithm)


class ServerRuntime(_server.ServerRuntime):
    """The engine's server half running the configured method."""

    def __init__(self, cfg: Config, dataset: Dataset, num_clients: int, run_dir: Path | None = None, **options: Any) -> None:
        super().__init__(cfg, dataset, num_clients, run_dir, algorithm=make_algorithm(cfg), **options)


class ClientRuntime(_client.ClientRuntime):
    """The engine's client half running the configured method."""

    def __init__(
        self,
        cfg: Config,
        dataset: Dataset,
        train_indices: Mapping[int, torch.Tensor],
        test_indices: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(cfg, dataset, train_indices, test_indices, algorithm_factory=make_algorithm)
