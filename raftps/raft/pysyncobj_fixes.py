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
  divergent tail in one step instead of one entry per round. The last applied index counts as
  committed too: after a snapshot load the journal's commit index may lag the snapshot.
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

Also snapshot streaming (``SnapshotStream``; a follower failed forever with ``truncated frame`` on a
large snapshot under load). The leader streams its snapshot file in 1 MiB chunks
({'serialized': (data, isFirst, isLast)}, syncobj.py L1308-1329), the follower appends each to its
one open ``.1.tmp`` and installs it on isLast (serializer.py setTransmissionData). Nothing checks
that the chunks are contiguous, and:
* the follower answers no chunk but the last, so the leader reads nothing from it during a
  transfer and its TcpConnection closes after ``connectionTimeout`` (4 s) of no reads: any transfer
  longer than that (a large snapshot on a loaded machine) is cut, every time;
* the chunks in the dead connection's write buffer are lost, but the leader cancels the transfer
  only if a send round finds the peer disconnected (L1258-1261). The leader redials at once
  (transport.py _onDisconnected) and, when the follower answers the handshake within the 0.1 s
  until the next round, the transfer goes on at its old offset on the new connection: the
  follower's file misses whole chunks, fails to load, and the transfer restarts, to be
  cut again at 4 s.
So: the follower acknowledges every chunk (a ``next_node_idx`` that is neither success nor reset,
which a leader only counts as a response), which keeps the connection and the leader's quorum
alive; the leader starts a new transfer on every (re)connection; and each chunk carries its
stream id and offset, so a follower refuses any chunk that is not the next byte of the stream it
is assembling (a short or spliced file is never installed) and asks the leader to start over.
Stock pysyncobj peers ignore the extra key and the unknown message type.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from pysyncobj import SyncObj

log = logging.getLogger("raftps.pysyncobj_fixes")
RESTART_SNAPSHOT = "raftps_restart_snapshot"     # follower -> leader: start the transfer over


def install(node: SyncObj) -> None:
    """Wrap ``node``'s transport: the back-off fix and snapshot streaming (see the module docstring)."""
    transport = node._SyncObj__transport
    deliver = transport._onMessageReceivedCallback
    send = transport.send
    floors: dict[Any, tuple[int, int]] = {}           # peer -> (term, floor)
    stream = SnapshotStream(node, send)

    def on_message(peer: Any, message: Any) -> None:
        in_flight_from = None
        if isinstance(message, dict):
            kind = message.get("type")
            if kind == "next_node_idx" and node._isLeader():
                message = leader_filter(floors, peer, message, node.raftCurrentTerm)
                if message.get("success") and not message.get("reset"):
                    in_flight_from = node._SyncObj__raftNextIndex.get(peer)
            elif kind == "append_entries":
                message = commit_guard(stream.receive(peer, message), node._SyncObj__raftCommitIndex)
            elif kind == RESTART_SNAPSHOT:
                stream.restart(peer, message.get("stream"))
                return
        deliver(peer, message)
        if in_flight_from is not None:
            keep_next_index(node._SyncObj__raftNextIndex, peer, in_flight_from)

    def send_hinted(peer: Any, message: Any) -> Any:
        if isinstance(message, dict):
            if message.get("type") == "next_node_idx":
                # what this node applied was committed too: after a snapshot load the journal's
                # commit index can be older than the snapshot (see follower_hint)
                message = follower_hint(message, max(node._SyncObj__raftCommitIndex, node.raftLastApplied))
            elif message.get("serialized"):
                message = stream.tag(peer, message)
        return send(peer, message)

    connected = transport._onNodeConnectedCallback

    def on_connected(peer: Any) -> None:
        stream.restart(peer)          # chunks may have died with the old connection
        connected(peer)

    transport.setOnMessageReceivedCallback(on_message)
    transport.send = send_hinted
    transport.setOnNodeConnectedCallback(on_connected)
    node._raftps_backoff_fix = True


