"""Building models by name from configuration.

Every factory registered in :data:`fedistill.registry.MODELS` has the signature
``fn(input_shape, num_classes, **kwargs) -> ClassifierModel``, with keyword options that have defaults.
:func:`build_model` resolves the name (an unknown one is a :class:`~fedistill.errors.ConfigError` that
lists the choices) and checks the options before calling, so a typo in ``model.<option>`` is reported
with the accepted names instead of a TypeError.

One option is accepted by every model: ``projection_dim`` (default None) adds MOON's projection head
between the features and the classifier (:mod:`.projection`; spec/moon.md ambiguity 1).
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Sequence

from ..errors import ConfigError
from ..registry import MODELS
from .base import ClassifierModel
from .projection import ProjectedClassifier

_POSITIONAL = ("input_shape", "num_classes")
# Options that build_model handles for every model (name -> default), on top of the factory's own.
COMMON_OPTIONS: dict[str, Any] = {"projection_dim": None}


def _options(fn: Any) -> tuple[dict[str, Any], bool]:
    """Keyword options of a factory (name -> default) and whether it also takes ``**kwargs``."""
    params = list(inspect.signature(fn).parameters.values())
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    opts = {
        p.name: p.default
        for p in params
        if p.name not in _POSITIONAL
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return opts, var_kw


def model_options(name: str) -> dict[str, Any]:
    """The keyword options model ``name`` accepts, with their defaults (for ``fedistill list`` and docs)."""
    return {**_options(MODELS.get(name, key="model.name"))[0], **COMMON_OPTIONS}


def build_model(name: str, input_shape: Sequence[int], num_classes: int, /, **kwargs: Any) -> ClassifierModel:
    """Create model ``name`` for inputs of shape ``(channels, height, width)`` and ``num_classes`` classes.

    Raises ConfigError for an unknown name, an unknown or duplicated option, or an input shape or option
    value the model cannot take.
    """
    fn = MODELS.get(name, key="model.name")
    opts, var_kw = _options(fn)
    accepted = ", ".join(sorted({**opts, **COMMON_OPTIONS}))
    projection_dim = kwargs.pop("projection_dim", None)
    if projection_dim is not None and (
        not isinstance(projection_dim, int) or isinstance(projection_dim, bool) or projection_dim < 1
    ):
        raise ConfigError(f"model {name!r}: projection_dim must be a positive integer or null, got {projection_dim!r}")
    for key in kwargs:
        if key in _POSITIONAL:
            raise ConfigError(
                f"model.{key} is set from the dataset and cannot be given as an option of {name!r}"
            )
        if key not in opts and not var_kw:
            raise ConfigError(f"model {name!r} has no option {key!r}; accepted options: {accepted}")
    try:
        model = fn(input_shape, num_classes, **kwargs)
    except TypeError as err:
        # Only a factory that forwards **kwargs gets here with a bad name; report it like the check above.
        match = re.search(r"unexpected keyword argument '([^']+)'", str(err))
        if match is None:
            raise
        raise ConfigError(
            f"model {name!r} has no option {match.group(1)!r}; accepted options: {accepted}"
        ) from None
    if not isinstance(model, ClassifierModel):  # a registration bug, not a user error
        raise TypeError(f"model factory {name!r} returned {type(model).__name__}, not a ClassifierModel")
    if projection_dim is not None:
        # Built right after the body from the same (seeded) random stream, so server and clients agree.
        model = ProjectedClassifier(model, projection_dim)
    return model
