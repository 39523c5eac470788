"""Snapshot streaming to a restarted follower over a link we control: slow, lossy, deaf.

tests/test_snapshot_catchup.py failed on a loaded machine only: the leader read nothing from the
follower during a 64 MiB transfer (pysyncobj's follower answers the last chunk only), so its
connection timed out after 4 s; the leader redialled, the follower answered at once, and the
transfer went on at its old offset on the new connection, the chunks of the dead connection
missing: ``failed to load full dump ... truncated frame``, forever (raftps/pysyncobj_fixes.py).
Here node 1 sits behind a TCP forwarder in this process (it binds 127.0.0.2; its peer and client
addresses on 127.0.0.1 are the forwarder's), so the condition is forced, not hoped for:
* slow: leader -> node 1 at LINK_RATE, so the transfer outlasts the 4 s connection timeout;
* drop: one snapshot chunk message vanishes from an otherwise healthy connection;
* mute: node 1's replies on the connection carrying the transfer are lost (as when the leader
  reads nothing for 4 s), so the leader's connection times out inside a send and it redials.
Node 1 is killed, so the leader is node 2 or 3: a larger address, the side that dials node 1.
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time

import numpy as np

from raftps.raft.pysyncobj_fixes import RESTART_SNAPSHOT, install
from tests.conftest import wait_converged

N = 8 << 20                       # float32: a 32 MiB model, 32 snapshot chunks of 1 MiB
CHUNK_FRAME = 512 << 10           # a peer message this large is a snapshot chunk (entries are small)
LINK_RATE = 4 << 20               # bytes/s: ~33 MB of chunk frames take ~8 s, past the 4 s timeout


class Forwarder:
    """Forward 127.0.0.1:port to 127.0.0.2:port for node 1's three ports. On the Raft port, the
    direction from the dialling leader to node 1 is parsed into pysyncobj's length-prefixed
    messages, so whole chunk messages can be delayed or dropped; with ``mute``, what node 1 sends
    after a chunk went by is discarded on the connections accepted before the first chunk."""

    def __init__(self, base_port: int):
        self.raft_port = base_port + 1
        self.rate: float | None = None           # bytes/s leader -> node 1
        self.drop: int | None = None             # drop the n-th chunk message (1-based)
        self.mute = False
        self.chunks = 0                          # chunk messages seen leader -> node 1, all connections
        self.dropped = self.muted = 0
        self.lock = threading.Lock()
        self.servers = [socket.create_server(("127.0.0.1", base_port + offset)) for offset in (1, 101, 201)]
        for server in self.servers:
            threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def _accept(self, server: socket.socket) -> None:
        port = server.getsockname()[1]
        while True:
            try:
                downstream, _ = server.accept()
            except OSError:
                return                           # closed by close()
            try:
                upstream = socket.create_connection(("127.0.0.2", port), timeout=5)
            except OSError:
                downstream.close()               # node 1 is down: the dialler sees it and retries
                continue
            upstream.settimeout(None)
            if port != self.raft_port:
                threading.Thread(target=self._pump, args=(downstream, upstream), daemon=True).start()
                threading.Thread(target=self._pump, args=(upstream, downstream), daemon=True).start()
                continue
            conn = {"chunks": 0, "mute": self.mute and self.chunks == 0}
            threading.Thread(target=self._frames, args=(downstream, upstream, conn), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, downstream, conn), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, conn: dict | None = None) -> None:
        try:
            while data := src.recv(1 << 16):
                if conn and conn["mute"] and conn["chunks"]:
                    self.muted += len(data)      # node 1's acknowledgements never reach the leader
                    continue
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    def _frames(self, src: socket.socket, dst: socket.socket, conn: dict) -> None:
        buf, due = bytearray(), time.monotonic()
        try:
            while data := src.recv(1 << 16):
                buf += data
                while len(buf) >= 4 and len(buf) >= 4 + (size := struct.unpack("i", buf[:4])[0]):
                    frame, buf = bytes(buf[:4 + size]), buf[4 + size:]
                    if size >= CHUNK_FRAME:
                        with self.lock:
                            self.chunks += 1
                            conn["chunks"] += 1
                            drop = self.chunks == self.drop
                            self.dropped += drop
                        if drop:
                            continue
                    if self.rate:
                        due = max(due, time.monotonic()) + len(frame) / self.rate
                        time.sleep(max(0.0, due - time.monotonic()))
                    dst.sendall(frame)
        except OSError:
            pass
        for s in (src, dst):
            s.close()


def node1_behind_the_forwarder(node: int) -> list[str]:
    """LocalCluster command_prefix: node 1 binds 127.0.0.2 and does not campaign within a test (a
    restarted node that times out bumps the term and ignores the leader's chunks of the older
    term until a new leader: another path, kept out so each test forces only its own condition)."""
    return ["sh", "-c", 'exec "$@" --bind-host 127.0.0.2 --election-timeout 10', "sh"] if node == 1 else []


def catch_up_through(make_cluster, base: int, **link) -> tuple[Forwarder, str, float]:
    """Kill node 1, compact the log past it, restart it behind the forwarder; return the
    forwarder, node 1's log and the seconds node 1 took to converge."""
    fwd = Forwarder(base)                           # plain while the cluster forms
    try:
        cl = make_cluster(base, extra_args=["--compaction-entries", "20"], command_prefix=node1_behind_the_forwarder)
        with cl.client(timeout=60) as c:
            c.create("big", np.zeros(N, np.float32), optimizer={"name": "sgd", "lr": 0.01})
            c.create("tick", np.zeros(256, np.float32), optimizer={"name": "sgd", "lr": 0.01})
            cl.kill(1)
            rng = np.random.default_rng(5)          # incompressible, as real gradients are
            c.push({"big": rng.standard_normal(N, dtype=np.float32)})
            for _ in range(30):                     # compact the leader's log past node 1
                c.push({"tick": np.ones(256, np.float32)})
            leader = next(r for r in c.status() if r["role"] == "leader")
            assert leader["node"] != 1 and leader["snapshot_index"] > 4
            fwd.rate, fwd.drop, fwd.mute = link.get("rate"), link.get("drop"), link.get("mute", False)
            started = time.monotonic()
            cl.start_node(1)
            try:
                rows = wait_converged(c, 3, timeout=45)
            finally:
                with open(cl.log_file(1)) as f:
                    node1_log = f.read()
            assert rows[0]["version"] == leader["version"]
            return fwd, node1_log, time.monotonic() - started
    finally:
        fwd.close()


