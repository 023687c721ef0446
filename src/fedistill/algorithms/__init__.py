"""Algorithms; importing this package registers every method in ``ALGORITHMS``."""

from . import fedadam, fedavg, fedcurv, feddyn, fedftg, fedlmd, fednova, fedntd, fedprox, fedrs, moon, scaffold  # noqa: F401
