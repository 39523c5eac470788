"""raftps: a Raft-consistent parameter store for training machine-learning models."""
from raftps.client.client import Client
from raftps.errors import (AuthenticationFailed, DtypeMismatch, Internal, InvalidGradient, InvalidOptimizer, InvalidRequest,
                           LimitExceeded, NotInGroup, PermissionDenied, ProtocolError, StaleBase, StalenessBound, TLSRequired,
                           RaftpsError, SessionExpired, ShapeMismatch, StepTimeout, TensorExists, Unavailable,
                           UnknownTensor)

__all__ = ["Client", "RaftpsError", "UnknownTensor", "TensorExists", "ShapeMismatch", "DtypeMismatch",
           "InvalidGradient", "InvalidOptimizer", "InvalidRequest", "ProtocolError", "SessionExpired",
           "StepTimeout", "Unavailable", "Internal", "AuthenticationFailed", "LimitExceeded", "TLSRequired",
           "StaleBase", "StalenessBound", "NotInGroup", "PermissionDenied"]
__version__ = "0.1.0"
