"""A fix for pysyncobj 0.3.17's livelock of an ex-leader with a divergent tail of >= 2 entries.

The bug (syncobj.py, pysyncobj 0.3.17):
* Follower, ``__onMessageReceived`` 'append_entries' (L981-990): if ``prevLogIdx`` is past its log
  end it replies ``next_node_idx = lastIndex + 1, reset=True``; if the term at ``prevLogIdx``
  differs it replies ``next_node_idx = prevLogIdx, reset=True`` (one step back).
* Leader, ``__sendAppendEntries`` (L1265-1273): each send moves ``nextIndex`` optimistically to
  the end of the batch, and one round sends batch after batch; with ``appendEntriesUseBatch=False``
  every new command starts another round.
* Leader, 'next_node_idx' handling (L1071-1082): ``if reset: nextIndex = next_node_idx`` - the last
  reply wins. The one-step-back reply of the first batch is always followed by "past my end"
  replies (lastIndex + 1) of the later batches or rounds, so nextIndex returns to lastIndex + 1
  and never gets below the divergent tail: the follower never matches again, across restarts.

The fix, ``install(node)``, on every node right after ``SyncObj.__init__``:
* leader side: per follower, the lowest ``next_node_idx`` a failed reset reply reported in this
  term is a floor; a later failed reset reply above the floor is lowered to it, until a success
  reply (or a new term) clears it. A lower nextIndex is always safe: the follower re-checks
  prevLogTerm and overwrites only what does not match.
* follower side: a failed reset reply never names more than ``commitIndex + 1`` (committed entries
  are on the leader, so the leader can resume right after them), which jumps over the whole
  divergent tail in one step instead of one entry per round.
Either side alone stops the livelock (the leader side alone backs off one entry per round).

Also pipelining: on a success reply that raises matchIndex, the leader sets ``nextIndex`` to the
reply's index (L1079-1082), below the batches already in flight, so the next round sends them
again; the follower truncates on any ``prevLogIdx`` below its last index, matching or not
(L991-1004), and appends them again ("truncating already-applied log entries": 20 times in 1,000
pipelined 1 KiB pushes, tests/test_pipelined_replication.py). Raft's rule is nextIndex =
max(nextIndex, matchIndex + 1) on success; ``keep_next_index`` restores it after each success.

Also (a guard, from reading the code, not observed): an 'append_entries' without ``prevLogIdx``
whose 'serialized' is None (the leader wants to send a snapshot but has no chunk ready) skips the
log-matching check and still runs ``commitIndex = min(leader_commit, lastIndex)`` (L1027-1033), so
a follower with a divergent tail could commit and apply it. ``commit_guard`` keeps such a message
from raising the commit index.
"""
from __future__ import annotations

from typing import Any

from pysyncobj import SyncObj


def install(node: SyncObj) -> None:
    """Wrap ``node``'s transport so the back-off cannot be overwritten (see the module docstring)."""
    transport = node._SyncObj__transport
    deliver = transport._onMessageReceivedCallback
    send = transport.send
    floors: dict[Any, tuple[int, int]] = {}           # peer -> (term, floor)

    def on_message(peer: Any, message: Any) -> None:
        in_flight_from = None
        if isinstance(message, dict):
            kind = message.get("type")
            if kind == "next_node_idx" and node._isLeader():
                message = leader_filter(floors, peer, message, node.raftCurrentTerm)
                if message.get("success") and not message.get("reset"):
                    in_flight_from = node._SyncObj__raftNextIndex.get(peer)
            elif kind == "append_entries":
                message = commit_guard(message, node._SyncObj__raftCommitIndex)
        deliver(peer, message)
        if in_flight_from is not None:
            keep_next_index(node._SyncObj__raftNextIndex, peer, in_flight_from)

    def send_hinted(peer: Any, message: Any) -> Any:
        if isinstance(message, dict) and message.get("type") == "next_node_idx":
            message = follower_hint(message, node._SyncObj__raftCommitIndex)
        return send(peer, message)

    transport.setOnMessageReceivedCallback(on_message)
    transport.send = send_hinted
    node._raftps_backoff_fix = True


def leader_filter(floors: dict, peer: Any, message: dict, term: int) -> dict:
    """Leader side: never let a failed reset reply raise nextIndex above the lowest one seen."""
    if message.get("success"):
        floors.pop(peer, None)
        return message
    if not message.get("reset"):
        return message
    index = message["next_node_idx"]
    seen_term, floor = floors.get(peer, (None, None))
    if seen_term != term or index <= floor:
        floors[peer] = (term, index)
        return message
    return dict(message, next_node_idx=floor)


def keep_next_index(next_index: dict, peer: Any, before: int) -> None:
    """Leader side: a success reply never moves nextIndex back below what is already in flight."""
    if peer in next_index and next_index[peer] < before:
        next_index[peer] = before


def follower_hint(message: dict, commit_index: int) -> dict:
    """Follower side: a failed reset reply asks for at most commitIndex + 1."""
    if message.get("reset") and not message.get("success") and message["next_node_idx"] > commit_index + 1:
        return dict(message, next_node_idx=commit_index + 1)
    return message


def commit_guard(message: dict, commit_index: int) -> dict:
    """An append_entries that proves nothing about the follower's log cannot raise its commit."""
    if "prevLogIdx" in message or message.get("serialized") is not None:
        return message
    if message.get("commit_index", 0) > commit_index:
        return dict(message, commit_index=commit_index)
    return message


