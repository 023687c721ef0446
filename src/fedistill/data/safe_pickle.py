"""Unpickling that cannot run code: numpy arrays and plain containers only.

A pickle names the callables that rebuild its objects (``find_class``), and loading it calls them: a file
whose pickle names ``os.system`` or ``builtins.eval`` runs a command when it is loaded. Dataset files that
hold pickles (CIFAR's official batches, HtFLlib's per-client ``.npz`` files) are read with
:class:`ArrayUnpickler`, which resolves only the globals a numpy array needs (its reconstructor, ``ndarray``,
``dtype`` and the multiarray scalar and buffer helpers) and the builtin containers, and refuses any other
global before anything is called. Dicts, lists, tuples, strings, numbers and bytes need no global at all.
"""

from __future__ import annotations

import pickle
from typing import IO, Any

import numpy as np

# (module, name) of every global a pickled numpy array or plain container may name. numpy 1.x writes its
# helpers under numpy.core, numpy 2 under numpy._core; both spellings are accepted.
ARRAY_GLOBALS = frozenset(
    {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),  # protocol-5 arrays
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),  # how Python 3 writes bytes in protocol-2 pickles
        # containers that older protocols rebuild by calling their type (protocol <= 3: set, frozenset, bytearray)
        ("builtins", "dict"),
        ("builtins", "list"),
        ("builtins", "tuple"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "bytearray"),
        ("__builtin__", "set"),  # Python 2's name for builtins
        ("__builtin__", "frozenset"),
        ("__builtin__", "bytearray"),
    }
)

_NUMPY_2 = int(np.__version__.split(".")[0]) >= 2


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside :data:`ARRAY_GLOBALS`; ``name`` is ``module.name``."""

    def __init__(self, name: str) -> None:
        super().__init__(f"refusing to load global {name}")
        self.name = name


class ArrayUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals of :data:`ARRAY_GLOBALS`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ARRAY_GLOBALS:
            raise RefusedGlobal(f"{module}.{name}")
        if module == "__builtin__":
            module = "builtins"
        if module.startswith("numpy.core") and _NUMPY_2:
            module = "numpy._core" + module[len("numpy.core") :]  # numpy 2 renamed it; avoids a warning
        return super().find_class(module, name)


def load_restricted(fp: IO[bytes], encoding: str = "ASCII") -> Any:
    """The object pickled in ``fp``, rebuilt by :class:`ArrayUnpickler` (``encoding`` as ``pickle.load``'s:
    ``"bytes"`` keeps Python 2 strings as bytes)."""
    return ArrayUnpickler(fp, encoding=encoding).load()
