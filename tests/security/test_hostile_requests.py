"""Hostile authenticated clients (issue #16): a token holder sends thousands of structurally
mutated requests of every op to a real 3-node cluster. No reply is ever ``Internal``; every node
stays up; the replicas stay identical; a normal push afterwards is exact; no node logged a failure.

RAFTPS_HOSTILE_CASES sets the number of cases (default 6,000: about 20 s on a loaded 2-core
machine); ``-m soak`` runs 30,000 (about 55 s). RAFTPS_FUZZ_SEED picks the seed.
"""
import json
import os
import random
import socket
import time

import numpy as np
import pytest

from raftps import codec, ops
from raftps.errors import InvalidOptimizer, InvalidRequest
from hostile_requests import ELASTIC, SSP_GROUP, TABLE, TENSOR, lying_frame, mutate, valid_request
from security_helpers import hello_connection, start, state

BASE = 26000
SEED = int(os.environ.get("RAFTPS_FUZZ_SEED", "20261216"))
CASES = int(os.environ.get("RAFTPS_HOSTILE_CASES", "6000"))


def _prepare(cluster) -> None:
    with cluster.client(timeout=20) as c:
        c.create(TENSOR, np.zeros(8, np.float32), optimizer={"name": "sgd", "lr": 1.0})
        c.create(TABLE, np.zeros((16, 4), np.float32), optimizer={"name": "adam", "lr": 0.01})
        c.create(ELASTIC, np.zeros(3), optimizer={"name": "elastic"})
        c.ssp_join(SSP_GROUP, "w1", 2)


def _leader_port(cluster) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        leader = cluster.leader()
        if leader:
            return cluster.base_port + 100 + leader
        time.sleep(0.1)
    raise AssertionError("no leader")


def run_hostile(cluster, cases: int, seed: int, token: str | None = None) -> dict:
    """Send ``cases`` mutated requests (80% to the leader) with ``token`` (default: the cluster
    token); returns counts of reply kinds."""
    token = token or cluster.token
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    leader = _leader_port(cluster)
    ports = [leader] * 4 + [cluster.base_port + 100 + n for n in (1, 2, 3)]
    conns: dict[int, socket.socket] = {}
    seqs: dict[int, int] = {}
    started = time.monotonic()
    try:
        for i in range(cases):
            port = rng.choice(ports)
            if rng.random() < 0.03:                    # a blob that does not match its arrays
                s = hello_connection(port, token)
                try:
                    s.sendall(lying_frame(rng))
                    reply = codec.recv_frame(s)
                finally:
                    s.close()
                assert reply.get("error") in ("ProtocolError", "LimitExceeded"), reply
                counts["lying frame refused"] = counts.get("lying frame refused", 0) + 1
                continue
            s = conns.get(port) or conns.setdefault(port, hello_connection(port, token))
            req = valid_request(rng)
            if req["op"] not in ("status", "stats", "tensors", "pull", "pull_rows", "wait_step", "sync_applied",
                                 "ssp_wait", "hello"):
                seqs[port] = seqs.get(port, 0) + 1
                req.update(client=f"hx{port}", seq=seqs[port], ack=seqs[port])
            if rng.random() < 0.9:
                req = mutate(rng, req)
            codec.send_frame(s, req)
            held = isinstance(req, dict) and isinstance(req.get("op"), str) and req["op"] == "push_step"
            if held:
                s.settimeout(2.0)
            try:
                reply = codec.recv_frame(s)
            except socket.timeout:
                if not held:
                    raise
                # a valid contribution waits for its step's other workers (up to its timeout): let it be
                counts["push_step held"] = counts.get("push_step held", 0) + 1
                conns.pop(port).close()
                continue
            except (ConnectionError, OSError) as exc:
                raise AssertionError(f"case {i}: the node dropped the connection on {req!r}: {exc}") from None
            assert isinstance(reply, dict), (req, reply)
            assert reply.get("error") != "Internal", (i, req, reply)
            kind = reply.get("error") or ("retry" if reply.get("retry") else "ok")
            counts[kind] = counts.get(kind, 0) + 1
            if reply.get("error") in ("ProtocolError", "LimitExceeded"):   # the node closed the stream
                conns.pop(port).close()
    finally:
        for s in conns.values():
            s.close()
    counts["seconds"] = round(time.monotonic() - started, 1)
    return counts


