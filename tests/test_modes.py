"""The training modes' engines (raftps/modes/) against a real store of one member (RaftNode over
the in-memory log, a real client port): each engine's transitions, checked against a hand
computation of what the store must hold. The numpy trainer and the torch adapter drive the same
engines (tests/trainer/, tests/pytorch/ run them whole)."""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

from raftps import jobs
from raftps.client.client import Client
from raftps.modes import DROPPED, REFUSED, SENT, Downpour, Easgd, StoreLink, SyncSteps, step_counters
from raftps.modes.downpour import own_step
from raftps.server.node import NodeConfig, RaftNode
from raftps.raft.memory import MemoryLog
from raftps.server.server import ClientServer
from raftps.client.ssp import SspMember

F32 = np.float32
BASE = 28600            # one member: client port BASE + its offset
SGD = {"name": "sgd", "lr": 0.5}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    config = NodeConfig(node_id=1, peers=[f"127.0.0.1:{BASE}"], data_dir=str(tmp_path_factory.mktemp("modes")),
                        secret=b"")
    node = RaftNode(config, log_factory=MemoryLog)
    server = ClientServer(node, *config.bind(config.client_offset))
    yield config.address(1, config.client_offset)
    server.close()
    node.stop()


@pytest.fixture
def client(store):
    with Client(store, timeout=10.0) as c:
        yield c


def test_sync_steps_apply_the_mean_and_a_late_rank_rejoins_at_the_next_step(store, client):
    client.create("sync/w", np.zeros(3, F32), SGD)
    job = jobs.job_name("sync")
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        with Client(store, timeout=10.0) as own:
            steps = SyncSteps(StoreLink(own), job, 2, r, step_timeout=5.0)
            tensors, first = steps.resume(["sync/w"])
            results[r] = (first, steps.step({"sync/w": np.full(3, 1.0 + 2 * r, F32)}, first, ["sync/w"]))
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    for first, result in results.values():
        assert first == 0 and result.count == 2 and result.next_step == 1
        assert result.tensors["sync/w"].tolist() == [-1.0] * 3        # 0 - 0.5 * mean(1, 3)
    alone = SyncSteps(StoreLink(client), job, 2, 0, step_timeout=0.2)
    assert alone.step({"sync/w": np.ones(3, F32)}, 1, ["sync/w"]).count == 1     # rank 1 never came
    late = SyncSteps(StoreLink(client), job, 2, 1, step_timeout=0.2)
    again = late.step({"sync/w": np.ones(3, F32)}, 1, ["sync/w"])
    assert again.next_step == 2 and again.tensors["sync/w"].tolist() == [-1.5] * 3     # not applied twice


def test_downpour_sums_n_push_steps_and_counts_them_for_a_restart(client):
    client.create("dp/w", np.zeros(2, F32), SGD)
    link = StoreLink(client, counters=step_counters(client, "dp", 0, ["dp/w"]))
    client.create_many({name: np.zeros(1) for name in link.counters.values()},
                       {name: {"name": "elastic"} for name in link.counters.values()})
    downpour = Downpour(link, n_push=2, n_fetch=2)
    params = {"dp/w": downpour.resume(["dp/w"])[0]["dp/w"]}
    assert downpour.own_steps
    for g in (1.0, 3.0):
        grads = {"dp/w": np.full(2, g, F32)}
        params = own_step(params, grads, 0.5)           # the replica's own step between pulls
        downpour.add(grads)
    assert params["dp/w"].tolist() == [-2.0, -2.0] and downpour.push_due and downpour.pull_due
    assert downpour.push(downpour.take()) == SENT and downpour.since_push == 0
    assert downpour.pull(["dp/w"])["dp/w"].tolist() == [-2.0, -2.0]    # 0 - 0.5 * (1 + 3)
    restarted = StoreLink(client, counters=step_counters(client, "dp", 0, ["dp/w"]))
    assert restarted.resume(["dp/w"])[1] == 2                           # the two steps that push carried


def test_ssp_over_its_bound_waits_or_is_refused(store, client):
    client.create("ssp/w", np.zeros(2, F32), SGD)
    fast = SspMember(client, jobs.job_name("ssp"), "fast", 0, 5.0)
    SspMember(client, jobs.job_name("ssp"), "slow", 0, 5.0)
    refusing = Downpour(StoreLink(client, fast, wait_at_bound=False))
    assert refusing.n_push == refusing.n_fetch == 1
    refusing.resume(["ssp/w"])
    for expected in (SENT, REFUSED):            # clock 1, then 1 ahead of "slow" with s = 0
        refusing.add({"ssp/w": np.ones(2, F32)})
        assert refusing.push(refusing.take()) == expected
    assert client.pull(["ssp/w"])[0]["ssp/w"].tolist() == [-0.5, -0.5]
    waiting = Downpour(StoreLink(client, fast))
    waiting.resume(["ssp/w"])
    with Client(store, timeout=10.0) as slow:           # its own client: fast's waits at the leader
        slow_push = threading.Timer(0.2, lambda: slow.push({"ssp/w": np.ones(2, F32)},
                                                          ssp={"ssp_group": jobs.job_name("ssp"), "worker": "slow"}))
        slow_push.start()
        waiting.add({"ssp/w": np.ones(2, F32)})
        assert waiting.push(waiting.take()) == SENT     # refused, waited for "slow", sent again
        slow_push.join(5)
    assert client.pull(["ssp/w"])[0]["ssp/w"].tolist() == [-1.5, -1.5]


def test_easgd_moves_centre_and_copy_by_alpha_times_their_difference(client):
    client.create("ea/w", np.full(2, 1.0, F32), {"name": "elastic"})
    easgd = Easgd(StoreLink(client), alpha=0.25, n_push=2, specs={"ea/w": SGD})
    x = {"ea/w": np.array(easgd.resume(["ea/w"])[0]["ea/w"])}
    for _ in range(2):
        x = easgd.local_step(x, {"ea/w": np.full(2, -4.0, F32)})        # +2 each: x = 5
        due = easgd.step_done()
    assert due and x["ea/w"].tolist() == [5.0, 5.0]
    x = easgd.exchange(x)                       # delta = 0.25 * (5 - 1) = 1
    assert x["ea/w"].tolist() == [4.0, 4.0] and easgd.last_push_bytes == 8
    assert client.pull(["ea/w"])[0]["ea/w"].tolist() == [2.0, 2.0]


def test_a_dropped_push_is_reported_not_raised(client):
    client.create("ada/w", np.zeros(2, F32), {"name": "adarevision", "lr": 0.1, "window": 1})
    link = StoreLink(client)
    downpour = Downpour(link)
    downpour.resume(["ada/w"])
    stale = link.version
    for _ in range(3):
        client.push({"ada/w": np.ones(2, F32)})
    link.version = stale                        # a base the window of one no longer holds
    downpour.add({"ada/w": np.ones(2, F32)})
    assert downpour.push(downpour.take()) == DROPPED


def test_the_old_names_of_job_functions_still_answer():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert jobs.group("p") == jobs.job_name("p") == "p/_raftps/group"       # the stored name stays
        assert jobs.diloco_group("p", 0, 1) == jobs.diloco_job("p", 0, 1)
    assert [w.category for w in caught] == [DeprecationWarning] * 2 and "jobs.job_name" in str(caught[0].message)
