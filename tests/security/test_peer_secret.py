"""The peer secret: `raftps serve` will not run without one (except --insecure on loopback), and
on the data plane every frame after the handshake is authenticated and every payload checked."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from raftps import auth, codec
from raftps.server.dataplane import PeerLink
from raftps.server.node import default_payload_dir
from raftps.server.payloads import payload_id

BASE = 10010
LONE = 10020          # single-node starts of `serve`


def _serve(tmp_path, *args: str, bind: str = "127.0.0.1", timeout: float = 20.0) -> subprocess.CompletedProcess | None:
    """Run `raftps serve` for one node; its exit if it refused to start, None if it ran (then stopped)."""
    argv = [sys.executable, "-m", "raftps", "serve", "--id", "1", "--peers", f"{bind}:{LONE + 1}",
            "--data-dir", str(tmp_path / "node"), *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        proc.terminate()              # it is serving: what the caller expected in that case
        proc.communicate(timeout=30)
        return None
    finally:
        shutil.rmtree(default_payload_dir(str(tmp_path / "node")), ignore_errors=True)   # its tmpfs payloads


def test_serve_refuses_to_start_without_a_secret(tmp_path):
    refused = _serve(tmp_path)
    assert refused.returncode == 2 and "refusing to start without a peer secret" in refused.stderr
    assert "--insecure" in refused.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    refused = _serve(tmp_path, "--secret-file", str(empty))
    assert refused.returncode == 2 and "without a peer secret" in refused.stderr
    short = tmp_path / "short"
    short.write_text("0123456789\n")
    refused = _serve(tmp_path, "--secret-file", str(short))
    assert refused.returncode == 2 and "shorter than 16 bytes" in refused.stderr


def test_insecure_is_for_loopback_only(tmp_path):
    addr = "192.0.2.77"     # any non-loopback address: the node refuses before it binds anything
    refused = _serve(tmp_path, "--insecure", bind=addr)
    assert refused.returncode == 2 and "without a peer secret" in refused.stderr
    # And with a secret but no token, a non-loopback client port is refused too.
    secret = auth.make_secret_file(str(tmp_path / "secret"))
    refused = _serve(tmp_path, "--secret-file", secret, bind=addr)
    assert refused.returncode == 2 and "without a client token" in refused.stderr


def test_insecure_on_loopback_runs(tmp_path):
    assert _serve(tmp_path, "--insecure", timeout=3.0) is None


def _link(cluster, node: int = 1) -> PeerLink:
    return PeerLink(f"127.0.0.1:{cluster.base_port + 200 + node}", auth.read_secret_file(cluster.secret_file).encode())


def _stored(cluster, pid: str) -> bool:
    """Whether node 1's data plane holds payload ``pid`` (asked over a fresh link)."""
    link = _link(cluster)
    try:
        return link.call({"op": "get", "pid": pid})["found"]
    finally:
        link.close()


def test_a_payload_whose_digest_does_not_match_is_refused(module_cluster):
    tensors = {"w": np.arange(8, dtype=np.float32)}
    good = payload_id("sectest", 1, tensors)
    bad = good[:-8] + f"{(int(good[-8:], 16) ^ 1):08x}"
    link = _link(module_cluster)
    try:
        reply = link.call({"op": "put", "pid": bad, "tensors": tensors})
        assert reply["ok"] is False and "does not match its checksum" in reply["message"]
        assert link.call({"op": "get", "pid": bad})["found"] is False
        assert link.call({"op": "put", "pid": good, "tensors": tensors})["ok"] is True   # the check is real
        assert link.call({"op": "get", "pid": good})["found"] is True
    finally:
        link.close()


def test_every_data_plane_frame_is_authenticated(module_cluster):
    tensors = {"w": np.ones(4, dtype=np.float32)}
    pid = payload_id("sectest", 2, tensors)
    put = {"op": "put", "pid": pid, "tensors": tensors}
    # An authenticated connection, then a frame with a wrong tag: refused and the connection closed.
    link = _link(module_cluster)
    buffers = codec.encode(put)
    for b in buffers:
        link.sock.sendall(b)
    link.sock.sendall(bytes(32))
    with pytest.raises((ConnectionError, OSError)):
        codec.recv_frame(link.sock, mac=link.mac)
    link.close()
    # A frame signed for one connection, replayed on another: refused too.
    first, second = _link(module_cluster), _link(module_cluster)
    tag = first.mac.sign(buffers)
    for b in [*buffers, tag]:
        second.sock.sendall(b)
    with pytest.raises((ConnectionError, OSError)):
        codec.recv_frame(second.sock, mac=second.mac)
    first.close()
    second.close()
    # Replayed on its own connection (same bytes twice): the second copy fails the frame counter.
    link = _link(module_cluster)
    tag = link.mac.sign(buffers)
    for b in [*buffers, tag]:
        link.sock.sendall(b)
    assert codec.recv_frame(link.sock, mac=link.mac)["ok"] is True
    for b in [*buffers, tag]:
        link.sock.sendall(b)
    with pytest.raises((ConnectionError, OSError)):
        codec.recv_frame(link.sock, mac=link.mac)
    link.close()
    assert _stored(module_cluster, pid) is True                          # the one good put only
    assert _stored(module_cluster, payload_id("sectest", 3, tensors)) is False


def test_a_wrong_secret_gets_no_data_plane_session(module_cluster):
    with pytest.raises(ConnectionError, match="authentication"):
        PeerLink(f"127.0.0.1:{module_cluster.base_port + 201}", b"0123456789abcdef-but-not-the-secret")
    assert os.path.exists(module_cluster.secret_file)


def test_a_blob_altered_after_signing_is_refused(module_cluster):
    """The tag covers every blob byte (through its BLAKE3 digest): one flipped byte of a signed
    put is refused and nothing is stored."""
    tensors = {"w": np.arange(1 << 18, dtype=np.float32)}          # 1 MiB: a chunk of its own
    pid = payload_id("sectest", 4, tensors)
    link = _link(module_cluster)
    buffers = codec.encode({"op": "put", "pid": pid, "tensors": tensors})
    tag = link.mac.sign(buffers)
    blob = bytearray(b"".join(bytes(b) for b in buffers[2:]))
    blob[len(blob) // 2] ^= 1
    for b in [buffers[0], buffers[1], blob, tag]:
        link.sock.sendall(b)
    with pytest.raises((ConnectionError, OSError)):
        codec.recv_frame(link.sock, mac=link.mac)
    link.close()
    assert _stored(module_cluster, pid) is False


def test_a_peer_of_another_protocol_version_is_told_so(module_cluster):
    """A node of the SHA-256 data plane (version 1: no version in its hello) is refused at the
    hello with both versions named, not left to fail every frame's MAC."""
    import socket
    sock = socket.create_connection(("127.0.0.1", module_cluster.base_port + 201), timeout=10)
    try:
        codec.send_frame(sock, {"nonce": os.urandom(16)})
        reply = codec.recv_frame(sock)
        assert reply["ok"] is False and reply["error"] == "ProtocolError"
        assert "version 1 on the peer, 2 on this node" in reply["message"]
        assert "proof" not in reply
    finally:
        sock.close()