def check_after(cluster, pids) -> None:
    assert [cluster.pid(n) for n in (1, 2, 3)] == pids and all(cluster.is_up(n) for n in (1, 2, 3))
    rows = state(cluster, settle=20)
    assert len({(v, d) for _, v, d in rows}) == 1, rows           # identical replicas
    with cluster.client(timeout=20) as c:
        c.create("after.w", np.zeros(4, np.float32), optimizer={"name": "sgd", "lr": 1.0})
        c.push({"after.w": np.array([1, 2, 3, 4], np.float32)})
        assert c.pull(["after.w"])[0]["after.w"].tolist() == [-1.0, -2.0, -3.0, -4.0]
        # (the fuzz may have deleted or wrecked its own tensors: a valid delete of "hx.w" is valid)
        before = c.pull(["after.w"])[0]["after.w"]
        g = np.linspace(-1, 1, 4, dtype=np.float32)
        c.push({"after.w": g})
        assert np.array_equal(c.pull(["after.w"])[0]["after.w"], before - np.float32(1.0) * g)
    rows = state(cluster, settle=20)
    assert len({(v, d) for _, v, d in rows}) == 1, rows
    for n in (1, 2, 3):
        with open(cluster.log_file(n), errors="replace") as f:
            log = f.read()
        # server.py logs "request failed", node.py "read failed", machine.py "entry N failed: ..."
        assert not any(m in log for m in ("request failed", "read failed", "failed: ", "internal error")), log[-3000:]


