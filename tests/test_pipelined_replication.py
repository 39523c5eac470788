"""Pipelined small pushes must not make a healthy follower truncate and re-append its log.

pysyncobj 0.3.17's leader sends batch after batch without waiting (nextIndex moves to the end of
each batch), but on every success reply that raises matchIndex it sets nextIndex back to the
reply's index: the entries already in flight are sent again. The follower truncates on any
append_entries whose prevLogIdx is below its last index, even when the entries match, and appends
them again; when the truncated entries were applied it logs "truncating already-applied log
entries". Without faults, no follower should ever do that (raftps/pysyncobj_fixes.py).
"""
from __future__ import annotations

import numpy as np

from tests.conftest import push_concurrently


CLIENTS = 4
PUSHES = 250          # per client; bounded further by 60 s


def test_no_truncation_of_applied_entries_under_pipelined_load(make_cluster) -> None:
    cluster = make_cluster(9320)
    with cluster.client() as c:
        for i in range(CLIENTS):
            c.create(f"w{i}", np.zeros(256, np.float32), optimizer={"name": "sgd", "lr": 0.5})
    done = push_concurrently(cluster, [{f"w{i}": np.ones(256, np.float32)} for i in range(CLIENTS)], PUSHES)
    assert sum(done) >= CLIENTS * 50, f"only {done} pushes in 60 s"
    with cluster.client() as c:
        tensors, _ = c.pull([f"w{i}" for i in range(CLIENTS)])
    for i in range(CLIENTS):                      # each push applied exactly once: w = -0.5 * n
        assert np.array_equal(tensors[f"w{i}"], np.full(256, -0.5 * done[i], np.float32))
    truncations = {n: open(cluster.log_file(n)).read().count("truncating already-applied")
                   for n in (1, 2, 3)}
    assert not any(truncations.values()), f"followers truncated applied entries: {truncations}"