def test_snapshot_transfer_longer_than_the_connection_timeout(make_cluster) -> None:
    fwd, node1_log, seconds = catch_up_through(make_cluster, 25700, rate=LINK_RATE)
    assert fwd.chunks >= 32
    assert "failed to load full dump" not in node1_log
    print(f"caught up in {seconds:.1f} s over a {LINK_RATE >> 20} MiB/s link, {fwd.chunks} chunk messages")


def test_a_lost_chunk_is_refused_and_the_transfer_restarts(make_cluster) -> None:
    fwd, node1_log, seconds = catch_up_through(make_cluster, 25720, drop=5)
    assert fwd.dropped == 1
    assert "failed to load full dump" not in node1_log, "a snapshot with a hole was assembled and loaded"
    assert "is not the next one" in node1_log        # node 1 saw the gap at the next chunk
    print(f"caught up in {seconds:.1f} s after a lost chunk, {fwd.chunks} chunk messages")


def test_a_reconnection_mid_transfer_restarts_it(make_cluster) -> None:
    """The original failure: the leader's connection times out in a send, it redials at once and
    node 1 answers before the next send round (pysyncobj cancels only if a round sees it down).
    Whether the leader still has chunks to read by then depends on its CPU (here it had queued all
    32 of them after ~3.5 s); the rule itself is pinned by the next test on any machine."""
    fwd, node1_log, seconds = catch_up_through(make_cluster, 25740, rate=LINK_RATE, mute=True)
    assert fwd.muted > 0
    assert "failed to load full dump" not in node1_log, "the transfer went on at its old offset"
    # The leader restarts the stream when it reconnects, before node 1 has to notice a gap.
    assert "is not the next one" not in node1_log
    print(f"caught up in {seconds:.1f} s after a reconnection, {fwd.chunks} chunk messages")


# ---- the same rules on one real SyncObj, no cluster: deterministic on any machine ----------------

def lone_node(tmp_path, port: int):
    """A pysyncobj node that never ticks (nothing binds or dials), with raftps's fixes installed
    over a transport whose sends are recorded; returns (node, its one peer, the sent messages)."""
    from pysyncobj import SyncObj, SyncObjConf
    conf = SyncObjConf(autoTick=False, fullDumpFile=str(tmp_path / "dump"), logCompactionBatchSize=1024)
    node = SyncObj(f"127.0.0.1:{port}", [f"127.0.0.1:{port + 1}"], conf)
    sent: list = []
    node._SyncObj__transport.send = lambda peer, message: sent.append(message) or False
    install(node)
    return node, next(iter(node._SyncObj__otherNodes)), sent


def test_a_reconnected_peer_gets_the_snapshot_from_its_first_byte(tmp_path) -> None:
    node, peer, _ = lone_node(tmp_path, 25790)
    try:
        (tmp_path / "dump").write_bytes(os.urandom(4096))
        serializer = node._SyncObj__serializer
        assert serializer.getTransmissionData(peer)[1:] == (True, False)
        assert serializer.getTransmissionData(peer)[1:] == (False, False)
        node._SyncObj__transport._onNodeConnected(peer)     # what pysyncobj calls on a (re)connection
        assert serializer.getTransmissionData(peer)[1:] == (True, False), "went on at the old offset"
    finally:
        node.destroy()


def test_a_stream_with_a_hole_is_never_installed(tmp_path) -> None:
    node, peer, sent = lone_node(tmp_path, 25792)
    try:
        on_message = node._SyncObj__transport._onMessageReceivedCallback
        blob = os.urandom(4096)

        def chunk(offset: int, stream: bytes = b"s1") -> dict:
            data = blob[offset:offset + 1024]
            return {"type": "append_entries", "term": 1, "commit_index": 0,
                    "serialized": (data, offset == 0, not data), "raftps_chunk": (stream, offset)}

        for offset in (0, 1024, 3072, 4096):                # the chunk at 2048 was lost
            on_message(peer, chunk(offset))
        assert not (tmp_path / "dump").exists(), "a snapshot with a hole was installed"
        assert {"type": RESTART_SNAPSHOT, "stream": b"s1"} in sent
        assert sum(m.get("type") == "next_node_idx" for m in sent) == 2    # chunks 0 and 1024 acked
        for offset in range(0, 4097, 1024):                 # the restarted stream, whole
            on_message(peer, chunk(offset, b"s2"))
            on_message(peer, chunk(2048, b"s1"))            # the old one, still draining: ignored
        assert (tmp_path / "dump").read_bytes() == blob
    finally:
        node.destroy()