# ---- the Raft port's reads before authentication ---------------------------------------------
# pysyncobj (tcp_connection.py, __processRead / __processParseMessage) appends whatever arrives to
# the connection's read buffer until the 4-byte length prefix is satisfied, for any length up to
# 2 GiB, and only then checks the message's Fernet token. So anyone who can reach the Raft port
# could make a node hold 2 GiB per connection and spend its tick thread re-copying the growing
# buffer (`readBuffer += incoming` is quadratic), stalling heartbeats. A message that declares
# more than the limit is refused at its prefix: the first message of a connection (before it
# proved the secret) may be small only; later ones as large as a legitimate peer sends.
FIRST_MESSAGE_LIMIT = 64 << 10
MESSAGE_LIMIT = 256 << 20          # largest legit: an append_entries batch (4 MiB) or snapshot chunk


def limit_peer_reads() -> None:
    """Patch pysyncobj's TcpConnection (all connections of this process) to refuse oversized
    length prefixes before buffering them. Idempotent."""
    import struct

    from pysyncobj.tcp_connection import TcpConnection

    if getattr(TcpConnection, "_raftps_read_limit", False):
        return
    read, parse = TcpConnection._TcpConnection__processRead, TcpConnection._TcpConnection__processParseMessage

    def process_read(self: TcpConnection) -> bool:
        more = read(self)
        buffer = self._TcpConnection__readBuffer
        if len(buffer) >= 4:
            declared = struct.unpack("i", buffer[:4])[0]
            limit = MESSAGE_LIMIT if getattr(self, "_raftps_parsed", 0) else FIRST_MESSAGE_LIMIT
            if not 0 <= declared <= limit:
                self.disconnect()
                return False
        return more

    def process_parse(self: TcpConnection) -> Any:
        message = parse(self)
        if message is not None:
            self._raftps_parsed = getattr(self, "_raftps_parsed", 0) + 1
        return message

    disconnect = TcpConnection.disconnect

    def disconnect_and_forget(self: TcpConnection) -> None:
        self._raftps_parsed = 0          # pysyncobj reuses an outgoing connection's object to redial
        disconnect(self)

    TcpConnection._TcpConnection__processRead = process_read
    TcpConnection._TcpConnection__processParseMessage = process_parse
    TcpConnection.disconnect = disconnect_and_forget
    TcpConnection._raftps_read_limit = True


# pysyncobj checks a connection's timeout only when its socket has an event, so a connection that
# never sends a byte stays open forever: anyone can fill the node's file descriptors and make every
# tick's poll() walk thousands of idle sockets. Incoming connections that have not said who they are
# (transport._unknownConnections) get UNKNOWN_MAX_AGE seconds to do so, and at most UNKNOWN_MAX of
# them are kept (the oldest go first). A peer identifies itself in its first two messages.
UNKNOWN_MAX_AGE = 5.0
UNKNOWN_MAX = 64


def limit_unknown_connections(node: SyncObj) -> None:
    """Close incoming Raft connections that stay anonymous too long or are too many (tick callback)."""
    import time

    transport = node._SyncObj__transport

    def sweep() -> None:
        unknown = getattr(transport, "_unknownConnections", None)
        if not unknown:
            return
        now = time.monotonic()
        by_age = sorted(unknown, key=lambda c: c.__dict__.setdefault("_raftps_seen", now))
        excess = len(by_age) - UNKNOWN_MAX
        for i, conn in enumerate(by_age):
            if i < excess or now - conn._raftps_seen > UNKNOWN_MAX_AGE:
                conn.disconnect()

    node.addOnTickCallback(sweep)


# ---- ReadIndex's leadership confirmation round (raftps.node.RaftNode._serve_reads) -------------
# pysyncobj gives no hook for "did a majority hear from me, as leader of my term, after moment X":
# its 'next_node_idx' replies carry no term and no request id, a follower does not answer every
# 'append_entries' (not one that installs no snapshot chunk, nor one of a lower term), and
# ``__lastResponseTime`` is wall-clock-like bookkeeping for leaderFallbackTimeout. So the leader
# sends its own message on the same peer connection: {'type': READ_PROBE, 'term', 'round'}; every
# node answers at once, from its tick thread, with {'type': READ_ACK, 'term': its current term,
# 'round'}. Neither reaches pysyncobj's handler (it would ignore unknown types anyway), neither
# changes any Raft state. A node without this code ignores probes: reads then time out (Retry),
# they are never served stale.
READ_PROBE = "raftps_read_probe"
READ_ACK = "raftps_read_ack"


def install_read_probes(node: SyncObj, on_ack: Any) -> None:
    """Answer probes and pass acks to ``on_ack(peer, term, round)`` (both in the tick thread)."""
    transport = node._SyncObj__transport
    deliver = transport._onMessageReceivedCallback

    def on_message(peer: Any, message: Any) -> None:
        if isinstance(message, dict):
            kind = message.get("type")
            if kind == READ_PROBE:
                transport.send(peer, {"type": READ_ACK, "term": node.raftCurrentTerm, "round": message.get("round")})
                return
            if kind == READ_ACK:
                term, round_ = message.get("term"), message.get("round")
                if type(term) is int and type(round_) is int:
                    on_ack(peer, term, round_)
                return
        deliver(peer, message)

    transport.setOnMessageReceivedCallback(on_message)


def send_read_probe(node: SyncObj, peer: Any, term: int, round_: int) -> bool:
    """Leader: ask ``peer`` for its current term (tick thread); False if it is not connected."""
    return node._SyncObj__transport.send(peer, {"type": READ_PROBE, "term": term, "round": round_})
