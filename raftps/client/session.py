"""A client's session: the id and sequence numbers that make every write exactly-once.

Each session has a random client id, never reused, and numbers its writes 1, 2, ... in each
Raft group (a session per group). A write is retried with the same (client id, seq) until it
gets a definite answer, so a retry after a lost reply or a leader change is applied once.
"""
from __future__ import annotations

import threading
import uuid


class Session:
    def __init__(self) -> None:
        self.client_id = uuid.uuid4().hex
        self._seqs: dict[int, int] = {}             # Raft group -> the last seq this session used in it
        self._unanswered: dict[int, set[int]] = {}  # Raft group -> seqs sent and not answered yet
        self._lock = threading.Lock()

    def next_seq(self, raft_group: int) -> tuple[int, int]:
        """(seq, ack) of a new write in ``raft_group``: ack is the lowest seq not answered yet
        (pushes sent by push_async may be in flight), so the store keeps their results for a retry."""
        with self._lock:
            seq = self._seqs[raft_group] = self._seqs.get(raft_group, 0) + 1
            unanswered = self._unanswered.setdefault(raft_group, set())
            unanswered.add(seq)
            return seq, min(unanswered)

    def answered(self, raft_group: int, seq: int, refused: bool) -> None:
        with self._lock:
            self._unanswered[raft_group].discard(seq)
            # Refused by the node before it reached any log (schema, role, limit): the seq was
            # never used, so the next write takes it (if none took a later one). Otherwise the
            # store would see this client's first write with ack > 1 and no session, and answer
            # SessionExpired.
            if refused and self._seqs[raft_group] == seq:
                self._seqs[raft_group] -= 1
