"""The Client's parts: the in-process transport (no socket), the session's sequence numbers, and
exactly-once writes through them, against a real one-member store over the in-memory log."""
import numpy as np
import pytest

from raftps.client.client import in_process_client
from raftps.errors import AuthenticationFailed, Unavailable
from raftps.server.node import NodeConfig, RaftNode
from raftps.raft.memory import MemoryLog
from raftps.server.server import ClientServer
from raftps.client.session import Session
from raftps.client.transport import InProcessTransport

BASE = 5000
SGD = {"name": "sgd", "lr": 1.0}


@pytest.fixture
def served(tmp_path):
    """A one-member store whose client port's listener is closed at once: only in-process
    requests can reach it."""
    config = NodeConfig(node_id=1, peers=[f"127.0.0.1:{BASE}"], data_dir=str(tmp_path / "n1"), secret=b"")
    node = RaftNode(config, log_factory=MemoryLog)
    server = ClientServer(node, *config.bind(config.client_offset))
    server.close()
    yield config.address(1, config.client_offset), server
    node.stop()


def test_a_client_over_the_in_process_transport(served) -> None:
    address, server = served
    with in_process_client({address: server}, timeout=10.0) as c:
        assert isinstance(c._router.transport, InProcessTransport)
        c.create("w", np.zeros(4, np.float32), SGD)
        version = c.push({"w": np.ones(4, np.float32)})
        tensors, seen = c.pull(["w"])
        np.testing.assert_array_equal(tensors["w"], -np.ones(4, np.float32))
        assert seen == version == c.stats()["version"]
        tensors["w"][0] = 5.0                     # a copy, as over a socket: the store is untouched
        assert c.pull(["w"])[0]["w"][0] == -1.0
        # a write sent again with its (client, seq) is answered from the session, not applied twice
        seq = c._session.next_seq(0)[0]
        request = {"op": "push", "client": c.client_id, "seq": seq, "ack": seq, "tensors": {"w": np.ones(4, np.float32)}}
        first, again = c._router.request(dict(request)), c._router.request(dict(request))
        c._session.answered(0, seq, refused=False)
        assert again["version"] == first["version"] and c.stats()["duplicates"] == 1
        assert c.pull(["w"])[0]["w"][0] == -2.0
    assert server.open_connections() == 0


def test_the_in_process_transport_checks_the_token_and_unknown_nodes(tmp_path) -> None:
    config = NodeConfig(node_id=1, peers=[f"127.0.0.1:{BASE + 1}"], data_dir=str(tmp_path / "n1"), secret=b"",
                        client_token="s3cret-token-of-16+")
    node = RaftNode(config, log_factory=MemoryLog)
    server = ClientServer(node, *config.bind(config.client_offset))
    server.close()
    address = config.address(1, config.client_offset)
    try:
        with in_process_client({address: server}, token="wrong-token-of-16+", timeout=3.0) as c:
            with pytest.raises(AuthenticationFailed):
                c.stats()
        with in_process_client({address: server}, token="s3cret-token-of-16+", timeout=3.0) as c:
            assert c.stats()["version"] == 0
        with in_process_client({"127.0.0.1:1": server}, timeout=1.0) as c:
            c._router.transport = InProcessTransport({}, None, c.limits)       # nobody at that address
            with pytest.raises(Unavailable, match="no in-process node"):
                c.stats()
    finally:
        node.stop()


def test_a_session_numbers_writes_per_raft_group_and_gives_back_a_refused_seq() -> None:
    s = Session()
    assert s.next_seq(0) == (1, 1) and s.next_seq(0) == (2, 1) and s.next_seq(3) == (1, 1)
    s.answered(0, 1, refused=False)
    assert s.next_seq(0) == (3, 2)                 # ack: the lowest seq not answered yet
    s.answered(0, 3, refused=True)                 # never reached a log: the next write takes it
    s.answered(0, 2, refused=False)
    assert s.next_seq(0) == (3, 3)
    assert Session().client_id != s.client_id
