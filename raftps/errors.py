"""Exceptions raised by the client, and the codes that carry them over the wire.

The state machine and the servers never raise these at each other: they return
``{"error": code, "message": ...}`` and the client turns the code back into a class.
"""
from __future__ import annotations


class RaftpsError(Exception):
    """Base class of every error raftps raises."""
    code = "RaftpsError"


class UnknownTensor(RaftpsError):
    code = "UnknownTensor"


class TensorExists(RaftpsError):
    code = "TensorExists"


class ShapeMismatch(RaftpsError):
    code = "ShapeMismatch"


class DtypeMismatch(RaftpsError):
    code = "DtypeMismatch"


class InvalidGradient(RaftpsError):
    """NaN/Inf values, or a gradient that cannot be applied."""
    code = "InvalidGradient"


class InvalidOptimizer(RaftpsError):
    code = "InvalidOptimizer"


class InvalidRequest(RaftpsError):
    """A well-formed frame whose content makes no sense (bad name, bad field type...)."""
    code = "InvalidRequest"


class ProtocolError(RaftpsError):
    """Bytes that are not a valid raftps frame (garbage, truncated, oversized)."""
    code = "ProtocolError"


class LimitExceeded(ProtocolError):
    """A frame, tensor, push or connection beyond one of the node's limits; the message names
    the limit (its config key) and its value."""
    code = "LimitExceeded"


class AuthenticationFailed(RaftpsError):
    """A missing or wrong client token, or a TLS problem: the node served nothing else and
    closed the connection. Retrying with the same credentials cannot succeed."""
    code = "AuthenticationFailed"


class TLSRequired(AuthenticationFailed):
    """A plain connection to a node that serves its client port over TLS only."""
    code = "TLSRequired"


class PermissionDenied(RaftpsError):
    """The client's identity (its token) has no role that allows this op on a name it carries:
    see raftps.rbac. Nothing was changed; retrying with the same token cannot succeed."""
    code = "PermissionDenied"


class SessionExpired(RaftpsError):
    """The store forgot this client's session, so a retry could not be deduplicated."""
    code = "SessionExpired"


class StepTimeout(RaftpsError):
    code = "StepTimeout"


class StaleBase(RaftpsError):
    """A push's base version is older than the state the store keeps to correct for it."""
    code = "StaleBase"


class StalenessBound(RaftpsError):
    """SSP: the pushing worker is more than the group's staleness bound ahead of the slowest."""
    code = "StalenessBound"


class NotInGroup(RaftpsError):
    """SSP: the worker is not (or no longer) a member of the group; join again."""
    code = "NotInGroup"


class _Placement(RaftpsError):
    """An error about where a tensor lives: it names the tensor and the group it is going to or in."""
    fields = ("tensor", "group")

    def __init__(self, message: str, tensor: str | None = None, group: int | None = None):
        super().__init__(message)
        self.tensor, self.group = tensor, group


class Moving(_Placement):
    """The tensor is being moved to another Raft group (``raftps move``): its source group refuses
    writes to it until the move completes. Nothing was applied; the client waits and sends again."""
    code = "Moving"


class Moved(_Placement):
    """The tensor now lives in Raft group ``group``: this group holds only its tombstone. Nothing
    was applied; the client refreshes its placement and sends that part to ``group``."""
    code = "Moved"


class Unavailable(RaftpsError):
    """No node could complete the request before the client's timeout.

    The outcome of a write that ends with Unavailable is unknown: it may have been applied
    (once) or not at all. Retrying it with the same client keeps it exactly-once.
    """
    code = "Unavailable"


class Internal(RaftpsError):
    code = "Internal"


ERRORS: dict[str, type[RaftpsError]] = {
    cls.code: cls
    for cls in (RaftpsError, UnknownTensor, TensorExists, ShapeMismatch, DtypeMismatch,
                InvalidGradient, InvalidOptimizer, InvalidRequest, ProtocolError,
                LimitExceeded, AuthenticationFailed, TLSRequired, PermissionDenied, SessionExpired, StepTimeout,
                Unavailable, Internal,
                StaleBase, StalenessBound, NotInGroup, Moving, Moved)
}


def error_result(cls: type[RaftpsError], message: str) -> dict:
    """The wire form of a definite failure."""
    return {"error": cls.code, "message": message}


def exception_result(exc: RaftpsError) -> dict:
    """``error_result`` of a raised error, with the fields its class carries (Moved's group)."""
    result = error_result(type(exc), str(exc))
    for name in getattr(exc, "fields", ()):
        if getattr(exc, name, None) is not None:
            result[name] = getattr(exc, name)
    return result


def raise_for(result: dict) -> dict:
    """Raise the exception a wire result carries, or return the result."""
    code = result.get("error")
    if code is None:
        return result
    exc = ERRORS.get(code, RaftpsError)(result.get("message", code))
    for name in getattr(exc, "fields", ()):
        setattr(exc, name, result.get(name))
    # The node refused the request before proposing it: it is in no log (see Router.write).
    exc.refused = bool(result.get("refused"))
    raise exc


class UsageError(ValueError):
    """A bad request or file for an operator command (export, import, snapshot); nothing was
    written. Not a wire error: the command line prints it as one line."""
