"""Algorithms; importing this package registers every method in ``ALGORITHMS``."""

from . import fedadam, fedavg, fednova, fedprox, scaffold  # noqa: F401
