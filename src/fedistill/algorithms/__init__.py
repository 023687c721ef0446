"""Algorithms; importing this package registers every method in ``ALGORITHMS``."""

from . import (  # noqa: F401
    dafkd,
    fedadam,
    fedavg,
    fedcurv,
    feddf,
    feddkc,
    feddyn,
    fedftg,
    fedgen,
    fedgkt,
    fedict,
    fedlmd,
    fednova,
    fedntd,
    fedprox,
    fedrs,
    moon,
    mtfl,
    pfedme,
    scaffold,
)
