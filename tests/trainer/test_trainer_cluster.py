"""Training against a real 3-node cluster (node processes, sockets, worker processes).

One cluster serves the whole module; each run uses its own tensor prefix, and sync runs number
their steps after the store's last applied step, so runs do not see each other."""
import json
import os
import signal

import numpy as np
import pytest

from raftps.tools.localcluster import LocalCluster
from trainer_helpers import finish, metric_rows, run_trainer, start_trainer, wait_for

BASE_PORT = 7300        # raft 7301-7303, clients 7401-7403, data plane 7501-7503
SMALL = ["--model", "mlp", "--hidden", "64"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = LocalCluster(str(tmp_path_factory.mktemp("trainer-cluster")), nodes=3, base_port=BASE_PORT)
    try:
        cl.start(timeout=60)
        yield cl
    finally:
        cl.wipe()       # stops every node it started, by PID, then deletes their data


def max_abs_diff(out_a: str, out_b: str) -> float:
    a, b = np.load(os.path.join(out_a, "params.npz")), np.load(os.path.join(out_b, "params.npz"))
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def local_baseline(tmp_path, steps: int) -> str:
    out = str(tmp_path / "local")
    run_trainer(["--local", *SMALL, "--steps", str(steps), "--seed", "5"], out)
    return out


def test_sync_four_workers_equals_local_full_batch_sgd(cluster, tmp_path):
    out = str(tmp_path / "sync")
    summary = run_trainer(["--cluster", cluster.addresses, "--mode", "sync", "--workers", "4", *SMALL,
                           "--steps", "50", "--seed", "5", "--prefix", "parity"], out, env=cluster.client_env)
    assert summary["updates"] == 50 and summary["worker_restarts"] == 0
    assert summary["sync_short_steps"] == 0         # every step had all 4 contributions
    progress = [line for line in summary["log"].splitlines() if "push/s" in line]
    assert progress and "loss" not in progress[0]   # drawn before any worker reported a loss
    assert not [line for line in progress if "nan" in line]
    diff = max_abs_diff(out, local_baseline(tmp_path, 50))
    assert diff < 1e-5, diff


def test_sync_parity_survives_leader_kill(cluster, tmp_path):
    """push_sync is exactly-once across a leader failure, so the parameters still match."""
    out = str(tmp_path / "sync-kill")
    try:
        summary = run_trainer(["--cluster", cluster.addresses, "--mode", "sync", "--workers", "4", *SMALL,
                               "--steps", "50", "--seed", "5", "--prefix", "parity-kill",
                               "--kill-leader-at", "0.4", "--run-dir", cluster.run_dir], out,
                              env=cluster.client_env)
    finally:
        cluster.start(timeout=60)         # bring the killed node back for the next tests
    assert any(e.startswith("kill node") for e in summary["events"]), summary["events"]
    assert summary["updates"] == 50 and summary["worker_restarts"] == 0
    assert max_abs_diff(out, local_baseline(tmp_path, 50)) < 1e-5


def test_downpour_replica_takes_its_own_steps_between_pulls(cluster, tmp_path):
    """One Downpour worker with --n-fetch 4 --n-push 4 (no other worker, so no staleness):
    between pulls the replica steps itself (Dean et al. 2012, Algorithm 7.1), so the store ends
    where 12 plain SGD steps on the worker's batches end, up to float summation order."""
    from trainer.config import Config
    from trainer.data import async_batch, async_shard, load_dataset
    from trainer.networks import make_model
    out = str(tmp_path / "downpour")
    summary = run_trainer(["--cluster", cluster.addresses, "--mode", "async", "--workers", "1", *SMALL,
                           "--steps", "12", "--n-fetch", "4", "--n-push", "4", "--seed", "4", "--prefix", "downpour"],
                          out, env=cluster.client_env)
    assert summary["updates"] == 3 and summary["acked_pushes"] == [3]
    cfg = Config(hidden=(64,), seed=4)
    data = load_dataset(cfg.dataset)
    model = make_model(cfg.model, data.features, data.classes, cfg.hidden)
    params, shard = model.init(cfg.seed), async_shard(len(data.x_train), 0, 1)
    for step in range(12):
        idx = async_batch(shard, cfg.batch, step, cfg.seed, 0)
        _, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        params = {k: v - np.float32(0.1) * grads[k] for k, v in params.items()}
    stored = np.load(os.path.join(out, "params.npz"))
    assert max(float(np.abs(stored[k] - params[k]).max()) for k in params) < 1e-5


def test_async_1m_mlp_survives_leader_kill(cluster, tmp_path):
    """Four Downpour workers on the 1.08M-parameter MLP; the leader is SIGKILLed mid-run."""
    out = str(tmp_path / "async")
    try:
        summary = run_trainer(["--cluster", cluster.addresses, "--mode", "async", "--workers", "4",
                               "--model", "mlp", "--epochs", "5", "--seed", "1", "--prefix", "async",
                               "--kill-leader-at", "0.4", "--run-dir", cluster.run_dir], out, timeout=150,
                              env=cluster.client_env)
    finally:
        cluster.start(timeout=60)
    assert summary["parameters"] == 1_076_010
    assert summary["final_test_acc"] >= 0.93, summary
    assert summary["worker_restarts"] == 0 and summary["failed_workers"] == []
    assert any(e.startswith("kill node") for e in summary["events"]), summary["events"]
    assert summary["updates"] == 100                      # 4 workers x 5 epochs x 5 pushes, none lost or doubled
    assert sum(summary["staleness"].values()) >= 100      # the store recorded the staleness of each push
    assert os.path.getsize(os.path.join(out, "plot.png")) > 10_000


def test_killed_sync_worker_is_restarted_and_rejoins(cluster, tmp_path):
    out = str(tmp_path / "worker-kill")
    proc = start_trainer(["--cluster", cluster.addresses, "--mode", "sync", "--workers", "4", *SMALL,
                          "--steps", "60", "--step-timeout", "3", "--seed", "2", "--prefix", "wkill"], out,
                         env=cluster.client_env)
    try:
        wait_for(lambda: len(metric_rows(out)) >= 2, 60, "the first evaluation after 11 steps")
        with open(os.path.join(out, "workers.json")) as f:
            victim = json.load(f)["1"]
        os.kill(victim, signal.SIGKILL)
        summary = finish(proc, out, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(os.path.join(out, "workers.json")) as f:
        assert json.load(f)["1"] != victim                 # a new process has rank 1
    assert summary["worker_restarts"] == 1 and summary["failed_workers"] == []
    assert any(f"pid {victim}" in e for e in summary["events"])
    assert summary["updates"] == 60                        # every sync step applied exactly once
    assert summary["final_test_acc"] >= 0.8
    with cluster.client() as c:
        assert c.stats()["sync_applied"] >= 60
