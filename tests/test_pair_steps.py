"""Synchronous steps in pairs (push_step's ``pairs``, pair_steps.py) on a real 3-node cluster
with two Raft groups, four ranks on loopback (each a client of its own, partners connected by
their own authenticated TCP connection): the parameters after the steps are those of the
pairwise sum, computed here by numpy; when a rank's client dies mid-run (its sockets closed),
its partner falls back to contributing alone, every step applies, no rank is counted twice,
and the run ends."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from raftps.client.pair_steps import halves
from tests.conftest import start_cluster

BASE = 33470
SGD = {"name": "sgd", "lr": 1.0}
SIZES = {"a": 30_000, "b": 20_000, "c": 25_000, "d": 40_000, "e": 5_000}   # float32 elements
CHUNK = 90_000                       # bytes: several chunks per group, split between partners
WORLD = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("pairs"), BASE, groups=2)
    yield cl
    cl.wipe()


def gradients(rank: int, step: int) -> dict[str, np.ndarray]:
    """Values whose float32 sums round differently by order (magnitudes 1e-3..1e3, mixed signs)."""
    rng = np.random.default_rng(1000 * step + rank)
    return {k: (rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
            for k, n in SIZES.items()}


def start_values() -> dict[str, np.ndarray]:
    return {k: np.linspace(-1, 1, n, dtype=np.float32) for k, n in SIZES.items()}


def start_job(cl, prefix: str) -> dict:
    """The job's tensors created; a client per rank."""
    with cl.client() as c:
        c.create_many({f"{prefix}/{k}": v for k, v in start_values().items()},
                      {f"{prefix}/{k}": SGD for k in SIZES})
    return {r: cl.client(timeout=30) for r in range(WORLD)}


def run_ranks(cl, prefix: str, steps: range, ranks: list[int], answers: dict, clients: dict,
              timeout: float = 10.0) -> dict[int, BaseException]:
    """Each rank in ``ranks`` on a thread with a client of its own, pairs on, steps ``steps``;
    each answer into answers[(rank, step)]; the errors by rank."""
    errors: dict[int, BaseException] = {}

    def rank_loop(rank: int) -> None:
        try:
            for step in steps:
                grads = {f"{prefix}/{k}": v for k, v in gradients(rank, step).items()}
                answers[(rank, step)] = clients[rank].push_step(grads, step, WORLD, job=prefix, rank=rank,
                                                                timeout=timeout, pull=True, chunk_bytes=CHUNK,
                                                                pairs=True)
        except BaseException as exc:        # reported to the test
            errors[rank] = exc
    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120.0)
    assert not any(t.is_alive() for t in threads), "a rank did not finish within 120 s"
    return errors


def test_halves_split_a_steps_chunks_by_bytes_the_same_on_both_partners() -> None:
    items = [(0, {"x": np.zeros(n, np.float32)}) for n in (100, 100, 300, 50, 50, 100)]
    assert halves(items, 2) == [2, 3, 2, 3, 3, 3]        # bytes: 400 and 300 after the fifth
    assert halves(items, 2) == halves(list(items), 2)


def test_paired_steps_leave_the_pairwise_sums_bits(cluster) -> None:
    prefix = "pairs-ok"
    clients = start_job(cluster, prefix)
    answers: dict = {}
    try:
        errors = run_ranks(cluster, prefix, range(3), list(range(WORLD)), answers, clients)
    finally:
        for client in clients.values():
            client.close()
    assert not errors, errors
    want = start_values()
    series_differs = False
    for step in range(3):
        g = [gradients(r, step) for r in range(WORLD)]
        for k in SIZES:
            pairwise = np.add(np.add(g[0][k], g[1][k]), np.add(g[2][k], g[3][k]))
            series = np.add(np.add(np.add(g[0][k], g[1][k]), g[2][k]), g[3][k])
            series_differs |= pairwise.tobytes() != series.tobytes()
            want[k] = want[k] - pairwise / np.float32(4)
    assert series_differs, "the sums in series and in pairs must differ, or this test cannot fail"
    with cluster.client() as c:
        got, _ = c.pull([f"{prefix}/{k}" for k in SIZES])
    for k in SIZES:
        assert got[f"{prefix}/{k}"].tobytes() == want[k].tobytes(), k
        for rank in range(WORLD):       # every rank's answer: the step's values, half of them relayed
            assert answers[(rank, 2)]["tensors"][f"{prefix}/{k}"].tobytes() == want[k].tobytes(), (rank, k)
    assert all(answers[(r, s)]["count"] == WORLD for r in range(WORLD) for s in range(3))


