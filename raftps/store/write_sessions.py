"""Exactly-once writes: what the state machine remembers of each client (Raft dissertation,
section 6.3). A write carries the client's id, its seq and ``ack`` (every seq below it was
answered): a seq seen again is answered from the session's results, a seq below the floor is
stale, and a session idle for too many entries (or beyond the limit of sessions) is forgotten,
so a client coming back with ``ack > 1`` is told its session expired.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from raftps.errors import InvalidRequest, RaftpsError, SessionExpired, exception_result


@dataclass
class Session:
    """What the store remembers of one client (Raft dissertation, section 6.3)."""
    floor: int = 1                # every seq below it was answered, and its result forgotten
    last_index: int = 0           # log index of the client's latest request
    results: dict[int, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 10_000
    idle_entries: int = 1_000_000   # a session idle for this many log entries is forgotten
    max_outstanding: int = 256      # cached results per client


def run_once(sessions: "OrderedDict[str, Session]", limits: SessionLimits, stats: dict, index: int, command: dict,
             run: Callable[[], dict]) -> dict:
    """``run()``'s result for a write at log index ``index``, or the result its seq already had;
    ``sessions`` is least recently active first."""
    client, seq, ack = command.get("client"), command.get("seq"), command.get("ack", 1)
    if not isinstance(client, str) or not client or type(seq) is not int or type(ack) is not int \
            or seq < 1 or not 1 <= ack <= seq:
        raise InvalidRequest("a write needs client (str), seq (int >= 1) and ack (1 <= ack <= seq)")
    session = sessions.pop(client, None)
    if session is None:
        if ack > 1:
            raise SessionExpired(f"client {client}: session expired, request {seq} may or may not "
                                 "have been applied; start a new client")
        session = Session()
    session.last_index = index
    sessions[client] = session                  # move to the most recently active end
    _expire(sessions, limits, index)
    if ack > session.floor:
        session.results = {s: r for s, r in session.results.items() if s >= ack}
        session.floor = ack
    if seq in session.results:
        stats["duplicates"] += 1
        return dict(session.results[seq], duplicate=True)
    if seq < session.floor:
        stats["duplicates"] += 1
        return {"version": index, "duplicate": True, "stale": True}
    try:
        result = run()
    except RaftpsError as exc:
        stats["rejected"] += 1
        result = exception_result(exc)
    session.results[seq] = result
    while len(session.results) > limits.max_outstanding:
        oldest = min(session.results)
        del session.results[oldest]
        session.floor = oldest + 1
    return result


def _expire(sessions: "OrderedDict[str, Session]", limits: SessionLimits, index: int) -> None:
    while sessions:
        client, oldest = next(iter(sessions.items()))
        if len(sessions) <= limits.max_sessions and index - oldest.last_index <= limits.idle_entries:
            break
        del sessions[client]
