"""The coordinator of a cluster run: never computes a gradient.

It creates the run's tensors, starts K worker processes (spawn), restarts one that dies, pulls
the parameters to evaluate them on the test split, polls the cluster about once a second
(applied updates, leader, nodes down) and, if told to, SIGKILLs the leader mid-run.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import wait

from .config import Config
from .data import load_dataset
from .networks import Params, make_model
from .recorder import Recorder, eval_every
from .worker import from_store, run_worker, ssp_worker, store_names


class Workers:
    """K worker processes (spawn), each with a one-way pipe to us; started and stopped by PID."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.ctx = mp.get_context("spawn")
        self.procs: dict[int, mp.Process] = {}
        self.conns: dict[int, object] = {}
        self.restarts = {r: 0 for r in range(cfg.workers)}
        # Workers share the cores with the nodes: one BLAS thread each avoids oversubscription.
        # Children inherit the environment at start, before they import numpy.
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")

    def start(self, rank: int, start_step: int) -> None:
        reader, writer = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=run_worker, args=(self.cfg, rank, writer, start_step),
                                name=f"trainer-worker-{rank}", daemon=True)
        proc.start()
        writer.close()          # ours; the child holds its own copy, so EOF means it is gone
        self.procs[rank], self.conns[rank] = proc, reader
        with open(os.path.join(self.cfg.out, "workers.json"), "w") as f:
            json.dump({r: p.pid for r, p in self.procs.items()}, f)

    def messages(self, rank: int) -> list[tuple]:
        out, conn = [], self.conns[rank]
        try:
            while conn.poll():
                out.append(conn.recv())
        except (EOFError, OSError):     # the worker is gone; what it sent before is in out
            pass
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()     # SIGKILL to this worker's pid
        for proc in self.procs.values():
            proc.join(timeout=5)


def pull_counted(client, names: dict[str, str], min_version: int | None = None) -> tuple[Params, int, int]:
    """(parameters, applied updates, store version) in one read. Every push updates all of a
    run's tensors, so a tensor's own version, read from the same state as the tensors, counts
    exactly the run's updates in them. With ``min_version``: from any node that has applied it
    (spares the leader's log a barrier); without: linearizable, through the leader."""
    reply = client.pull_result(list(names.values()), min_version=min_version, linearizable=min_version is None)
    probe = list(names.values())[-1]
    return from_store(names, reply["tensors"]), reply["tensor_versions"][probe], reply["version"]


def _leader(rows: list[dict]) -> int | None:
    leaders = [r for r in rows if r.get("role") == "leader"]
    return max(leaders, key=lambda r: r.get("term") or 0)["node"] if leaders else None