def test_a_partner_gone_mid_run_costs_its_rank_not_the_run(cluster) -> None:
    prefix = "pairs-kill"
    clients = start_job(cluster, prefix)
    answers: dict = {}
    try:
        assert not run_ranks(cluster, prefix, range(2), list(range(WORLD)), answers, clients)
        # rank 1 dies at the start of step 2: its sockets close (its partner's link breaks)
        clients[1].close()
        started = time.monotonic()
        errors = run_ranks(cluster, prefix, range(2, 4), [0, 2, 3], answers, clients, timeout=3.0)
        elapsed = time.monotonic() - started
    finally:
        for client in clients.values():
            client.close()
    assert not errors, errors
    assert elapsed < 60.0
    for step in (2, 3):      # rank 0 alone, the pair [2, 3]: three gradients, none twice
        assert all(answers[(r, step)]["count"] == 3 for r in (0, 2, 3)), [answers[(r, step)]["count"] for r in (0, 2, 3)]
    want = start_values()
    for step in range(4):
        g = [gradients(r, step) for r in range(WORLD)]
        for k in SIZES:
            if step < 2:
                want[k] = want[k] - np.add(np.add(g[0][k], g[1][k]), np.add(g[2][k], g[3][k])) / np.float32(4)
            else:
                want[k] = want[k] - np.add(g[0][k], np.add(g[2][k], g[3][k])) / np.float32(3)
    with cluster.client() as c:
        got, _ = c.pull([f"{prefix}/{k}" for k in SIZES])
    for k in SIZES:
        np.testing.assert_array_equal(got[f"{prefix}/{k}"], want[k], err_msg=k)


def test_a_partner_sigkilled_mid_run_leaves_its_partner_stepping_alone(cluster) -> None:
    """Four ranks as processes (raftps.chaos.fleet_worker, sync-pull with pairs); rank 1 is
    SIGKILLed while the ranks step; the other three finish every step, no step counts more ranks
    than are alive, and rank 0, alone, is counted beside the pair [2, 3]."""
    steps, timeout = 6, 2.0
    argv = [sys.executable, "-m", "raftps.chaos.fleet_worker", "sync-pull", cluster.addresses, "pairs-sigkill"]
    env = {**os.environ, **cluster.client_env, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen(argv + [str(r), str(WORLD), "600000", str(steps), str(timeout), "8", "fp32", "leader",
                                      "100000", "pairs"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(WORLD)]
    try:
        with cluster.client() as c:            # once the ranks are stepping, paired
            deadline = time.monotonic() + 60.0
            while c.sync_applied("pairs-sigkill") < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGKILL)
        outs = {r: procs[r].communicate(timeout=90)[0].decode() for r in (0, 2, 3)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    reports = {r: json.loads(out.strip().splitlines()[-1]) for r, out in outs.items()}
    assert all(rep["ok"] for rep in reports.values()), outs
    counts = {r: rep["counts"] for r, rep in reports.items()}
    # never more than the ranks alive; 0: a contribution answered late (its step applied without it)
    assert all(len(c) == steps and all(0 <= n <= WORLD for n in c) for c in counts.values()), counts
    assert counts[2][:2] == [WORLD, WORLD] and counts[2][-1] < WORLD, counts
    assert 3 in counts[0], f"rank 0 never counted beside the pair [2, 3] after its partner died: {counts}"


def test_a_returning_rank_does_not_wait_a_timeout_for_a_partner_that_stepped_on_alone(cluster) -> None:
    """Rank 1 goes away (its client closed: its partner's link breaks); rank 0 steps on unpaired.
    Rank 1 comes back at step 3 with a client of its own: it looks for its partner briefly, not
    for the step's timeout (20 s), and the step after counts every rank again (rank 1, known
    absent to the store since step 2's timeout, is waited for once it contributed)."""
    prefix = "pairs-return"
    clients = start_job(cluster, prefix)
    answers: dict = {}
    try:
        assert not run_ranks(cluster, prefix, range(2), list(range(WORLD)), answers, clients)
        clients[1].close()
        assert not run_ranks(cluster, prefix, range(2, 3), [0, 2, 3], answers, clients, timeout=3.0)
        assert all(answers[(r, 2)]["count"] == 3 for r in (0, 2, 3)), answers
        clients[1] = cluster.client(timeout=30)          # rank 1 back, a new process's client
        took: dict[int, float] = {}

        def timed(rank: int) -> None:
            started = time.monotonic()
            grads = {f"{prefix}/{k}": v for k, v in gradients(rank, 3).items()}
            answers[(rank, 3)] = clients[rank].push_step(grads, 3, WORLD, job=prefix, rank=rank, timeout=20.0,
                                                         pull=True, chunk_bytes=CHUNK, pairs=True)
            took[rank] = time.monotonic() - started
        back = threading.Thread(target=timed, args=(1,), daemon=True)
        back.start()
        assert not run_ranks(cluster, prefix, range(3, 4), [0, 2, 3], answers, clients, timeout=20.0)
        back.join(60.0)
        assert not back.is_alive() and 1 in took, "rank 1's step 3 did not finish within 60 s"
        assert took[1] < 15.0, f"the returning rank took {took[1]:.1f} s: it waited out the timeout for its partner"
        assert not run_ranks(cluster, prefix, range(4, 5), list(range(WORLD)), answers, clients, timeout=20.0)
    finally:
        for client in clients.values():
            client.close()
    assert [answers[(r, 4)]["count"] for r in range(WORLD)] == [WORLD] * WORLD, [answers[(r, 4)] for r in range(WORLD)]
