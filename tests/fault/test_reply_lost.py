"""Case 9: the leader commits a push, its reply never reaches the client, the leader is killed;
the client's retry of the same (client_id, seq) must be applied exactly once."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from raftps import RaftpsError, Unavailable
from raftps.chaos import netns
from raftps.chaos.harness import Harness, assert_clean
from raftps.chaos.history import FAILED, OK, PUSH, UNKNOWN, History, push_gradient
from raftps.chaos.workload import NAME

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


def test_reply_lost_after_commit(tmp_path) -> None:
    with Harness("reply-lost", str(tmp_path), base_port=7710, netns=True) as h:
        h.load(12.0)
        h.wait(2.0)
        lead = h.leader()
        follower = h.follower()
        port = h.cluster.base_port + 100 + lead
        pusher = h.cluster.client([h.cluster.client_address(lead)], timeout=20.0, attempt_timeout=6.0)
        pusher.stats()          # connect and pass the hello while replies still get through
        pusher.addresses = [h.cluster.client_address(i) for i in (lead, *h.net.others(lead))]
        # Data from the leader's client port to the root namespace vanishes; the handshake and pure
        # ACKs (<= 52 bytes) pass, so requests still arrive and are committed.
        out = ["-A", "OUTPUT", "-d", h.net.bridge_ip, "-p", "tcp", "--sport", str(port)]
        h.net.iptables(lead, *out, "--tcp-flags", "SYN", "SYN", "-j", "ACCEPT")
        h.net.iptables(lead, *out, "-m", "length", "--length", "53:65535", "-j", "DROP")
        k = h.workload._next_k()
        op = h.history.begin(PUSH, client=99, seq=0, k=k)

        def push() -> None:
            with pusher as c:
                try:
                    History.finish(op, OK, c.push({NAME: push_gradient(h.workload.n, k)}))
                except Unavailable as exc:
                    History.finish(op, UNKNOWN, error=exc)
                except RaftpsError as exc:
                    History.finish(op, FAILED, error=exc)
        t = threading.Thread(target=push, daemon=True)
        t.start()
        committed = False
        with h.cluster.client([h.cluster.client_address(follower)], timeout=1.0) as probe:
            # Bounded, and generous: under the background load a 2-core CI machine took over 5 s.
            deadline = time.monotonic() + 15.0
            while not committed and time.monotonic() < deadline:
                try:
                    committed = probe.pull([NAME], linearizable=False)[0][NAME][k] == 1.0
                except RaftpsError:
                    pass
                time.sleep(0.02)
        answered_before_kill = op.outcome is not None
        h.event(f"kill leader n{lead} after commit")
        h.kill(lead)
        t.join(25.0)
        h.net.heal(lead)
        h.cluster.start_node(lead)
        result, line = h.finish(retried_push=op.outcome, committed_before_kill=committed)
        final = h.cluster.client(timeout=5.0).pull([NAME])[0][NAME]
    assert committed and not answered_before_kill, "the setup did not lose the reply of a committed push"
    assert op.outcome == OK, f"the retry did not get a definite answer: {op.error}"
    assert final[k] == 1.0
    assert_clean(result, line)
