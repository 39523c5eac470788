"""A job's tensors have one creator: DiLoCo's rank 0 creates them, the other ranks wait until they
exist (and say which job they waited for if they never do), so K ranks do not each send the whole
model (raftps.torch's ranks do the same, tested last). One member over the
in-memory log, a real client port."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from raftps.client.client import Client
from raftps.client.diloco import DiLoCo
from tests.test_push_step import store  # noqa: F401 (the fixture)

INIT = {"w": np.arange(8, dtype=np.float32), "b": np.ones(2, np.float32)}


def test_rank_1_waits_for_rank_0s_tensors_and_sends_none(store, monkeypatch) -> None:  # noqa: F811
    node, address = store
    monkeypatch.setattr("raftps.client.diloco.CREATOR_WAIT", 10.0)
    with Client(address, timeout=10.0) as c0, Client(address, timeout=10.0) as c1:
        waiting: dict = {}

        def rank1() -> None:
            waiting["created"] = DiLoCo(c1, "one", INIT, rank=1, world_size=2).create()
            waiting["at"] = time.monotonic()
        t = threading.Thread(target=rank1)
        t.start()
        time.sleep(0.5)
        assert "created" not in waiting, "rank 1 returned before any tensor existed"
        made_at = time.monotonic()
        assert sorted(DiLoCo(c0, "one", INIT, rank=0, world_size=2).create()) == ["one/b", "one/w"]
        t.join(15.0)
        assert waiting["created"] == [] and waiting["at"] >= made_at
        assert node.version == 1, "one write created the job's tensors: rank 0's"


def test_rank_1_without_a_creator_names_the_job_it_waited_for(store, monkeypatch) -> None:  # noqa: F811
    _, address = store
    monkeypatch.setattr("raftps.client.diloco.CREATOR_WAIT", 0.6)
    with Client(address, timeout=10.0) as c:
        with pytest.raises(TimeoutError, match=r"job 'lonely'.*rank 0 creates them"):
            DiLoCo(c, "lonely", INIT, rank=1, world_size=2).create()
        assert c.tensors("lonely/") == []


def test_a_torch_rank_1_waits_for_rank_0s_tensors_and_starts_from_them(store, monkeypatch) -> None:  # noqa: F811
    torch = pytest.importorskip("torch")
    import raftps.torch as rpt
    node, address = store
    monkeypatch.setattr("raftps.torch.worker.CREATOR_WAIT", 10.0)
    models = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        models.append(torch.nn.Linear(4, 2))
    started: dict = {}

    def rank1() -> None:
        started["opt"] = rpt.DistributedOptimizer(models[1], cluster=address, optimizer={"name": "sgd", "lr": 0.1},
                                                  prefix="t", mode="sync", rank=1, world_size=2)
    t = threading.Thread(target=rank1)
    t.start()
    time.sleep(0.5)
    assert "opt" not in started, "rank 1 started before the job's tensors existed"
    opt0 = rpt.DistributedOptimizer(models[0], cluster=address, optimizer={"name": "sgd", "lr": 0.1},
                                    prefix="t", mode="sync", rank=0, world_size=2)
    t.join(15.0)
    try:
        assert node.version == 1, "one write created the job's tensors: rank 0's"
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q)
    finally:
        opt0.close()
        started["opt"].close()
