"""The algorithm interface, as the methods import it: defined in :mod:`fedistill.protocol` (below the engine
and the methods, so that the engine needs nothing from ``algorithms/``) and re-exported here."""

from ..protocol import (  # noqa: F401
    EVAL_PREFIX,
    SCALAR_BYTES,
    Algorithm,
    AlgorithmParams,
    ClientContext,
    Message,
    RoundInfo,
    Scalar,
    ServerContext,
)
