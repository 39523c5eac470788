"""One benchmark client process (the parent side that runs N of them in step is
``common.run_workers``).

Child: ``python -m bench.worker '<json args>'`` connects, warms up, prints ``READY``, waits for
``GO`` on stdin, pushes (or pulls) until ``duration`` s or ``max_ops`` operations, then prints one
JSON line ``{ok, errors, t_start, t_end, lat}`` (wall-clock times, latencies in seconds).
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

def _grad_pool(size: int, seed: int) -> list[np.ndarray]:
    """Distinct float32 gradients (at least 256 KiB in all) so no compressor sees repeats."""
    count = max(4, min(256, (256 * 1024) // max(size, 1)))
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(max(size // 4, 1), dtype=np.float32) for _ in range(count)]


def _make_op(args: dict[str, Any]) -> tuple[Any, Any]:
    """(operation callable(i), closer) for this worker's kind and op."""
    size = args["size"]
    if args["kind"] == "naive":
        import msgpack
        from .naive_store import NaiveClient
        c = NaiveClient(args["addresses"], timeout=args["timeout"])
        pool = _grad_pool(size, args["seed"])
        return (lambda i: c.push(msgpack.packb({"g": pool[i % len(pool)].tobytes(), "lr": 0.01, "step": i}))), c.close
    if args["kind"] == "raw":
        from .raw_dataplane import RawClient
        rc = RawClient(args["addresses"], timeout=args["timeout"])
        pool = _grad_pool(size, args["seed"])
        return (lambda i: rc.push(pool[i % len(pool)])), rc.sock.close
    if args["kind"] == "etcd":
        from .etcd import EtcdKV
        kv = EtcdKV(args["addresses"], timeout=args["timeout"])
        values = [g.tobytes() for g in _grad_pool(size, args["seed"])]
        key = f"w{size}"                # one key per size, as raftps pushes into one tensor per size
        return (lambda i: kv.put(key, values[i % len(values)])), kv.close
    from raftps import Client
    c = Client(args["addresses"], timeout=args["timeout"])
    name = args["name"]
    if args["op"] == "pull":
        lin = args.get("linearizable", True)
        return (lambda i: c.pull([name], linearizable=lin)[1]), c.close
    pool = _grad_pool(size, args["seed"])
    return (lambda i: c.push({name: pool[i % len(pool)]})), c.close


def child(args: dict[str, Any]) -> None:
    op, close = _make_op(args)
    op(0)                                        # warm-up: connection, leader discovery
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        return
    lat: list[float] = []
    errors = 0
    t_start = time.time()
    cpu0 = time.process_time()
    deadline = time.perf_counter() + args["duration"]
    i = 1
    if args.get("in_flight", 1) > 1:             # raftps push_async: that many pushes on their way
        errors = _pipelined(args, lat, deadline)
        i = args["max_ops"] + 1
    while i <= args["max_ops"] and time.perf_counter() < deadline:
        t0 = time.perf_counter()
        try:
            op(i)
            lat.append(time.perf_counter() - t0)
        except Exception as e:                  # counted, reported; the run goes on
            errors += 1
            print(f"worker error: {e!r}", file=sys.stderr, flush=True)
        i += 1
    t_end = time.time()
    cpu = time.process_time() - cpu0
    close()
    print(json.dumps({"ok": len(lat), "errors": errors, "t_start": t_start, "t_end": t_end, "cpu": cpu, "lat": lat}),
          flush=True)


def _pipelined(args: dict[str, Any], lat: list[float], deadline: float) -> int:
    """Keep ``in_flight`` raftps pushes on their way (Client.push_async) until the deadline or
    max_ops; each latency is from its send to its result."""
    from raftps import Client
    pool = _grad_pool(args["size"], args["seed"])
    name = args.get("name") or f"w{args['size']}"
    errors, sent, in_flight = 0, 0, []
    with Client(args["addresses"], timeout=args.get("timeout", 30.0), max_in_flight=args["in_flight"]) as c:
        while in_flight or (sent < args["max_ops"] and time.perf_counter() < deadline):
            while len(in_flight) < args["in_flight"] and sent < args["max_ops"] and time.perf_counter() < deadline:
                in_flight.append((time.perf_counter(), c.push_async({name: pool[sent % len(pool)]})))
                sent += 1
            t0, future = in_flight.pop(0)
            try:
                future.result()
                lat.append(time.perf_counter() - t0)
            except Exception as e:              # counted, reported; the run goes on
                errors += 1
                print(f"worker error: {e!r}", file=sys.stderr, flush=True)
    return errors


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
