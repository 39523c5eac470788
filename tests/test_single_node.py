"""A one-node cluster commits at once: nothing to wait for but its own log."""
import statistics
import time

import numpy as np


BASE = 9100


def test_single_node_commit_does_not_wait_for_the_next_tick(make_cluster):
    # pysyncobj computes the commit index before it appends new commands and then sleeps in
    # poll() until a message or its 50 ms tick; one node gets no messages, so every write and
    # linearizable read waited >= 50 ms (measured: 51.9 ms per push). 25 ms leaves 10x headroom.
    cl = make_cluster(BASE, nodes=1)
    with cl.client(timeout=20) as c:
        c.create("one.t", np.zeros(256, np.float32), {"name": "sgd", "lr": 0.5})
        pushes, reads = [], []
        for _ in range(20):
            t0 = time.perf_counter()
            c.push({"one.t": np.ones(256, np.float32)})
            pushes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tensors, _ = c.pull(["one.t"])
            reads.append(time.perf_counter() - t0)
        assert np.array_equal(tensors["one.t"], np.full(256, -10.0, np.float32))
    assert statistics.median(pushes) < 0.025, pushes
    assert statistics.median(reads) < 0.025, reads