class SnapshotStream:
    """Both ends of pysyncobj's snapshot transfer, checked (see the module docstring)."""

    def __init__(self, node: SyncObj, send: Any):
        self.node, self.send = node, send
        self.serializer = node._SyncObj__serializer
        self.sent: dict[Any, list] = {}          # leader: peer -> [stream id, offset of the next chunk]
        self.receiving: list | None = None       # follower: [stream id, bytes assembled so far]

    def tag(self, peer: Any, message: dict) -> dict:
        """Leader: mark a chunk with its stream and offset."""
        data, first, _ = message["serialized"]
        if first or peer not in self.sent:
            self.sent[peer] = [os.urandom(8), 0]
        stream = self.sent[peer]
        message = dict(message, raftps_chunk=tuple(stream))
        stream[1] += len(data)
        return message

    def restart(self, peer: Any, stream: bytes | None = None) -> None:
        """Leader: the next chunk to ``peer`` starts a new transfer (only if ``stream`` is the
        current one, so refusals of chunks already in flight do not restart it again)."""
        if stream is None or self.sent.get(peer, [None])[0] == stream:
            self.serializer.cancelTransmisstion(peer)
            self.sent.pop(peer, None)

    def receive(self, peer: Any, message: dict) -> dict:
        """Follower: pass the next chunk of the stream being assembled (and acknowledge it);
        turn any other chunk into a plain heartbeat and ask the leader to start over."""
        chunk, serialized = message.get("raftps_chunk"), message.get("serialized")
        if chunk is None or not serialized or message.get("term", 0) < self.node.raftCurrentTerm:
            return message            # untagged (stock leader), or one pysyncobj ignores anyway
        data, first, last = serialized
        stream, offset = chunk
        if first:
            self.receiving = [stream, 0]
        if self.receiving != [stream, offset]:
            if self.receiving and self.receiving[0] == stream:
                log.warning("snapshot chunk at offset %d is not the next one (%d bytes assembled): "
                            "dropping the partial snapshot, asking the leader to start over",
                            offset, self.receiving[1])
                self.receiving = None     # pysyncobj still holds its partial file; no chunk reaches it
            # Else a chunk of another stream: one whose first chunk we missed, or an old one still
            # draining from a dead connection while the new one is assembled. Either way it
            # is not written; the leader starts over only if it names its current stream.
            self.send(peer, {"type": RESTART_SNAPSHOT, "stream": stream})
            return dict(message, serialized=None)
        self.receiving[1] += len(data)
        if last:
            self.receiving = None     # pysyncobj answers the last chunk itself
        else:
            self.send(peer, {"type": "next_node_idx", "reset": False, "success": False,
                             "next_node_idx": self.node._SyncObj__getCurrentLogIndex() + 1})
        return message


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
    """Follower side: a failed reset reply asks for at most ``commit_index`` + 1, where
    ``commit_index`` is the highest index this node knows committed: its commit index or, if
    higher, its last applied index. pysyncobj restores the commit index from the journal's meta
    (written at most once a second) and does not raise it to a snapshot it loads, so a replica
    restarted on a snapshot taken within a second of its start (a learner stopped right after
    catching up, hosting.py) has commit 1 below a log that starts at the snapshot: asking for
    commit + 1 = 2 then never matched (the entry before 2 is not in its log), and it asked again
    forever (tests/groups/test_elastic.py's refill, 3 times in 10 runs)."""
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
# 2 GiB, and only then checks the message's signature (peer_mac.py; stock: its Fernet token). So anyone who can reach the Raft port
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
            # pysyncobj stamps the read time once, before handling all it read. A follower that
            # read tens of MiB of snapshot chunks at once took > 4 s (the connection timeout) to
            # handle them, and its next send closed the live connection mid-transfer.
            self._TcpConnection__lastReadTime = time.monotonic()
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


