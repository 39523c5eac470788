"""A seeded generator of hostile requests from a token holder: a valid request of every op, then
one to three structural mutations anywhere in it (wrong types at every level, arrays where
scalars, strings or maps belong, hostile numbers, huge or degenerate shapes, wrong dtypes,
missing, extra and renamed fields), and raw frames whose blob does not match their arrays."""
from __future__ import annotations

import random
import struct
from typing import Any

import msgpack
import numpy as np

from raftps import codec, optim

TENSOR = "hx.w"            # float32 (8,), sgd lr 1: the fuzz's dense target
TABLE = "hx.emb"           # float32 (16, 4), adam: the row-sparse target
ELASTIC = "hx.e"           # float64 (3,), elastic
GROUPS = ["hx", "hx/sync", "", None]
SSP_GROUP = "hx.ssp"
WAIT_CAP = 0.2             # timeouts a request may carry: the fuzz must not wait


def hostile_scalars() -> list:
    return [None, True, False, 0, -1, 1, 7, 2 ** 31, 2 ** 63 - 1, -(2 ** 63), 2 ** 64 - 1, 0.0, -0.0, 1.5, -2.5,
            float("nan"), float("inf"), float("-inf"), 1e308, 5e-324, "", "x", "x" * 1000, "é\x00", "../x",
            "a b", "hx.w", "fp16", "adam", b"", b"\x00" * 9]


def hostile_arrays(rng: random.Random) -> list:
    return [np.zeros(0, np.float32), np.zeros((0, 1 << 40), np.float32), np.zeros((1 << 20, 0), np.float64),
            np.ones(8, np.float64), np.ones(8, np.float16), np.ones(8, np.int32), np.ones(8, np.int64),
            np.full(8, np.nan, np.float32), np.full(8, np.inf, np.float32), np.full(8, 3.0e38, np.float32),
            np.array(1.0, np.float32), np.ones((2, 2, 2), np.float32), np.ones((1,) * 8, np.float32),
            np.array([5, 3, 3, -1], np.int64), np.array([2 ** 62, 0], np.int64), np.arange(16, dtype=np.int32),
            np.ones((16, 4), np.float32), np.ones((3, 4), np.float32), np.ones(3, np.float64),
            np.frombuffer(rng.randbytes(32), np.float32)]


def hostile_value(rng: random.Random) -> Any:
    kind = rng.randrange(6)
    if kind <= 1:
        return rng.choice(hostile_scalars())
    if kind == 2:
        return rng.choice(hostile_arrays(rng))
    if kind == 3:
        return rng.choice([[], [1], ["hx.w"], [None], [np.ones(2)], [[1]], list(range(50))])
    if kind == 4:
        return rng.choice([{}, {"a": 1}, {"kind": "topk"}, {"name": "adam", "lr": 1.0}, {"hx.w": np.ones(8)},
                           {"ssp_group": "hx", "worker": "w"}, {1: 2}, {"hx.w": {"hx.w": None}}])
    return rng.choice([rng.randrange(-2 ** 63, 2 ** 63), rng.uniform(-1e300, 1e300), rng.randbytes(4).hex()])


def _optimizer(rng: random.Random) -> dict:
    name = rng.choice(sorted(optim.SPECS))
    spec: dict[str, Any] = {"name": name}
    for key, (default, check) in optim.SPECS[name].items():
        if default is None or rng.random() < 0.3:
            spec[key] = (rng.random() < 0.5) if check is None else (4 if type(default) is int else 0.01)
    return spec


def _grad(rng: random.Random, shape=(8,), dtype=np.float32) -> np.ndarray:
    return (np.arange(np.prod(shape), dtype=dtype).reshape(shape) % 3 - 1) * dtype(0.5)


