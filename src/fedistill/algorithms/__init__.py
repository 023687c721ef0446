"""Algorithms; importing this package registers every method in ``ALGORITHMS``."""

from . import fedavg, fedprox  # noqa: F401
