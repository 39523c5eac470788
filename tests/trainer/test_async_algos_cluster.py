"""Asynchrony-aware modes against a real 3-node cluster: the ssp_wait server op, and short
trainer runs (real worker processes) of SSP with top-k pushes, EASGD, AdaRevision with fp16
pushes, and SSP surviving a dead worker."""
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from raftps import NotInGroup
from raftps.tools.localcluster import LocalCluster
from trainer_helpers import metric_rows, run_trainer, start_trainer, wait_for

BASE_PORT = 11000       # raft 11001-11003, clients 11101-11103, data plane 11201-11203
SMALL = ["--model", "mlp", "--hidden", "64", "--workers", "3", "--epochs", "3"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = LocalCluster(str(tmp_path_factory.mktemp("async-algos")), nodes=3, base_port=BASE_PORT)
    try:
        cl.start(timeout=60)
        yield cl
    finally:
        cl.wipe()


def test_ssp_wait_blocks_the_fast_worker_and_a_stuck_one_is_dropped_by_a_log_entry(cluster):
    with cluster.client(timeout=20) as a, cluster.client(timeout=20) as b:
        a.create("ssp/w", np.zeros(4, np.float32), {"name": "sgd", "lr": 1.0})
        for client, worker in ((a, "a"), (b, "b")):
            assert client.ssp_join("g", worker, 0) == 0
        assert a.push_result({"ssp/w": np.ones(4, np.float32)}, ssp={"ssp_group": "g", "worker": "a"})["clock"] == 1
        waited = a.ssp_wait("g", "a", 0.3)
        assert not waited["ready"] and waited["slowest"] == [["b", 0]]
        threading.Timer(0.3, lambda: b.push({"ssp/w": np.ones(4, np.float32)}, ssp={"ssp_group": "g", "worker": "b"})).start()
        t0 = time.monotonic()
        assert a.ssp_wait("g", "a", 10.0)["ready"]                 # released by b's push, not the timeout
        assert time.monotonic() - t0 < 8.0
        a.push({"ssp/w": np.ones(4, np.float32)}, ssp={"ssp_group": "g", "worker": "a"})      # a: 2, b: 1
        stuck = a.ssp_wait("g", "a", 0.2)
        assert not stuck["ready"]
        assert a.ssp_drop("g", "b", stuck["slowest"][0][1]) is True
        assert a.ssp_wait("g", "a", 0.2)["ready"]
        with pytest.raises(NotInGroup):
            b.push({"ssp/w": np.ones(4, np.float32)}, ssp={"ssp_group": "g", "worker": "b"})
        assert b.ssp_join("g", "b", 0) == 2                         # rejoins at the slowest clock


def test_ssp_bsp_reject_mode_with_topk_pushes_completes_and_cuts_bytes(cluster, tmp_path):
    out = str(tmp_path / "ssp")
    summary = run_trainer(["--cluster", cluster.addresses, "--mode", "ssp", "--staleness", "0", *SMALL,
                           "--ssp-on-bound", "reject", "--compress", "topk:0.02", "--prefix", "ssp-topk"], out,
                          env=cluster.client_env)
    assert summary["updates"] == 63 and summary["failed_workers"] == []        # 3 x 3 epochs x 7 steps
    dense = 63 * summary["parameters"] * 4
    assert summary["bytes_pushed"] * 20 < dense, (summary["bytes_pushed"], dense)
    rows = metric_rows(out)
    assert rows[-1]["bytes_pushed"] and rows[-1]["staleness_mean"] != ""
    assert summary["final_test_acc"] > 0.5                 # it learns (short run, 2% of the gradient)


def test_easgd_and_adarevision_train(cluster, tmp_path):
    easgd = run_trainer(["--cluster", cluster.addresses, "--mode", "easgd", *SMALL, "--prefix", "easgd"],
                        str(tmp_path / "easgd"), env=cluster.client_env)
    assert easgd["optimizer"] == {"name": "elastic"} and easgd["updates"] == 63
    assert easgd["final_test_acc"] > 0.6
    ada = run_trainer(["--cluster", cluster.addresses, "--mode", "async", "--optimizer", "adarevision", *SMALL,
                       "--compress", "fp16", "--prefix", "ada"], str(tmp_path / "ada"), env=cluster.client_env)
    assert ada["optimizer"]["name"] == "adarevision" and ada["updates"] == 63 and ada["stale_base_drops"] == 0
    assert ada["bytes_pushed"] == 63 * ada["parameters"] * 2           # fp16: 2 bytes per element
    assert ada["final_test_acc"] > 0.6
    # every replica applied the elastic, AdaRevision and top-k entries to the same bits
    with cluster.client() as client:
        deadline = time.monotonic() + 20
        while len({(r["version"], r["digest"]) for r in client.status()}) != 1:
            assert time.monotonic() < deadline, client.status()
            time.sleep(0.1)


def test_ssp_bsp_survives_a_dead_worker_that_is_not_replaced(cluster, tmp_path):
    """s = 0 and no restarts: the survivors drop the SIGKILLed worker after --ssp-timeout (by an
    ssp_drop entry) and finish instead of waiting for it forever. The coordinator enrols all
    three at clock 0 before any starts, so rank 1's clock counts its applied pushes."""
    out = str(tmp_path / "ssp-dead")
    proc = start_trainer(["--cluster", cluster.addresses, "--mode", "ssp", "--staleness", "0", "--model", "mlp",
                          "--hidden", "64", "--workers", "3", "--epochs", "20", "--max-restarts", "0",
                          "--ssp-timeout", "2", "--prefix", "ssp-dead"], out, env=cluster.client_env)
    try:
        with cluster.client() as c:          # rank 1 is stepping: three of its pushes applied
            wait_for(lambda: (c.ssp_wait("ssp-dead", "rank1", 0.0).get("clock") or 0) >= 3, 60, "rank 1 at clock 3")
        with open(os.path.join(out, "workers.json")) as f:
            os.kill(json.load(f)["1"], signal.SIGKILL)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["failed_workers"] == [1]
    assert any("ssp: dropped rank1" in e for e in summary["events"]), summary["events"]
    acked = summary["acked_pushes"]
    assert acked[0] == acked[2] == 20 * 7, acked                 # both survivors ran to the end
    # Every acknowledged push applied once; beyond them at most the one rank 1 had in flight.
    assert acked[1] >= 1 and summary["updates"] - sum(acked) in (0, 1), (summary["updates"], acked)
