"""A process without the peer secret talks to the Raft port and the data-plane port of a real
3-node cluster with well-formed messages: pysyncobj-shaped pickles (plain, zlib'd, signed with a
wrong secret, and Fernet-encrypted as pysyncobj's own password would) and data-plane frames. The nodes apply nothing and never
unpickle those bytes: each pickle carries a canary that would create a directory if unpickled.
The same canary against an `--insecure` node does run, which shows that the check can fail."""
import os
import pickle
import select
import shutil
import socket
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
from pysyncobj.encryptor import HAS_CRYPTO, getEncryptor

from raftps import codec

from raftps.server import dataplane
from raftps.tools.localcluster import LocalCluster
from raftps.raft.peer_mac import PeerMac
from raftps.server.node import default_payload_dir
from raftps.server.payloads import payload_id
from security_helpers import assert_nothing_applied, raft_state, rss_kib, state
from tests.conftest import wait_converged

fernet = getEncryptor if HAS_CRYPTO else None      # pysyncobj's own password framing, when installed

BASE = 10070
LONE = 10080


class Canary:
    """Unpickling this calls os.mkdir(path): proof that a node ran code from the network."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def pysyncobj_messages(canary: str, peer: str) -> list[bytes]:
    """Length-prefixed messages as pysyncobj frames them (tcp_connection.py send())."""
    entry = {"type": "append_entries", "term": 10 ** 6, "commit_index": 10 ** 6, "prevLogIdx": 0,
             "prevLogTerm": 0, "entries": [(b"\x00" + pickle.dumps(Canary(canary + "-cmd"), 2), 1, 10 ** 6)],
             "canary": Canary(canary)}
    bodies = [
        pickle.dumps(Canary(canary), 2),                                  # a bare pickle
        zlib.compress(pickle.dumps(peer, 2)),                             # "I am node 1", unencrypted
        zlib.compress(pickle.dumps(entry, 2)),                            # an append_entries, unencrypted
        PeerMac(b"not the cluster secret").encrypt_at_time(               # signed with a wrong secret
            zlib.compress(pickle.dumps(entry, 2)), int(time.monotonic())),
    ]
    if fernet is not None:                                                # as pysyncobj's password framed it
        bodies.append(fernet("not the cluster secret").encrypt_at_time(zlib.compress(pickle.dumps(entry, 2)),
                                                                        int(time.monotonic())))
    return [struct.pack("i", len(b)) + b for b in bodies]


def _send_to_raft_port(port: int, messages: list[bytes]) -> None:
    for message in messages:
        for together in (False, True):      # alone on a connection, and after the others
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                try:
                    s.sendall(b"".join(messages) if together else message)
                    s.settimeout(2.0)
                    s.recv(100)             # the node closes the connection (or says nothing)
                except OSError:
                    pass


def test_raft_port_without_the_secret_applies_nothing_and_unpickles_nothing(module_cluster, tmp_path):
    cluster = module_cluster
    with cluster.client(timeout=10) as c:
        c.create("ns.w", np.zeros(8, np.float32), optimizer={"name": "sgd", "lr": 1.0})
    time.sleep(0.5)
    before, raft_before = state(cluster), raft_state(cluster)
    canary = str(tmp_path / "canary")
    for node in (1, 2, 3):
        _send_to_raft_port(cluster.base_port + node, pysyncobj_messages(canary, cluster.peers[0]))
    time.sleep(1.0)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("canary")], "a node unpickled network bytes"
    assert state(cluster) == before
    assert_nothing_applied(raft_before, raft_state(cluster))
    with cluster.client(timeout=10) as c:         # and the cluster still commits
        c.push({"ns.w": np.ones(8, np.float32)})


def test_raft_port_refuses_a_huge_first_message_at_its_prefix(module_cluster):
    cluster = module_cluster
    pid = cluster.pid(2)
    peak = rss_kib(pid, "VmHWM")
    before = state(cluster)
    chunk = bytes(1 << 20)
    with socket.create_connection(("127.0.0.1", cluster.base_port + 2), timeout=5) as s:
        sent = 0
        try:
            s.sendall(struct.pack("i", 2 ** 31 - 1))
            while sent < 256 << 20:                # pysyncobj alone would buffer all of it
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass                                   # the node hung up: what we want
    assert sent < 256 << 20, "the node kept reading a 2 GiB message from a stranger"
    assert rss_kib(pid, "VmHWM") < peak + 64 * 1024
    assert state(cluster) == before


def test_data_plane_without_the_secret_stores_nothing(module_cluster):
    cluster = module_cluster
    tensors = {"w": np.ones(16, np.float32)}
    pid = payload_id("stranger", 1, tensors)
    for node in (1, 2, 3):
        with socket.create_connection(("127.0.0.1", cluster.base_port + 200 + node), timeout=5) as s:
            codec.send_frame(s, {"nonce": os.urandom(16), "version": dataplane.VERSION})   # today's protocol
            challenge = codec.recv_frame(s)
            assert set(challenge) == {"nonce", "proof", "version"}
            codec.send_frame(s, {"proof": os.urandom(32)})              # a guess
            refusal = codec.recv_frame(s)
            assert refusal["error"] == "AuthenticationFailed" and "wrong cluster secret" in refusal["message"]
            try:
                codec.send_frame(s, {"op": "put", "pid": pid, "tensors": tensors})
                assert codec.recv_frame(s) is None
            except (ConnectionError, OSError):
                pass
        assert pid not in os.listdir(default_payload_dir(cluster.data_dir(node)))


def test_the_canary_does_run_on_an_insecure_node(tmp_path):
    """Why --insecure is for loopback only, and proof that the canary test above can fail."""
    argv = [sys.executable, "-m", "raftps", "serve", "--id", "1", "--peers", f"127.0.0.1:{LONE + 1}",
            "--data-dir", str(tmp_path / "node"), "--insecure"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    canary = str(tmp_path / "canary")
    try:
        lines = [proc.stdout.readline() for _ in range(2)]          # the --insecure warning, then serving
        assert any(b"node 1: raft" in line for line in lines), lines
        deadline = time.monotonic() + 10
        while not os.path.exists(canary) and time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", LONE + 1), timeout=2) as s:
                    s.sendall(pysyncobj_messages(canary, "x")[2])
                    time.sleep(0.3)
            except OSError:
                time.sleep(0.2)
        assert os.path.exists(canary)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(default_payload_dir(str(tmp_path / "node")), ignore_errors=True)   # its tmpfs payloads


def test_peers_authenticate_without_the_cryptography_package(tmp_path):
    """Peer messages are signed with hashlib's HMAC (peer_mac.py): a cluster whose nodes cannot
    import ``cryptography`` elects, replicates and agrees."""
    shim = tmp_path / "shim" / "cryptography"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    pythonpath = f"{tmp_path / 'shim'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    with LocalCluster(str(tmp_path / "run"), nodes=3, base_port=LONE + 200, env={"PYTHONPATH": pythonpath}) as cluster:
        cluster.start(timeout=60)
        with cluster.client(timeout=20) as c:
            c.create("nc.w", np.zeros(4, np.float32), optimizer={"name": "sgd", "lr": 1.0})
            c.push({"nc.w": np.ones(4, np.float32)})
            rows = wait_converged(c, 3)
        assert len({row["digest"] for row in rows}) == 1
        assert "hidden by the test" not in open(cluster.log_file(1)).read()


def test_silent_strangers_on_the_raft_port_are_closed(module_cluster):
    """pysyncobj alone keeps a connection that never sends a byte open forever."""
    cluster = module_cluster
    socks = [socket.create_connection(("127.0.0.1", cluster.base_port + 3), timeout=15) for _ in range(40)]
    try:
        with cluster.client(timeout=20) as c:            # the cluster commits meanwhile
            c.create("ns.s", np.zeros(8, np.float32), optimizer={"name": "sgd", "lr": 1.0})
            c.push({"ns.s": np.ones(8, np.float32)})
        deadline = time.monotonic() + 15
        open_ = set(socks)
        while open_ and time.monotonic() < deadline:
            readable, _, _ = select.select(list(open_), [], [], 0.5)
            for s in readable:                             # readable with nothing to read: closed
                try:
                    if s.recv(1) == b"":
                        open_.discard(s)
                except OSError:
                    open_.discard(s)
        assert not open_, f"{len(open_)} of 40 silent connections still open after 15 s"
    finally:
        for s in socks:
            s.close()
    assert all(r["role"] != "down" for r in cluster.status())