class Coordinator:
    def __init__(self, cfg: Config, client):
        self.cfg, self.client = cfg, client
        self.data = load_dataset(cfg.dataset)
        self.model = make_model(cfg.model, self.data.features, self.data.classes, cfg.hidden)
        self.names = store_names(cfg, self.model)
        n = len(self.data.x_train)
        self.total, self.every, self.per_epoch = cfg.total_updates(n), eval_every(cfg, n), cfg.updates_per_epoch(n)
        self.n_nodes = len(client.addresses)
        for k, value in self.model.init(cfg.seed).items():      # a no-op for tensors that exist
            client.create(self.names[k], value, cfg.optimizer_spec())
        stats = client.stats()
        self.pushes0 = stats["pushes"]      # the store may hold earlier runs: count only ours
        self.stale0 = {int(k): v for k, v in stats.get("staleness", {}).items()}
        if cfg.mode == "sync":
            cfg.step_offset = stats["sync_applied"] + 1     # sync steps are numbered store-wide
        if cfg.mode == "ssp":
            # All K members exist before the first step: a worker that is slow to start holds
            # the others back (up to --ssp-timeout) instead of joining late at their clock.
            for rank in range(cfg.workers):
                client.ssp_join(cfg.prefix, ssp_worker(rank), cfg.staleness)
        self.rec = Recorder(cfg, self.data, self.model)
        params, self.updates0, self.version = pull_counted(client, self.names)
        self.rec.evaluate(params, 0, self.version, 0.0)
        self.workers = Workers(cfg)
        self.last_step = {r: -1 for r in range(cfg.workers)}
        self.closed = {r: 0 for r in range(cfg.workers)}
        self.acked = {r: 0 for r in range(cfg.workers)}     # pushes the store acknowledged, per rank
        self.newest = self.version          # the newest store version a worker has reported
        self.done: set[int] = set()
        self.failed: set[int] = set()
        self.next_eval, self.rate, self.leader = self.every, 0.0, None
        self.seen_up: dict[int, bool] = {}
        self.bytes_pushed, self.dropped = 0, 0
        self.stale_seen = dict(self.stale0)     # histogram at the previous evaluation
        self.killed: set[int] = set()
        self.poll_at, self.poll_prev = 0.0, (time.monotonic(), self.pushes0)

    def progress(self) -> int:
        """Applied updates as the workers report them (between polls of the store)."""
        if self.cfg.mode in ("sync", "diloco"):        # diloco: the furthest worker's inner steps
            return max(self.last_step.values()) + 1
        return sum(s + 1 for s in self.last_step.values()) // self.cfg.n_push

    def handle(self, rank: int, msg: tuple) -> None:
        if msg[0] == "step":
            step, loss, n_closed = msg[2], msg[3], msg[5]
            self.last_step[rank] = max(self.last_step[rank], step)
            self.closed[rank] = n_closed
            self.acked[rank] += msg[6]
            self.newest = max(self.newest, msg[4])
            self.bytes_pushed += msg[7]
            self.dropped += msg[8]
            self.rec.losses.append(loss)
            self.rec.last_loss = loss
            if self.rec.first_step_s is None:
                self.rec.first_step_s = self.rec.elapsed()    # spawn + imports + first pull + first step
        elif msg[0] == "event":
            self.rec.event(f"worker {rank}: {msg[2]}", self.progress())
        elif msg[0] == "done":
            self.done.add(rank)
        elif msg[0] == "error":
            self.rec.event(f"worker {rank} error: {msg[2].strip().splitlines()[-1]}", self.progress())
            print(msg[2], file=sys.stderr)

    def supervise(self) -> None:
        """Read every worker's messages; restart a worker that died before it was done."""
        live = [r for r in self.workers.procs if r not in self.done | self.failed]
        wait([self.workers.conns[r] for r in live] + [self.workers.procs[r].sentinel for r in live], timeout=0.2)
        for rank in live:
            proc = self.workers.procs[rank]
            alive = proc.is_alive()         # before reading, so nothing it sent can be missed
            for msg in self.workers.messages(rank):
                self.handle(rank, msg)
            if alive or rank in self.done:
                continue
            if self.workers.restarts[rank] < self.cfg.max_restarts:
                self.workers.restarts[rank] += 1
                start = 0 if self.cfg.mode in ("sync", "diloco") else self.last_step[rank] + 1
                self.rec.event(f"worker {rank} (pid {proc.pid}) died with exit code {proc.exitcode}; restarted",
                               self.progress())
                self.workers.start(rank, start)
            else:
                self.failed.add(rank)
                self.rec.event(f"worker {rank} died with exit code {proc.exitcode}; out of restarts", self.progress())

    def poll(self) -> None:
        """About once a second: the store's counters, the roles, nodes that went down or came back."""
        now = time.monotonic()
        if now < self.poll_at:
            return
        self.poll_at = now + 1.0
        st = self.client.stats()
        self.rate = (st["pushes"] - self.poll_prev[1]) / max(now - self.poll_prev[0], 1e-9)
        self.poll_prev, self.version = (now, st["pushes"]), st["version"]
        rows = self.client.status(timeout=0.5)
        self.leader = _leader(rows)
        for row in rows:
            node, up = row["node"], row["role"] != "down"
            if self.seen_up.get(node) and not up and node not in self.killed:
                self.rec.event(f"node {node} down", self.progress())
            elif self.seen_up.get(node) is False and up:
                self.rec.event(f"node {node} up", self.progress())
                self.killed.discard(node)
            self.seen_up[node] = up

    def maybe_kill_leader(self) -> None:
        cfg = self.cfg
        if cfg.kill_leader_at is None or self.leader is None or self.progress() < cfg.kill_leader_at * self.total:
            return
        from raftps.tools.localcluster import LocalCluster
        LocalCluster(cfg.run_dir, nodes=self.n_nodes).kill(self.leader)     # SIGKILL, pid from the pid file
        self.killed.add(self.leader)
        self.rec.event(f"kill node {self.leader} (leader)", self.progress())
        cfg.kill_leader_at, self.leader = None, None

    def maybe_evaluate(self) -> None:
        if self.progress() < self.next_eval:
            return
        self.next_eval += self.every
        # Any node that has what the workers reported: the evaluation sees their pushes so far.
        params, updates, self.version = pull_counted(self.client, self.names, min_version=self.newest)
        self.rec.evaluate(params, updates - self.updates0, self.version, self.progress() / self.per_epoch,
                          **self.push_metrics())

    def push_metrics(self) -> dict:
        """metrics.csv's staleness_mean (of the pushes since the previous evaluation, from the
        store's histogram) and bytes_pushed (payload bytes the workers sent so far)."""
        hist = {int(k): v for k, v in self.client.stats().get("staleness", {}).items()}
        delta = {k: v - self.stale_seen.get(k, 0) for k, v in hist.items()}
        self.stale_seen = hist
        n = sum(delta.values())
        mean = sum(k * v for k, v in delta.items()) / n if n else float("nan")
        return {"staleness_mean": mean, "bytes_pushed": self.bytes_pushed}

    def show(self) -> None:
        restarts = sum(self.workers.restarts.values())
        self.rec.progress.show(elapsed=self.rec.elapsed(), done=self.progress(), total=self.total,
                               epoch=self.progress() / self.per_epoch, loss=self.rec.last_loss,
                               acc=self.rec.last.get("test_acc"), rate=self.rate, version=self.version,
                               leader=self.leader, note=f"restarts {restarts}" if restarts else "")

    def run(self) -> dict:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.max_time
        try:
            for rank in range(cfg.workers):
                self.workers.start(rank, 0)
            while len(self.done | self.failed) < cfg.workers:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run exceeded --max-time {cfg.max_time} s")
                self.supervise()
                self.poll()
                self.maybe_kill_leader()
                self.maybe_evaluate()
                self.show()
        finally:
            self.workers.stop()
        params, updates, version = pull_counted(self.client, self.names)
        updates -= self.updates0
        if self.rec.last.get("updates") != updates:
            self.rec.evaluate(params, updates, version, self.progress() / self.per_epoch, **self.push_metrics())
        st = self.client.stats()
        # The store's histogram counts every push since it started: report this run's share.
        staleness = {int(k): v - self.stale0.get(int(k), 0) for k, v in st.get("staleness", {}).items()}
        return self.rec.finish(params, {
            "worker_restarts": sum(self.workers.restarts.values()), "failed_workers": sorted(self.failed),
            "sync_short_steps": sum(self.closed.values()),
            "acked_pushes": [self.acked[r] for r in range(cfg.workers)],
            "bytes_pushed": self.bytes_pushed, "stale_base_drops": self.dropped,
            "staleness": {k: v for k, v in sorted(staleness.items()) if v},
            "store_version": version, "cluster": self.client.addresses})


def train_cluster(cfg: Config) -> dict:
    from raftps import Client
    with Client(cfg.cluster, timeout=cfg.client_timeout) as client:
        return Coordinator(cfg, client).run()
