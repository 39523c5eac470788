"""The client token: a real 3-node cluster refuses a wrong or missing token with its message,
serves nothing before a good hello, and accepts the token from each place a client reads it."""
import os
import subprocess
import sys

import numpy as np
import pytest

from raftps import AuthenticationFailed, Client, auth
from security_helpers import raw_request, state, token_env

BASE = 10000


def test_right_token_is_served_and_wrong_or_missing_token_is_refused(module_cluster, monkeypatch):
    token_env(monkeypatch)
    with module_cluster.client(timeout=10) as c:
        c.create("auth.w", np.zeros(4), optimizer={"name": "sgd", "lr": 1.0})
        c.push({"auth.w": np.ones(4)})
    before = state(module_cluster)
    with pytest.raises(AuthenticationFailed, match="wrong client token"):
        Client(module_cluster.addresses, token="not-the-token", timeout=5).push({"auth.w": np.ones(4)})
    with pytest.raises(AuthenticationFailed, match="no client token given"):
        Client(module_cluster.addresses, timeout=5).status()
    with pytest.raises(AuthenticationFailed, match="wrong client token"):     # a prefix is not enough
        Client(module_cluster.addresses, token=module_cluster.token[:-1], timeout=5).pull(["auth.w"])
    assert state(module_cluster) == before


def test_nothing_is_served_before_a_good_hello(module_cluster):
    address = module_cluster.client_address(1)
    # A request instead of the hello: refused, and the second request on the connection gets nothing.
    replies = raw_request(address, {"op": "status"}, {"op": "status"})
    assert len(replies) == 1 and replies[0]["error"] == "AuthenticationFailed"
    assert "first frame" in replies[0]["message"]
    replies = raw_request(address, {"op": "hello", "token": "wrong"}, {"op": "status"})
    assert [r.get("error") for r in replies] == ["AuthenticationFailed"]
    replies = raw_request(address, {"op": "hello", "token": 12345}, {"op": "status"})   # not even a str
    assert [r.get("error") for r in replies] == ["AuthenticationFailed"]
    # The right hello, then the same request is served on the same connection.
    replies = raw_request(address, {"op": "hello", "token": module_cluster.token}, {"op": "status"}, timeout=2)
    assert replies[0] == {"ok": True} and replies[1]["node"] == 1


def test_a_hello_may_not_carry_a_large_frame(module_cluster):
    # Before the token is checked the node reads only tiny frames: no allocation for strangers.
    replies = raw_request(module_cluster.client_address(2), {"op": "hello", "token": "x" * 10_000})
    assert replies[0]["error"] == "AuthenticationFailed" and "max_header_bytes=4096" in replies[0]["message"]


def test_token_from_the_environment_and_from_a_token_file(module_cluster, monkeypatch):
    token_env(monkeypatch, RAFTPS_TOKEN=module_cluster.token)
    assert all(r["role"] != "down" for r in Client(module_cluster.addresses, timeout=5).status())
    token_env(monkeypatch, RAFTPS_TOKEN_FILE=module_cluster.token_file)
    assert all(r["role"] != "down" for r in Client(module_cluster.addresses, timeout=5).status())
    token_env(monkeypatch, RAFTPS_TOKEN="wrong")
    with pytest.raises(AuthenticationFailed):
        Client(module_cluster.addresses, timeout=5).status()
    assert os.stat(module_cluster.token_file).st_mode & 0o777 == 0o600
    assert os.stat(module_cluster.secret_file).st_mode & 0o777 == 0o600
    assert auth.read_secret_file(module_cluster.token_file) != auth.read_secret_file(module_cluster.secret_file)


def test_raftps_status_command_uses_the_token(module_cluster):
    env = {**os.environ, "RAFTPS_CLUSTER": module_cluster.addresses}
    env.pop("RAFTPS_TOKEN", None)
    env.pop("RAFTPS_TOKEN_FILE", None)
    ok = subprocess.run([sys.executable, "-m", "raftps", "status", "--token-file", module_cluster.token_file],
                        env=env, capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "leader" in ok.stdout, ok.stderr
    refused = subprocess.run([sys.executable, "-m", "raftps", "status"], env=env, capture_output=True, text=True,
                             timeout=30)
    assert refused.returncode != 0 and "AuthenticationFailed" in refused.stderr
    assert "no client token given" in refused.stderr
