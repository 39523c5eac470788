"""raftps: a Raft-consistent parameter store for training machine-learning models."""
from .client import Client
from .errors import (DtypeMismatch, Internal, InvalidGradient, InvalidOptimizer, InvalidRequest, ProtocolError,
                     RaftpsError, SessionExpired, ShapeMismatch, StepTimeout, TensorExists, Unavailable,
                     UnknownTensor, StaleBase, StalenessBound, NotInGroup)

__all__ = ["Client", "RaftpsError", "UnknownTensor", "TensorExists", "ShapeMismatch", "DtypeMismatch",
           "InvalidGradient", "InvalidOptimizer", "InvalidRequest", "ProtocolError", "SessionExpired",
           "StepTimeout", "Unavailable", "Internal", "StaleBase", "StalenessBound", "NotInGroup"]
__version__ = "0.1.0"
