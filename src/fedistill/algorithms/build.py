"""Building the configured algorithm (a method, or a Composite of it and the ``algorithm.plus`` parts).

It lives with the algorithms, not the engine: the engine is handed the algorithm (``fedistill.simulation``,
the Flower apps). A method's parameter schema is its own (``Params``), validated here; config validation calls
this module and this module imports nothing from ``config`` (issue 26: no import circle).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ..errors import ConfigError, closest
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


def algorithm_params(algo_cls: Any, cfg: Any) -> Any:
    return part_params(algo_cls, cfg.algorithm.name, cfg.algorithm.params_dict(), prefix="algorithm")


def part_params(algo_cls: Any, name: str, params: dict[str, Any], prefix: str | None = None) -> Any:
    """``params`` validated by ``algo_cls.Params``; errors name the config key (``algorithm.plus.NAME.KEY``)."""
    prefix = prefix or f"algorithm.plus.{name}"
    if not isinstance(params, dict):
        raise ConfigError(f"{prefix}: expected a mapping of parameters, got {params!r}")
    try:
        return algo_cls.Params.model_validate(params)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            allowed = ", ".join(algo_cls.Params.model_fields) or "none"
            hint = closest(first["loc"][-1], algo_cls.Params.model_fields)
            raise ConfigError(f"{prefix}.{key}: not a parameter of {name}{hint} (accepted: {allowed})") from None
        raise ConfigError(f"{prefix}.{key}: {first['msg']} (got {first.get('input')!r})") from None
