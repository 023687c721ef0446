"""fedistill: federated learning on non-IID data through knowledge distillation.

The public API (issue 27; docs/usage.md "Python"): :func:`run`, :func:`load_run`, :func:`compare`, :func:`make_config`,
:class:`Config`, :class:`RunResult`, and the extension points :class:`Algorithm`, :class:`AlgorithmParams`,
:class:`Message`, :func:`register_algorithm`, :func:`register_dataset`, :func:`register_model`,
:func:`register_partition`. Imported on first use, so ``import fedistill`` stays light (the CLI starts fast).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "run": "api", "load_run": "api", "compare": "api", "make_config": "api", "RunResult": "api",
    "register_algorithm": "api", "register_dataset": "api", "register_model": "api", "register_partition": "api",
    "Config": "config", "ConfigError": "errors", "FedistillError": "errors",
    "Algorithm": "protocol", "AlgorithmParams": "protocol", "Message": "protocol", "RoundInfo": "protocol",
    "ClientContext": "protocol", "ServerContext": "protocol",
}  # fmt: skip
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedistill' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"fedistill.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
