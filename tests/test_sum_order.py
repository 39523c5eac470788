"""A synchronous step's sum does not depend on the order its contributions arrive in: the leader
adds them in rank order once the step is complete (aggregate.py), and so does the state machine
for push_sync's contributions, which reach the log in arrival order (sync_jobs.py), so a job is
reproducible to the bit. On the aggregator's own code, on the state machine (and through its
snapshot), and on a real 3-node cluster with ranks arriving in two different orders."""
from __future__ import annotations

import threading
import time
from functools import reduce

import numpy as np

from raftps.server.aggregate import _Step
from raftps.store.machine import TensorStore
from tests.conftest import start_cluster

ORDERS = [(0, 1, 2, 3), (3, 1, 2, 0), (2, 0, 3, 1)]


def gradients(k: int = 4, n: int = 4096, seed: int = 7) -> list[np.ndarray]:
    """float32 gradients of magnitudes 1e-4..1e4 and mixed signs: their float32 sum rounds
    differently in different orders."""
    rng = np.random.default_rng(seed)
    return [(rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-4, 4, n)).astype(np.float32) for _ in range(k)]


def in_arrival_order(grads: list[np.ndarray], order: tuple[int, ...]) -> np.ndarray:
    return reduce(np.add, [grads[r] for r in order])


def test_arrival_orders_round_differently_so_the_test_can_fail() -> None:
    grads = gradients()
    sums = {in_arrival_order(grads, order).tobytes() for order in ORDERS}
    assert len(sums) == len(ORDERS)


def test_a_steps_sum_is_the_rank_order_sum_whatever_the_arrival_order() -> None:
    grads = gradients()
    rank_order = ((grads[0] + grads[1]) + grads[2]) + grads[3]
    for order in ORDERS:
        s = _Step("job", 0, 4, ["w"], True, None, None, deadline=0.0)
        for rank in order:
            assert s.add({"w": grads[rank]}, [rank])
        assert not s.add({"w": grads[order[0]]}, [order[0]]), "a rank's second contribution is not counted"
        assert s.total()["w"].tobytes() == rank_order.tobytes()


def test_unranked_contributions_are_summed_in_client_and_seq_order() -> None:
    grads = gradients()
    clients = ["c", "a", "d", "b"]                   # sorted: a (1), b (3), c (0), d (2)
    want = ((grads[1] + grads[3]) + grads[0]) + grads[2]
    for order in ORDERS:
        s = _Step("job", 0, 4, ["w"], False, None, None, deadline=0.0)
        for i in order:
            s.add({"w": grads[i]}, None, clients[i], 1)
        assert s.total()["w"].tobytes() == want.tobytes()


def test_read_only_contributions_are_left_as_they_are() -> None:
    grads = gradients()
    frozen = [g.copy() for g in grads]
    for g in frozen:
        g.flags.writeable = False
    s = _Step("job", 0, 4, ["w"], True, None, None, deadline=0.0)
    for rank in (1, 0, 3, 2):
        s.add({"w": frozen[rank]}, [rank])
    s.total()
    assert all(np.array_equal(f, g) for f, g in zip(frozen, grads))


def push_sync_in_order(grads: list[np.ndarray], order: tuple[int, ...], snapshot_after: int = -1) -> np.ndarray:
    """push_sync's ranked contributions applied to a state machine in ``order`` (each from a
    client of its own), the store restored from its snapshot after the ``snapshot_after``-th;
    the tensor after the step."""
    store = TensorStore()
    store.apply(1, {"op": "create", "client": "setup", "seq": 1, "tensors": {"w": np.zeros_like(grads[0])},
                    "optimizer": {"w": {"name": "sgd", "lr": 1.0}}})
    for i, rank in enumerate(order):
        store.apply(store.version + 1, {"op": "push_sync", "client": f"c{rank}", "seq": 1, "step": 0, "workers": 4,
                                        "rank": rank, "tensors": {"w": grads[rank]}})
        if i == snapshot_after:
            restored = TensorStore()
            restored.restore(store.snapshot())
            assert restored.digest() == store.digest()
            store = restored
    assert store.sync_step_applied("") == 0
    return store.tensors["w"].data


def test_push_sync_sums_in_rank_order_whatever_the_log_order() -> None:
    grads = gradients()
    want = -((((grads[0] + grads[1]) + grads[2]) + grads[3]) / np.float32(4))
    for order in ORDERS:
        assert push_sync_in_order(grads, order).tobytes() == want.tobytes(), order
    for held in (0, 1, 2):     # one contribution held in the snapshot (a row as before), or several
        assert push_sync_in_order(grads, ORDERS[1], snapshot_after=held).tobytes() == want.tobytes(), held


def test_on_a_cluster_two_arrival_orders_give_the_same_bits(tmp_path) -> None:
    grads = gradients()
    cluster = start_cluster(tmp_path, 5400)
    try:
        with cluster.client() as c:
            for job in ORDERS[:2]:
                c.create(f"j{job[0]}/w", np.zeros_like(grads[0]), {"name": "sgd", "lr": 1.0})
        answers: dict = {}

        def contribute(job: str, rank: int) -> None:
            with cluster.client(timeout=30.0) as c:
                answers[(job, rank)] = c.push_step({f"{job}/w": grads[rank]}, 0, 4, job=job, rank=rank, timeout=20.0)

        for order in ORDERS[:2]:
            job = f"j{order[0]}"
            threads = []
            for rank in order:         # one rank after another: they arrive in this order
                threads.append(threading.Thread(target=contribute, args=(job, rank)))
                threads[-1].start()
                time.sleep(0.3)
            for t in threads:
                t.join(40.0)
        assert sorted(a["count"] for a in answers.values()) == [4] * 8, answers
        with cluster.client() as c:
            tensors, _ = c.pull(["j0/w", "j3/w"])
        assert tensors["j0/w"].tobytes() == tensors["j3/w"].tobytes()
        np.testing.assert_allclose(tensors["j0/w"], -in_arrival_order(grads, ORDERS[0]) / 4, rtol=1e-5, atol=1e-3)
    finally:
        cluster.wipe()
