"""A rank known absent is not waited for (server/absent_ranks.py, aggregate.py): once a step of a
job went out without a rank after its timeout, the job's later steps, every chunk of them, go out
as soon as the other ranks are in; the rank's next contribution makes the step after wait for it
again. A real 3-node cluster with two Raft groups (so each group's leader keeps its own set) and
three ranks, each on a thread with a client of its own."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from raftps.server.absent_ranks import AbsentRanks, base_job, missing_ranks, step_complete
from tests.conftest import start_cluster

BASE = 15210                          # below the ephemeral range (32768-60999): no client socket holds it
SGD = {"name": "sgd", "lr": 1.0}
SIZES = {"a": 20_000, "b": 12_000, "c": 16_000, "d": 8_000}    # float32 elements
CHUNK = 40_000                        # bytes: several chunks per group
WORLD = 3
TIMEOUT = 20.0                        # each step's timeout: waiting it out three times takes 60 s


def test_base_job_strips_the_chunk_suffix_only() -> None:
    assert base_job("j") == "j" and base_job("j:chunk3") == "j" and base_job(":chunk1") == ""
    assert base_job("j:chunkx") == "j:chunkx" and base_job("a:chunk2:b") == "a:chunk2:b"


def test_a_step_is_complete_once_every_rank_is_counted_or_absent() -> None:
    assert step_complete(3, {0, 1, 2}, set())
    assert not step_complete(3, {0, 1}, set())
    assert step_complete(3, {0, 1}, {2})
    assert not step_complete(3, {0}, {2})
    assert not step_complete(3, set(), {0, 1, 2})       # a step needs one contribution
    assert step_complete(2, {0, 1}, {5})                 # a rank beyond the step's workers changes nothing
    assert missing_ranks(4, [0, 2]) == {1, 3}


def test_absence_is_per_base_job_undone_by_a_contribution_and_dropped_with_the_term() -> None:
    absent = AbsentRanks()
    absent.observe_term(3)
    absent.mark_absent("j:chunk2", {2})
    assert absent.absent("j") == {2} and absent.absent("j:chunk5") == {2} and absent.absent("k") == set()
    assert absent.complete("j:chunk1", 3, {0, 1}) and not absent.complete("k", 3, {0, 1})
    assert absent.mark_present("j", [0]) == set() and absent.absent("j") == {2}
    assert absent.mark_present("j:chunk1", [2, 3]) == {2} and absent.absent("j") == set()
    absent.mark_absent("j", {1})
    absent.observe_term(3)
    assert absent.absent("j") == {1}
    absent.observe_term(4)               # a new term: this leader knows nobody absent
    assert absent.absent("j") == set()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("absent"), BASE, groups=2)
    yield cl
    cl.wipe()


def steps_of(cl, clients: dict, prefix: str, step: int, ranks: list[int], chunk_bytes: int) -> tuple[dict, float]:
    """Step ``step`` by ``ranks`` at once (each contributes ones to every tensor): their answers,
    and the seconds until the last came back."""
    answers: dict[int, object] = {}

    def rank(r: int) -> None:
        grads = {f"{prefix}/{k}": np.ones(n, np.float32) for k, n in SIZES.items()}
        try:
            answers[r] = clients[r].push_step(grads, step, WORLD, job=prefix, rank=r, timeout=TIMEOUT,
                                              chunk_bytes=chunk_bytes)
        except BaseException as exc:        # reported to the test
            answers[r] = exc
    started = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120.0)
    assert not any(t.is_alive() for t in threads), f"step {step}: a rank did not finish within 120 s"
    errors = {r: a for r, a in answers.items() if isinstance(a, BaseException)}
    assert not errors, errors
    return answers, time.monotonic() - started


@pytest.mark.parametrize("chunk_bytes", [0, CHUNK], ids=["whole", "chunked"])
def test_a_rank_known_absent_is_not_waited_for_until_it_contributes_again(cluster, chunk_bytes: int) -> None:
    prefix = f"absent-{chunk_bytes}"
    with cluster.client() as c:
        c.create_many({f"{prefix}/{k}": np.zeros(n, np.float32) for k, n in SIZES.items()},
                      {f"{prefix}/{k}": SGD for k in SIZES})
    clients = {r: cluster.client(timeout=60) for r in range(WORLD)}
    try:
        answers, _ = steps_of(cluster, clients, prefix, 0, [0, 1, 2], chunk_bytes)
        assert [answers[r]["count"] for r in range(WORLD)] == [3, 3, 3], answers
        # rank 2 stops contributing: the first step without it waits out its timeout
        answers, first = steps_of(cluster, clients, prefix, 1, [0, 1], chunk_bytes)
        assert [answers[r]["count"] for r in (0, 1)] == [2, 2], answers
        assert first >= TIMEOUT - 1.0, f"step 1 went out after {first:.1f} s, before rank 2's timeout"
        total = 0.0
        for step in (2, 3, 4):          # rank 2 known absent: not waited for (without it: 3 x 20 s)
            answers, took = steps_of(cluster, clients, prefix, step, [0, 1], chunk_bytes)
            total += took
            assert [answers[r]["count"] for r in (0, 1)] == [2, 2], (step, answers)
        assert total < TIMEOUT, f"steps 2-4 took {total:.1f} s: each waited for the absent rank"
        # rank 2 contributes again: counted, or answered late (its step went out without it)
        answers, _ = steps_of(cluster, clients, prefix, 5, [0, 1, 2], chunk_bytes)
        assert answers[2].get("late") or answers[2]["count"] == 3, answers[2]
        answers, _ = steps_of(cluster, clients, prefix, 6, [0, 1, 2], chunk_bytes)
        assert [answers[r]["count"] for r in range(WORLD)] == [3, 3, 3], answers   # waited for it again
        assert not any(answers[r].get("late") for r in range(WORLD)), answers
        with cluster.client() as c:     # every contribution is ones: each of the 7 steps applied its mean, 1, once
            got, _ = c.pull([f"{prefix}/{k}" for k in SIZES])
        for k, n in SIZES.items():
            np.testing.assert_array_equal(got[f"{prefix}/{k}"], np.full(n, -7.0, np.float32), err_msg=k)
    finally:
        for client in clients.values():
            client.close()
