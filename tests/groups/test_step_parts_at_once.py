"""A synchronous step's parts in several Raft groups go to their groups' leaders at once
(job_steps.py, Router.each_group_at_once), each on connections of its own: the same bits as
parts sent in turn, replicas identical, no deadlock where one rank's part in a later group is
needed before another's part in an earlier group completes, and a part sent again with its seq
counted once. A real 3-node cluster of 3 Raft groups on loopback."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from raftps.codec import DEFAULT_LIMITS
from raftps.groups import group_of
from raftps.tools.localcluster import LocalCluster
from raftps.client.transport import TcpTransport

from tests.conftest import start_cluster
from tests.groups.test_groups_cluster import wait_identical

SGD = {"name": "sgd", "lr": 0.5}
NAMES = [f"p{i}" for i in range(9)]
K = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("parts3"), 29460, groups=3)
    yield cl
    cl.wipe()


def gradients(rank: int, step: int) -> dict[str, np.ndarray]:
    """Mixed magnitudes and signs: a float32 sum in another order rounds differently."""
    rng = np.random.default_rng(100 * rank + step)
    return {n: (rng.choice([-1.0, 1.0], 64) * 10.0 ** rng.uniform(-3, 3, 64)).astype(np.float32) for n in NAMES}


def run_job(cl: LocalCluster, job: str, max_in_flight: int, steps: int = 2) -> tuple[list, dict]:
    """K ranks in threads, ``steps`` push_step steps with pull=True; every rank's answers, then a pull."""
    init = {f"{job}/{n}": np.linspace(-1, 1, 64, dtype=np.float32) for n in NAMES}
    with cl.client(timeout=30.0) as c:
        c.create_many(init, {n: SGD for n in init})
    answers: list = [None] * K
    errors: list = []

    def rank(r: int) -> None:
        try:
            with cl.client(timeout=30.0, max_in_flight=max_in_flight) as c:
                answers[r] = [c.push_step({f"{job}/{n}": g for n, g in gradients(r, s).items()}, s, K,
                                          job=job, rank=r, timeout=20.0, pull=True) for s in range(steps)]
        except Exception as exc:        # reported below, naming the rank
            errors.append(f"rank {r}: {exc!r}")
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(K)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and all(a is not None for a in answers), errors
    with cl.client() as c:
        tensors, _ = c.pull(list(init))
    return answers, {n.split("/", 1)[1]: v for n, v in tensors.items()}


def test_parts_at_once_give_the_bits_of_parts_in_turn(cluster) -> None:
    assert {group_of(f"at/{n}", 3) for n in NAMES} == {0, 1, 2} == {group_of(f"turn/{n}", 3) for n in NAMES}
    at_once, a = run_job(cluster, "at", max_in_flight=16)
    in_turn, b = run_job(cluster, "turn", max_in_flight=1)      # one lane: one part after another
    for n in NAMES:
        assert a[n].tobytes() == b[n].tobytes(), n
    # and both are SGD on the mean gradient, by hand in float64 (float32 rounding apart)
    want = {n: np.linspace(-1, 1, 64, dtype=np.float32).astype(np.float64) for n in NAMES}
    for s in range(2):
        for n in NAMES:
            want[n] -= 0.5 * sum(gradients(r, s)[n].astype(np.float64) for r in range(K)) / K
    for n in NAMES:
        np.testing.assert_allclose(a[n], want[n], rtol=1e-5, atol=1e-3)
    for answers in at_once:     # every rank's answer carries the step's tensors as its entry left them
        assert [r["count"] for r in answers] == [K, K]
        last = answers[-1]["tensors"]
        assert all(last[f"at/{n}"].tobytes() == a[n].tobytes() for n in NAMES)
    groups = wait_identical(cluster)
    for g, rows in groups.items():
        assert len({r["digest"] for r in rows}) == 1, f"group {g}'s replicas differ: {rows}"


def parts_crossed(cl: LocalCluster, job: str, max_in_flight: int, timeout: float) -> tuple[dict, float]:
    """Rank 0 sends its whole step; rank 1 sends its parts in groups 1 and 2 and, once those are
    applied, its part in group 0. In turn, rank 0 waits in group 0 for rank 1, who waits in group
    1 for rank 0, until ``timeout`` drops rank 1 from group 0's step. Rank 0's answer and seconds."""
    names = [f"{job}/{n}" for n in NAMES]
    with cl.client(timeout=30.0) as c:
        c.create_many({n: np.zeros(4, np.float32) for n in names}, {n: SGD for n in names})
    ones = {n: np.ones(4, np.float32) for n in names}
    out: dict = {}

    def rank0() -> None:
        with cl.client(timeout=30.0, max_in_flight=max_in_flight) as c:
            began = time.monotonic()
            out["reply"] = c.push_step(ones, 0, 2, job=job, rank=0, timeout=timeout)
            out["seconds"] = time.monotonic() - began
    t = threading.Thread(target=rank0)
    t.start()
    with cl.client(timeout=30.0) as c:
        for later in (True, False):
            c.push_step({n: v for n, v in ones.items() if (group_of(n, 3) > 0) == later}, 0, 2, job=job, rank=1,
                        timeout=timeout)
    t.join(30)
    return out["reply"], out["seconds"]


