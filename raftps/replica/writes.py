"""The write path at the leader: a write's payload to a majority of the members' data planes,
then a small entry naming it through group commit into the log, then the state machine's answer.

The leader writes the payload to its own PayloadStore, streams it to every peer's data plane, and
once a majority (itself included) holds it, proposes the entry. Small payloads travel inside it.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import msgpack
import numpy as np

from raftps import codec
from raftps.server.group_commit import GroupCommit
from raftps.instruments import Instruments
from raftps.server.payloads import PayloadStore, digest_of
from raftps.raft import NotApplied
from raftps.replica.config import NodeConfig
from raftps.replica.membership import Membership


class WritePath:
    def __init__(self, config: NodeConfig, membership: Membership, payloads: PayloadStore,
                 group_commit: GroupCommit, instruments: Instruments):
        self._config = config
        self._membership = membership
        self._payloads = payloads
        self.group_commit = group_commit
        self._instruments = instruments

    def submit(self, command: dict, tensors: dict[str, np.ndarray] | None = None,
               on_applied: Callable[[dict], Any] | None = None, payload_name: str | None = None) -> Any:
        """Replicate one command and return the state machine's result (or ``on_applied``'s value,
        computed in the log's thread right after the entry is applied). Raises NotApplied.
        A payload is named ``payload_name`` (NAME-NUMBER), by default the write's client and seq."""
        config = self._config
        started = time.perf_counter()
        deadline = time.monotonic() + config.request_timeout
        if tensors:
            size = sum(a.nbytes for a in tensors.values())
            if size <= config.inline_bytes:
                command["inline"] = codec.encode_bytes({"tensors": tensors})
            else:
                # One hash pass (BLAKE3) names the payload and is the digest every peer's frame tag
                # signs; the payload goes to the peers while this thread writes our own copy.
                ordered, digest, content = digest_of(tensors)
                pid = f"{payload_name or command['client'] + '-' + str(command['seq'])}-{content}"
                majority = self._membership.majority
                needed = majority - 1
                acks = self._membership.peers.replicate(pid, ordered, needed, timeout=config.request_timeout,
                                                        digest=digest, meanwhile=lambda: self._payloads.put(pid, ordered))
                if acks < needed:
                    raise NotApplied(f"payload reached {acks + 1} of {self._membership.size} nodes, "
                                     f"a majority is {majority}", applied=False)
                command["payload"] = pid
        done = threading.Event()
        box: list = []

        def callback(result: Any, error: NotApplied | None) -> None:
            if error is None and on_applied is not None:
                result = on_applied(result)
            box.append((result, error))
            done.set()

        proposed = time.perf_counter()
        # The commit gets its own request timeout: a payload on a slow link may have taken longer
        # than that to reach a majority, and the entry is small.
        deadline = max(deadline, time.monotonic() + config.request_timeout)
        # a barrier's reader runs right after its apply: alone, or later writes would be in its state
        self.group_commit.propose(msgpack.packb(command, use_bin_type=True), callback, alone=command["op"] == "barrier")
        if not done.wait(max(0.0, deadline - time.monotonic())):
            raise NotApplied("no commit before the request timeout", applied=None)
        result, error = box[0]
        if error is not None:
            raise error
        now = time.perf_counter()
        self._instruments.commit_seconds.observe(now - proposed)
        if command["op"] != "barrier":       # reads commit barriers: their latency is in commit_seconds
            self._instruments.write_seconds.observe(now - started)
        return result