# ---- ReadIndex's leadership confirmation round (raft/read_index.py, ReadIndex.serve) ----------
# pysyncobj gives no hook for "did a majority hear from me, as leader of my term, after moment X":
# its 'next_node_idx' replies carry no term and no request id, a follower does not answer every
# 'append_entries' (not one that installs no snapshot chunk, nor one of a lower term), and
# ``__lastResponseTime`` is wall-clock-like bookkeeping for leaderFallbackTimeout. So the leader
# sends its own message on the same peer connection: {'type': READ_PROBE, 'term', 'round'}; every
# node answers at once, from its tick thread, with {'type': READ_ACK, 'term': its current term,
# 'round'}. Neither reaches pysyncobj's handler (it would ignore unknown types anyway), neither
# changes any Raft state. A node without this code ignores probes: reads then time out (Retry),
# they are never served stale.
#
# Leases (read mode "lease") add one promise to the same exchange. A probe may carry 'lease':
# True; a node whose current term is the probe's then promises to grant no vote, and to start no
# election, for ``LeasePromise.window`` seconds (its minimum election timeout) from the moment it
# answers, and says so in its ack ('promise': window). pysyncobj 0.3.17 grants a vote to any
# candidate with a higher term and an up-to-date log, however recently it heard from a leader;
# without the promise a lease would be a guess about election timers. A promised node still takes
# a higher term it is told of (as pysyncobj does, so a node that was cut off and came back with a
# higher term still rejoins); it only withholds the vote. Every node also promises for one window
# after it starts, which covers a promise made just before a crash.
READ_PROBE = "raftps_read_probe"
READ_ACK = "raftps_read_ack"


def lease_clock() -> float:
    """Seconds that keep counting while the host is suspended (CLOCK_BOOTTIME): a leader whose
    host slept must see its lease expire, not resume it. CLOCK_MONOTONIC where there is none."""
    return time.clock_gettime(BOOTTIME) if BOOTTIME is not None else time.monotonic()


BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


class LeasePromise:
    """Until ``until`` (lease_clock) this node grants no vote and starts no election."""

    def __init__(self, window: float):
        self.window = window
        self.until = lease_clock() + window      # a restarted node keeps any promise it may have made
        self.votes_withheld = 0                  # status: request_vote messages answered "no"

    def extend(self, node: SyncObj) -> None:
        """Promise one more window from now (tick thread)."""
        self.until = max(self.until, lease_clock() + self.window)
        # pysyncobj's election deadline is time.monotonic(); stay at least `window` away from it
        later = time.monotonic() + self.window
        if node._SyncObj__raftElectionDeadline < later:
            node._SyncObj__raftElectionDeadline = later

    def release(self) -> None:
        """The leader gives its lease up (a leadership transfer): it may vote for the next one."""
        self.until = 0.0

    def active(self) -> bool:
        return lease_clock() < self.until


def install_read_probes(node: SyncObj, on_ack: Any, promise: LeasePromise) -> None:
    """Answer probes (promising when asked), withhold votes while ``promise`` holds, and pass acks
    to ``on_ack(peer, term, round, promised_seconds)`` (all in the tick thread)."""
    transport = node._SyncObj__transport
    deliver = transport._onMessageReceivedCallback

    def on_message(peer: Any, message: Any) -> None:
        if isinstance(message, dict):
            kind = message.get("type")
            if kind == READ_PROBE:
                term = node.raftCurrentTerm
                ack = {"type": READ_ACK, "term": term, "round": message.get("round")}
                if message.get("lease") is True and message.get("term") == term:
                    promise.extend(node)
                    ack["promise"] = promise.window
                transport.send(peer, ack)
                return
            if kind == READ_ACK:
                term, round_, promised = message.get("term"), message.get("round"), message.get("promise", 0.0)
                if type(term) is int and type(round_) is int and type(promised) in (int, float):
                    on_ack(peer, term, round_, float(promised))
                return
            if kind == "request_vote" and promise.active():
                # pysyncobj's handler takes the higher term and steps down as usual, then finds the
                # candidate's log "older" than its own and answers nothing: the vote is withheld.
                promise.votes_withheld += 1
                message = dict(message, last_log_term=-1)
        deliver(peer, message)

    transport.setOnMessageReceivedCallback(on_message)


def send_read_probe(node: SyncObj, peer: Any, term: int, round_: int, lease: bool = False) -> bool:
    """Leader: ask ``peer`` for its current term, and with ``lease`` for its promise (tick thread);
    False if it is not connected."""
    message = {"type": READ_PROBE, "term": term, "round": round_}
    if lease:
        message["lease"] = True
    return node._SyncObj__transport.send(peer, message)