def _hostile(cluster, cases: int) -> None:
    """Two thirds of the cases with the cluster token (admin everywhere), a third with an identity
    that may write under "hx." and read everything (so roles are checked on odd requests too)."""
    _prepare(cluster)
    pids = [cluster.pid(n) for n in (1, 2, 3)]
    counts = run_hostile(cluster, cases - cases // 3, SEED)
    limited = run_hostile(cluster, cases // 3, SEED + 1, token=IDENTITY_TOKEN)
    print(f"hostile: {cases} cases (seed {SEED}): cluster token {counts}; identity 'hx' {limited}")
    assert counts.get("InvalidRequest", 0) > cases // 3        # the schema refused most of them
    assert counts.get("ok", 0) > cases // 50                   # and the fuzz still reached the store
    assert limited.get("PermissionDenied", 0) > 0 and limited.get("ok", 0) > 0
    check_after(cluster, pids)


IDENTITY_TOKEN = "hx-" + "0123456789abcdef" * 2


def _hostile_cluster(tmp_path_factory, base: int):
    run = tmp_path_factory.mktemp("hostile")
    auth_file = run / "identities.json"
    auth_file.write_text(json.dumps({"identities": [{"name": "hx", "token": IDENTITY_TOKEN, "grants": [
        {"prefix": "hx.", "role": "write"}, {"prefix": "", "role": "read"}]}]}))
    return start(run / "cluster", base, extra_args=["--auth-file", str(auth_file)])


@pytest.fixture(scope="module")
def hostile_cluster(tmp_path_factory):
    cluster = _hostile_cluster(tmp_path_factory, BASE)
    yield cluster
    cluster.wipe()


def test_hostile_token_holder_never_gets_internal(hostile_cluster):
    _hostile(hostile_cluster, CASES)


@pytest.mark.soak
def test_hostile_token_holder_soak(tmp_path_factory):
    cluster = _hostile_cluster(tmp_path_factory, BASE + 10)
    try:
        _hostile(cluster, 30_000)
    finally:
        cluster.wipe()


# ---- the schema's messages, one per kind of problem (no cluster) ------------------------------------

F = np.ones(8, np.float32)


@pytest.mark.parametrize("request_, error, message", [
    ({"op": "push", "client": "c", "seq": 1, "tensors": {"w": {"a": 1}}}, InvalidRequest,
     "push: tensors['w']: expected an array, got a map"),
    ({"op": "push", "client": "c", "seq": 1, "tensors": {"w": F}, "encoding": {"w": {"kind": F}}}, InvalidRequest,
     "push: encoding['w'].kind: expected one of 'fp16', 'int8', 'rows', 'topk', got an array (float32, shape (8,))"),
    ({"op": "push", "client": "c", "seq": 1, "tensors": {"w": F}, "encoding": {"w": {"kind": "fp16"}}},
     InvalidRequest, "push: encoding['w'].scale: expected a finite number > 0, got nothing (the field is required)"),
    ({"op": "push", "client": "c", "seq": 1, "tensors": {"w": F}, "base_version": -1}, InvalidRequest,
     "push: base_version: expected an int >= 0, got an int -1"),
    ({"op": "push", "client": "c", "seq": 1, "tensors": {"w": F}, "ssp": {"ssp_group": "g", "worker": F}},
     InvalidRequest, "push: ssp.worker: expected a worker name (a string of 1-200 characters), got an array"),
    ({"op": "push", "client": "c", "seq": True, "tensors": {"w": F}}, InvalidRequest,
     "push: seq: expected an int >= 1, got a bool True"),
    ({"op": "push", "client": "c", "seq": 1, "tensors": {"a b": F}}, InvalidRequest,
     "push: tensors key 'a b': expected a tensor name"),
    ({"op": "push", "client": "c", "seq": 1, "tensors": {"w": F}, "id": 3}, InvalidRequest,
     "push: id: unknown field (this map takes ack, base_version, client, encoding, held, held_names, hyper, op, raft_group, seq, ssp, tensors)"),
    ({"op": "create", "client": "c", "seq": 1, "tensors": {"w": F}, "optimizer": {"w": {"name": "adam", "lr": F}}},
     InvalidOptimizer, "create: optimizer['w'].lr: expected a finite number > 0, got an array"),
    ({"op": "create", "client": "c", "seq": 1, "tensors": {"w": F},
      "optimizer": {"w": {"name": "sgd", "lr": float("nan")}}}, InvalidOptimizer,
     "create: optimizer['w'].lr: expected a finite number > 0, got a float nan"),
    ({"op": "create", "client": "c", "seq": 1, "tensors": {"w": F},
      "optimizer": {"w": {"name": "adarevision", "lr": 1.0, "window": 2 ** 64 - 1}}}, InvalidOptimizer,
     "create: optimizer['w'].window: expected an int >= 1, got an int 18446744073709551615"),
    ({"op": "push_sync", "client": "c", "seq": 1, "tensors": {"w": F}, "step": 0, "workers": 2, "rank": 2},
     InvalidRequest, "push_sync: rank: expected an int in [0, workers=2), got an int 2"),
    ({"op": "delete", "client": "c", "seq": 1, "names": []}, InvalidRequest,
     "delete: names: expected a list of 1+ of a tensor name"),
    ({"op": "pull", "linearizable": F}, InvalidRequest, "pull: linearizable: expected true or false, got an array"),
    ({"op": "pull", "wait": float("inf")}, InvalidRequest,
     "pull: wait: expected a finite number >= 0 (seconds), got a float inf"),
    ({"op": "pull_rows", "name": "w", "rows": np.ones((2, 2), np.int64)}, InvalidRequest,
     "pull_rows: rows: expected a 1-D array, got an array (int64, shape (2, 2))"),
    ({"op": "sync_applied", "job": F}, InvalidRequest, "sync_applied: job: expected a job name"),
    ({"op": "wait_step", "step": 1.0}, InvalidRequest, "wait_step: step: expected an int, got a float 1.0"),
    ({"op": "ssp_join", "client": "c", "seq": 1, "ssp_group": "g", "worker": "w", "staleness": -1}, InvalidRequest,
     "ssp_join: staleness: expected an int >= 0, got an int -1"),
    ({"op": "status", "x": 1}, InvalidRequest, "status: x: unknown field (this map takes digest, op, raft_group)"),
    ({"op": F}, InvalidRequest, "a request is a map with an 'op' string, got op an array"),
    ([1, 2], InvalidRequest, "a request is a map with an 'op' string, got a list"),
])
def test_schema_names_the_field_and_what_was_expected(request_, error, message):
    with pytest.raises(error) as info:
        ops.check_request(request_)
    assert type(info.value) is error and str(info.value).startswith(message), str(info.value)


def test_every_served_op_has_a_schema():
    from raftps.server.server import WRITES
    served = {"status", "stats", "pull", "pull_rows", "wait_step", "sync_applied", "ssp_wait", "tensors", *WRITES}
    assert served <= set(ops.REQUESTS)


def test_valid_requests_pass_the_schema():
    rng = random.Random(1)
    for _ in range(500):
        req = valid_request(rng)
        req.update(client="c", seq=1, ack=1) if req["op"] in ops.REQUESTS and "seq" in ops.REQUESTS[req["op"]].fields \
            else None
        ops.check_request(req)


# ---- the state machine alone: authoritative even without the schema --------------------------------

def test_state_machine_refuses_hostile_commands_without_the_schema():
    """The same mutated requests applied straight to two TensorStores (no schema, no server): no
    Internal, and both replicas end with the same digest."""
    from raftps.store.machine import TensorStore
    stores = [TensorStore(), TensorStore()]
    setup = [{"op": "create", "client": "s", "seq": 1, "tensors": {
                 TENSOR: np.zeros(8, np.float32), TABLE: np.zeros((16, 4), np.float32), ELASTIC: np.zeros(3)},
              "optimizer": {TENSOR: {"name": "sgd", "lr": 1.0}, TABLE: {"name": "adam", "lr": 0.01},
                            ELASTIC: {"name": "elastic"}}},
             {"op": "ssp_join", "client": "s", "seq": 2, "ssp_group": SSP_GROUP, "worker": "w1", "staleness": 2}]
    rng = random.Random(SEED)
    commands = setup + []
    for i in range(int(os.environ.get("RAFTPS_HOSTILE_MACHINE_CASES", "10000"))):
        req = valid_request(rng)
        req.update(client=f"c{rng.randrange(4)}", seq=i + 10, ack=i + 10)
        commands.append(mutate(rng, req) if rng.random() < 0.9 else req)
    outcomes: dict[str, int] = {}
    for index, command in enumerate(commands, 1):
        results = [store.apply(index, command) for store in stores]
        assert results[0].get("error") != "Internal", (index, command, results[0])
        outcomes[results[0].get("error", "ok")] = outcomes.get(results[0].get("error", "ok"), 0) + 1
    assert stores[0].digest() == stores[1].digest()
    assert outcomes["ok"] > len(commands) // 50, outcomes


def test_the_poison_pill_that_stopped_the_cluster_is_refused():
    """Before the schema, this push passed the client port, and sorting its encoding's keys (bytes
    and str) raised TypeError inside apply on every replica: no node applied anything after it and
    the cluster answered every later write with Retry (found by the hostile fuzz on the old code)."""
    from raftps.store.machine import TensorStore
    push = {"op": "push", "client": "c", "seq": 2, "ack": 2,
            "tensors": {TENSOR: np.ones(8, np.float16)},
            "encoding": {b"op": {"kind": "fp16", "scale": 1024.0}, TENSOR: {"kind": "fp16", "scale": 1.0}}}
    with pytest.raises(InvalidRequest, match=r"push: encoding key: expected a tensor name .*, got bytes"):
        ops.check_request(push)
    m = TensorStore()
    m.apply(1, {"op": "create", "client": "c", "seq": 1, "tensors": {TENSOR: np.zeros(8, np.float32)},
                "optimizer": {TENSOR: {"name": "sgd", "lr": 1.0}}})
    assert m.apply(2, push)["error"] == "InvalidRequest"


def test_an_unforeseen_exception_in_apply_is_an_answer_not_a_crash(monkeypatch):
    from raftps.store.machine import TensorStore

    def broken(self, index, command):
        raise KeyError("a bug")
    monkeypatch.setitem(TensorStore._OPS, "close_step", broken)
    m = TensorStore()
    result = m.apply(1, {"op": "close_step", "client": "c", "seq": 1, "step": 0})
    assert result == {"error": "Internal", "message": "internal error applying entry 1: KeyError"}
    assert m.version == 1 and m.stats["rejected"] == 1
