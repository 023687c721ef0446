"""Algorithms; importing this package registers every method in ``ALGORITHMS``."""

from . import (  # noqa: F401
    dafkd,
    fedadam,
    fedavg,
    fedcurv,
    feddf,
    feddyn,
    fedftg,
    fedgen,
    fedlmd,
    fednova,
    fedntd,
    fedprox,
    fedrs,
    moon,
    scaffold,
)