def valid_request(rng: random.Random) -> dict:
    """A request of a random op that the store would serve as it is (or refuse on state alone)."""
    op = rng.choice(["status", "stats", "tensors", "pull", "pull", "pull_rows", "wait_step", "sync_applied",
                     "ssp_wait", "create", "push", "push", "push", "push_sync", "push_step", "assign", "delete", "close_step",
                     "ssp_join", "ssp_leave", "ssp_drop", "hello", "export", "snapshot", "member"])
    req: dict[str, Any] = {"op": op}
    if op == "hello":
        req["token"] = "not a token"
    elif op == "tensors":
        if rng.random() < 0.5:
            req["prefix"] = rng.choice(["hx.", "", "nope/"])
    elif op in ("pull", "pull_rows"):
        if op == "pull":
            req["names"] = rng.choice([None, [TENSOR], [TENSOR, TABLE]])
        else:
            req.update(name=TABLE, rows=np.array(sorted(rng.sample(range(16), 3)), np.int64))
        if rng.random() < 0.5:
            req.update(linearizable=False, min_version=rng.choice([0, 1, None]), wait=0.1)
    elif op == "wait_step":
        req.update(step=rng.choice([-1, 0]), timeout=0.1, job=rng.choice(GROUPS))
    elif op == "sync_applied":
        req["job"] = rng.choice(GROUPS)
    elif op == "ssp_wait":
        req.update(ssp_group=SSP_GROUP, worker=rng.choice(["w1", "w2"]), timeout=0.1)
    elif op == "create":
        name = f"hx.c{rng.randrange(20)}"
        req.update(tensors={name: np.zeros(rng.choice([(4,), (2, 3)]), np.float32)},
                   optimizer={name: _optimizer(rng)})
    elif op == "push":
        kind = rng.randrange(5)
        if kind == 0:
            req["tensors"] = {TENSOR: _grad(rng)}
        elif kind == 1:
            scale = 1024.0
            req.update(tensors={TENSOR: (_grad(rng) * scale).astype(np.float16)},
                       encoding={TENSOR: {"kind": "fp16", "scale": scale}})
        elif kind == 2:
            req.update(tensors={TENSOR: np.ones(2, np.float32), TENSOR + ":indices": np.array([1, 5], np.int32)},
                       encoding={TENSOR: {"kind": "topk"}})
        elif kind == 3:
            req.update(tensors={TABLE: np.ones((2, 4), np.float32), TABLE + ":indices": np.array([0, 9], np.int64)},
                       encoding={TABLE: {"kind": "rows"}})
        else:
            req.update(tensors={ELASTIC: np.full(3, 0.25)}, base_version=0,
                       ssp={"ssp_group": SSP_GROUP, "worker": "w1"})
    elif op == "push_sync":
        req.update(tensors={TENSOR: _grad(rng)}, step=rng.randrange(3), workers=2, rank=rng.randrange(2),
                   job=rng.choice(GROUPS[:2]))
    elif op == "push_step":     # held by the leader until its step applies: short timeouts
        req.update(tensors={TENSOR: _grad(rng)}, step=rng.randrange(3), workers=2, rank=rng.randrange(2),
                   job=rng.choice(GROUPS[2:] or GROUPS), timeout=rng.choice([0.0, 0.05]))
    elif op == "assign":
        req["tensors"] = {ELASTIC: np.zeros(3)}
    elif op == "delete":
        req["names"] = [f"hx.c{rng.randrange(20)}"]
    elif op == "close_step":
        req.update(step=rng.randrange(3), job=rng.choice(GROUPS[:2]))
    elif op == "ssp_join":
        req.update(ssp_group=SSP_GROUP, worker=rng.choice(["w1", "w2"]), staleness=2)
    elif op == "ssp_leave":
        req.update(ssp_group=SSP_GROUP, worker="w2")
    elif op == "ssp_drop":
        req.update(ssp_group=SSP_GROUP, worker="w2", clock=0)
    elif op == "export":
        req["prefix"] = rng.choice(["hx.", "nope/"])
    elif op == "member":             # list only: a valid add/remove would really change the cluster
        req["action"] = "list"
    return {k: v for k, v in req.items() if v is not None or rng.random() < 0.5}


def _containers(obj: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every map and list in ``obj`` (the root included)."""
    out = []
    if isinstance(obj, dict):
        out.append(path)
        for k, v in obj.items():
            out += _containers(v, path + (k,))
    elif isinstance(obj, list):
        out.append(path)
        for i, v in enumerate(obj):
            out += _containers(v, path + (i,))
    return out


def _at(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def mutate(rng: random.Random, req: dict) -> dict:
    """One to three structural mutations, each in a random map or list at any depth."""
    for _ in range(rng.randint(1, 3)):
        container = _at(req, rng.choice(_containers(req)))
        what = rng.randrange(10)
        if isinstance(container, list):
            if container and what < 6:
                container[rng.randrange(len(container))] = hostile_value(rng)
            elif what < 8:
                container.append(hostile_value(rng))
            elif container:
                container.pop(rng.randrange(len(container)))
            continue
        keys = [k for k in container if container is not req or k != "op" or rng.random() < 0.1]
        if keys and what < 5:                                   # a value of the wrong kind
            container[rng.choice(keys)] = hostile_value(rng)
        elif keys and what < 7:                                 # a missing field
            del container[rng.choice(keys)]
        elif what < 9:                                          # an extra field
            key = rng.choice(["junk", "", "x" * 300, "tensors", "group", "kind", "lr", "name", "id", 7, -1,
                              b"k", 1.5, True, None, "hx.w:indices"])
            container[key] = hostile_value(rng)
        elif keys:                                              # a renamed field
            old = rng.choice(keys)
            container[rng.choice(["hx.w", "HX.W", "junk", 3, b"op", None])] = container.pop(old)
    return _cap_waits(req)


def _cap_waits(req: Any) -> Any:
    """Keep waits the fuzz would sit through short (the node caps them at 10 and 300 s anyway)."""
    if isinstance(req, dict):
        if isinstance(req.get("op"), str) and req["op"] in ("ssp_wait", "wait_step") and "timeout" not in req:
            req["timeout"] = WAIT_CAP          # the default is 10 s
        for k in ("timeout", "wait"):
            v = req.get(k)
            if type(v) in (int, float) and v == v and v > WAIT_CAP:
                req[k] = WAIT_CAP
        if req.get("linearizable") is False and type(req.get("min_version")) is int and req["min_version"] > 1:
            req["min_version"] = 1
    return req


def lying_frame(rng: random.Random) -> bytes:
    """A request frame whose blob does not match its array descriptors."""
    metas = [(["float32", [8]], 32), (["float32", [1 << 40]], 1 << 42), (["float64", [0, 1 << 50]], 0),
             (["int64", [3]], 24)]
    meta, nbytes = rng.choice(metas)
    header = msgpack.packb({"op": "push", "client": "lie", "seq": 1,
                            "tensors": {TENSOR: msgpack.ExtType(codec.ARRAY_EXT, msgpack.packb(meta))}})
    short = nbytes and nbytes < 1 << 20 and rng.random() < 0.5
    blob = rng.randbytes(nbytes - rng.randint(1, nbytes) if short else min(nbytes, 64) + rng.choice([1, 8, 64]))
    return struct.pack("!4sIQ", codec.MAGIC, len(header), len(blob)) + header + blob