def test_a_step_whose_parts_cross_between_ranks_completes_at_once(cluster) -> None:
    reply, seconds = parts_crossed(cluster, "cross", max_in_flight=16, timeout=6.0)
    assert reply["count"] == 2 and seconds < 5.0, (reply, seconds)
    # the control: parts in turn wait for the step timeout, which leaves a rank out of a part
    reply, seconds = parts_crossed(cluster, "crossturn", max_in_flight=1, timeout=1.5)
    assert reply["count"] < 2 and seconds >= 1.5, (reply, seconds)


def test_a_part_sent_again_with_its_seq_is_counted_once(cluster) -> None:
    """Two unranked contributions; one of them, a part in group 1, is sent three times with
    the same client and seq (a retry after a lost answer), twice at once: the step counts it once."""
    names = [f"once/{n}" for n in NAMES if group_of(f"once/{n}", 3) == 1]
    assert names
    with cluster.client(timeout=30.0) as c:
        c.create_many({n: np.zeros(4, np.float32) for n in names}, {n: SGD for n in names})
        leader = next(r["address"] for r in c.status() if r["group"] == 1 and r["role"] == "leader")
    message = {"op": "push_step", "client": "retried-client", "seq": 1, "ack": 1, "raft_group": 1,
               "tensors": {n: np.full(4, 2.0, np.float32) for n in names}, "step": 0, "workers": 2,
               "job": "once", "timeout": 10.0}
    replies: list = []

    def send() -> None:
        transport = TcpTransport(cluster.token, None, DEFAULT_LIMITS, connect_timeout=2.0)
        try:
            replies.append(transport.call(leader, message, 20.0))
        finally:
            transport.close()
    first = [threading.Thread(target=send) for _ in range(2)]
    for t in first:
        t.start()
    time.sleep(0.3)
    with cluster.client(timeout=30.0) as c:
        other = c.push_step({n: np.full(4, 4.0, np.float32) for n in names}, 0, 2, job="once", timeout=10.0)
        for t in first:
            t.join(20)
        send()
        tensors, _ = c.pull(names)
    assert other["count"] == 2, (other, replies)
    assert len(replies) == 3 and all(r.get("version") is not None for r in replies), replies
    for n in names:          # sgd lr 0.5 on the mean of 2 and 4, once
        np.testing.assert_array_equal(tensors[n], np.full(4, -1.5, np.float32))


def test_answers_read_from_the_members_by_rank_are_the_steps_values(cluster) -> None:
    """spread_answers: rank r reads each group's part from member r mod 3 (two ranks of three
    from a follower), at the step's version: each answer is the step's values, checked against
    a hand computation and the leader's linearizable read, and read at the step's version or later."""
    names = [f"spread/{n}" for n in NAMES]
    with cluster.client(timeout=30.0) as c:
        c.create_many({n: np.zeros(8, np.float32) for n in names}, {n: SGD for n in names})
    answers: list = [None] * K

    def rank(r: int) -> None:
        with cluster.client(timeout=30.0) as c:
            answers[r] = [c.push_step({n: np.full(8, float(r + s + 1), np.float32) for n in names}, s, K,
                                      job="spread", rank=r, timeout=20.0, pull=True, spread_answers=True)
                          for s in range(2)]
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(K)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with cluster.client() as c:
        tensors, _ = c.pull(names)
    want = [np.full(8, -0.5 * 2.0, np.float32), np.full(8, -0.5 * 2.0 - 0.5 * 3.0, np.float32)]  # mean of r+s+1
    for r, replies in enumerate(answers):
        assert replies is not None, f"rank {r} did not finish"
        for s, reply in enumerate(replies):
            assert reply["count"] == K
            assert all(reply["read_version"][g] >= reply["version"][g] for g in reply["version"])
            for n in names:
                np.testing.assert_array_equal(reply["tensors"][n], want[s], err_msg=f"rank {r} step {s} {n}")
    for n in names:
        np.testing.assert_array_equal(tensors[n], want[1])
