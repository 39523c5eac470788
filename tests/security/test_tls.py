"""TLS on the client port, with certificates from cluster/make-certs.sh, on a real 3-node cluster."""
import os
import socket
import subprocess
import time

import numpy as np
import pytest

from raftps import AuthenticationFailed, Client, TLSRequired
from security_helpers import start, state

BASE = 10030
PLAIN = 10040
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_certs(directory: str) -> str:
    subprocess.run(["bash", os.path.join(ROOT, "cluster", "make-certs.sh"), directory], check=True,
                   capture_output=True, timeout=60)
    return directory


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    certs = make_certs(str(tmp_path_factory.mktemp("certs")))
    cluster = start(tmp_path_factory.mktemp("tls"), BASE, tls_dir=certs, extra_args=["--frame-timeout", "2"])
    yield cluster
    cluster.wipe()


def test_tls_client_is_served(tls_cluster):
    assert os.stat(os.path.join(tls_cluster.tls_dir, "node.key")).st_mode & 0o777 == 0o600
    with tls_cluster.client(timeout=10) as c:
        c.create("tls.w", np.zeros(1 << 16, np.float32), optimizer={"name": "sgd", "lr": 1.0})
        c.push({"tls.w": np.ones(1 << 16, np.float32)})        # 256 KiB: goes through the data plane
        assert np.array_equal(c.pull(["tls.w"])[0]["tls.w"], -np.ones(1 << 16, np.float32))
        assert c._router.transport._conns and all(type(s).__name__ == "SSLSocket" for s in c._router.transport._conns.values())


def test_plain_connection_to_a_tls_node_is_refused_with_its_message(tls_cluster):
    before = state(tls_cluster)
    with pytest.raises(TLSRequired, match="over TLS only.*tls=CA_FILE"):
        Client(tls_cluster.addresses, token=tls_cluster.token, tls=False, timeout=5).push({"tls.w": np.ones(4)})
    assert state(tls_cluster) == before


def test_wrong_token_over_tls_and_an_unknown_ca_are_refused(tls_cluster, tmp_path):
    with pytest.raises(AuthenticationFailed, match="wrong client token"):
        Client(tls_cluster.addresses, token="wrong", tls=tls_cluster.tls_ca, timeout=5).status()
    other_ca = os.path.join(make_certs(str(tmp_path / "other")), "ca.pem")
    with pytest.raises(AuthenticationFailed, match="does not verify"):
        Client(tls_cluster.addresses, token=tls_cluster.token, tls=other_ca, timeout=5).status()


def test_tls_client_to_a_plain_node_gets_a_clear_error(tls_cluster, tmp_path):
    plain = start(tmp_path / "plain", PLAIN, nodes=1)
    try:
        with pytest.raises(AuthenticationFailed, match="TLS handshake failed.*serve TLS"):
            Client(plain.addresses, token=plain.token, tls=tls_cluster.tls_ca, timeout=5).status()
    finally:
        plain.wipe()


def test_a_tls_handshake_trickled_byte_by_byte_is_cut_at_frame_timeout(tls_cluster):
    hello = bytes([0x16, 0x03, 0x01, 0x02, 0x00]) + bytes(200)      # a ClientHello record header, then junk
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", BASE + 101), timeout=5) as s:
        for byte in hello:                                          # 205 bytes at 0.1 s: 20 s
            try:
                s.sendall(bytes([byte]))
                s.settimeout(0.1)
                if s.recv(1) == b"":
                    break                                           # the node hung up
            except socket.timeout:
                continue
            except OSError:
                break
    assert time.monotonic() - started < 10, "the node waited for a trickled TLS handshake past frame_timeout=2"
    with tls_cluster.client(timeout=10) as c:
        assert all(r["role"] != "down" for r in c.status())
