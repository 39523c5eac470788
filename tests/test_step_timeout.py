"""A synchronous step's timeout counts from its latest contribution, not its first: on a slow
link K contributions share the leader's link, so counting from the first left out live ranks whose
bytes were still arriving (aggregate.py). One member over the in-memory log, a real client port."""
from __future__ import annotations

import threading
import time

import numpy as np

from raftps.client.client import Client
from tests.test_push_step import store  # noqa: F401 (the fixture)


def test_a_rank_arriving_within_the_timeout_of_the_latest_is_counted(store) -> None:  # noqa: F811
    node, address = store
    with Client(address, timeout=10.0) as c:
        c.create("w", np.zeros(4, np.float32), {"name": "sgd", "lr": 1.0})
    answers: dict[int, dict] = {}

    def rank(r: int) -> None:
        with Client(address, timeout=20.0) as c:
            answers[r] = c.push_step({"w": np.full(4, float(r + 1), np.float32)}, 0, 3, job="j", rank=r, timeout=3.0)
    threads = []
    for r in range(3):           # 2 s apart: the last comes 4 s after the first, 2 s after the latest
        # (a 1 s margin for a thread and a connection to start on a loaded machine)
        threads.append(threading.Thread(target=rank, args=(r,)))
        threads[-1].start()
        time.sleep(2.0)
    for t in threads:
        t.join(30.0)
    assert [answers[r]["count"] for r in range(3)] == [3, 3, 3], answers
    assert not any(a.get("late") for a in answers.values())
    np.testing.assert_array_equal(node.read_locked(lambda m: m.tensors["w"].data), np.full(4, -2.0, np.float32))


def test_a_dead_rank_is_still_left_out_timeout_after_the_latest(store) -> None:  # noqa: F811
    node, address = store
    with Client(address, timeout=10.0) as c:
        c.create("w", np.zeros(4, np.float32), {"name": "sgd", "lr": 1.0})
        started = time.monotonic()
        reply = c.push_step({"w": np.ones(4, np.float32)}, 0, 2, job="j", rank=0, timeout=1.0)
        assert reply["count"] == 1 and reply["applied"]
        assert 1.0 <= time.monotonic() - started < 5.0
