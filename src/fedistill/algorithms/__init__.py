"""Algorithms; importing this package registers every method in ``ALGORITHMS``."""

from . import fedadam, fedavg, fedcurv, feddyn, fednova, fedntd, fedprox, fedrs, scaffold  # noqa: F401
