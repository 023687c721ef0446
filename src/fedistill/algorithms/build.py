"""Building the configured algorithm (a method, or a Composite of it and the ``algorithm.plus`` parts).

It lives with the algorithms, not the engine, so that config validation can build one without importing
the simulation (DESIGN.md: ``config.py`` must not import from ``engine/``).
"""

from __future__ import annotations

from typing import Any

from ..config import algorithm_params, part_params
from ..registry import ALGORITHMS
from .base import Algorithm


def make_algorithm(cfg: Any) -> Algorithm:
    """The configured method; with ``algorithm.plus``, a Composite of it and the added methods."""
    algo_cls = ALGORITHMS.get(cfg.algorithm.name, key="algorithm.name")
    algorithm = algo_cls(algorithm_params(algo_cls, cfg), cfg.local)
    if not cfg.algorithm.plus:
        return algorithm
    from .compose import Composite

    parts = [algorithm]
    for name, params in cfg.algorithm.plus.items():
        part_cls = ALGORITHMS.get(name, key=f"algorithm.plus.{name}")
        parts.append(part_cls(part_params(part_cls, name, params), cfg.local))
    return Composite(parts)
