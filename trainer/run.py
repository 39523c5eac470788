"""The coordinator: sets a run up, supervises the worker processes, evaluates, records.

It never computes a gradient in cluster modes; it creates the tensors, starts K worker
processes (spawn), restarts one that dies, pulls the parameters to evaluate on the test split,
and writes metrics.csv, events.csv, summary.json, params.npz and plot.png into --out.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import wait

import numpy as np

from .config import Config
from .data import global_batch, load_dataset
from .metrics import EVENTS, METRICS, CsvLog, Progress
from .models import MLP, Params, make_model
from .plot import plot_run
from .worker import from_store, run_worker, store_names

TARGET_ACC = 0.95           # summary.json reports when the run first reached it


class Recorder:
    """Evaluation rows, events, the progress line and the summary, for every mode."""

    def __init__(self, cfg: Config, data, model: MLP):
        self.cfg, self.data, self.model = cfg, data, model
        os.makedirs(cfg.out, exist_ok=True)
        self.metrics = CsvLog(os.path.join(cfg.out, "metrics.csv"), METRICS)
        self.events = CsvLog(os.path.join(cfg.out, "events.csv"), EVENTS)
        self.progress = Progress()
        self.t0 = time.monotonic()
        self.losses: list[float] = []
        self.last_loss = float("nan")     # the latest training loss a worker reported, for the progress line
        self.last = {"test_acc": float("nan"), "test_loss": float("nan")}
        self.reached: dict | None = None
        self.first_step_s: float | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def evaluate(self, params: Params, updates: int, version: int, epoch: float) -> None:
        train_loss = float(np.mean(self.losses)) if self.losses else float("nan")
        self.losses = []
        acc = self.model.accuracy(params, self.data.x_test, self.data.y_test)
        loss = self.model.loss(params, self.data.x_test, self.data.y_test)
        row = dict(time_s=self.elapsed(), updates=updates, version=version, epoch=epoch,
                   train_loss=train_loss, test_loss=loss, test_acc=acc)
        self.metrics.write(**row)
        self.last = row
        if self.reached is None and acc >= TARGET_ACC:
            self.reached = {"time_s": row["time_s"], "updates": updates}

    def event(self, text: str, updates: int) -> None:
        self.events.write(time_s=self.elapsed(), updates=updates, event=text)
        self.progress.done()
        print(f"trainer: {text}", file=sys.stderr, flush=True)

    def finish(self, params: Params, extra: dict) -> dict:
        self.progress.done()
        self.metrics.close()
        self.events.close()
        np.savez(os.path.join(self.cfg.out, "params.npz"), **params)
        cfg = self.cfg
        mode = "local" if cfg.local else cfg.mode
        title = f"{cfg.model} on {cfg.dataset}, {mode}" + ("" if cfg.local else f", {cfg.workers} workers") \
            + f", {cfg.optimizer}"
        plot = plot_run(cfg.out, self.metrics.rows, self.events.rows, title)
        wall = self.elapsed()
        updates = int(self.last.get("updates", 0))
        summary = {"mode": mode, "model": cfg.model, "parameters": self.model.parameters(),
                   "workers": 1 if cfg.local else cfg.workers, "optimizer": cfg.optimizer_spec(),
                   "final_test_acc": self.last["test_acc"], "final_test_loss": self.last["test_loss"],
                   "updates": updates, "wall_s": round(wall, 3),
                   "updates_per_s": round(updates / wall, 2) if wall > 0 else None,
                   f"reached_{TARGET_ACC}": self.reached, "events": [e["event"] for e in self.events.rows],
                   "first_step_s": self.first_step_s, "plot": plot, **extra}
        with open(os.path.join(cfg.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
        return summary


def eval_every(cfg: Config, n_train: int) -> int:
    return max(1, int(cfg.updates_per_epoch(n_train) / max(1, cfg.evals_per_epoch)))


def train(cfg: Config) -> dict:
    return train_local(cfg) if cfg.local else train_cluster(cfg)


def train_local(cfg: Config) -> dict:
    """The baseline: the sync schedule with one process and no store, same optimizer code."""
    from raftps import optim       # pure functions: the exact update rule the state machine applies
    data = load_dataset(cfg.dataset)
    model = make_model(cfg.model, data.features, data.classes, cfg.hidden)
    rec = Recorder(cfg, data, model)
    spec = optim.normalize(cfg.optimizer_spec())
    params = model.init(cfg.seed)
    state = {k: optim.init_state(spec, v) for k, v in params.items()}
    n, total, every = len(data.x_train), cfg.total_updates(len(data.x_train)), eval_every(cfg, len(data.x_train))
    per_epoch = cfg.updates_per_epoch(n)
    rec.evaluate(params, 0, 0, 0.0)
    deadline = time.monotonic() + cfg.max_time
    for step in range(total):
        if time.monotonic() > deadline:
            raise TimeoutError(f"--local run exceeded --max-time {cfg.max_time} s")
        idx = global_batch(n, cfg.batch, step, cfg.seed)
        loss, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        for k in params:
            params[k], state[k] = optim.step(spec, params[k], grads[k], state[k])
        rec.losses.append(loss)
        if (step + 1) % every == 0 or step + 1 == total:
            rec.evaluate(params, step + 1, step + 1, (step + 1) / per_epoch)
        rec.progress.show(elapsed=rec.elapsed(), done=step + 1, total=total, epoch=(step + 1) / per_epoch,
                          loss=loss, acc=rec.last["test_acc"], rate=(step + 1) / max(rec.elapsed(), 1e-9),
                          version=step + 1, leader="local")
    return rec.finish(params, {})


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

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()     # SIGKILL to this worker's pid
        for proc in self.procs.values():
            proc.join(timeout=5)


def _leader(rows: list[dict]) -> int | None:
    leaders = [r for r in rows if r.get("role") == "leader"]
    return max(leaders, key=lambda r: r.get("term") or 0)["node"] if leaders else None


def pull_counted(client, names: dict[str, str], tries: int = 5) -> tuple[Params, int, int]:
    """(parameters, applied updates, store version) with the update count of exactly those
    parameters. Every push updates all of a run's tensors, so a tensor's own version counts the
    run's applied updates; it is read before and after the pull (pull returns only the store
    version), and equal counts bracket the pulled state exactly. Bounded: after ``tries`` the
    later count is used."""
    probe = list(names.values())[-1]
    count = lambda: next(t["version"] for t in client.tensors() if t["name"] == probe)
    for _ in range(tries):
        before = count()
        tensors, version = client.pull(list(names.values()))
        after = count()
        if before == after:
            break
    return from_store(names, tensors), after, version


def train_cluster(cfg: Config) -> dict:
    from raftps import Client
    data = load_dataset(cfg.dataset)
    model = make_model(cfg.model, data.features, data.classes, cfg.hidden)
    names = store_names(cfg, model)
    n = len(data.x_train)
    client = Client(cfg.cluster, timeout=cfg.client_timeout)
    n_nodes = len(client.addresses)
    for k, value in model.init(cfg.seed).items():
        client.create(names[k], value, cfg.optimizer_spec())
    stats = client.stats()
    pushes0 = stats["pushes"]       # the store may hold earlier runs: count only ours
    stale0 = {int(k): v for k, v in stats.get("staleness", {}).items()}
    if cfg.mode == "sync":
        cfg.step_offset = stats["sync_applied"] + 1     # sync steps are numbered store-wide
    rec = Recorder(cfg, data, model)
    total, every, per_epoch = cfg.total_updates(n), eval_every(cfg, n), cfg.updates_per_epoch(n)
    params, updates0, version = pull_counted(client, names)
    rec.evaluate(params, 0, version, 0.0)

    workers = Workers(cfg)
    last_step = {r: -1 for r in range(cfg.workers)}
    closed = {r: 0 for r in range(cfg.workers)}
    done: set[int] = set()
    failed: set[int] = set()
    next_eval, updates, rate, leader = every, 0, 0.0, None
    seen_up: dict[int, bool] = {}
    killed: set[int] = set()
    poll_at, poll_prev = 0.0, (time.monotonic(), pushes0)
    deadline = time.monotonic() + cfg.max_time

    def progress_updates() -> int:
        if cfg.mode == "sync":
            return max(last_step.values()) + 1
        return sum(s + 1 for s in last_step.values()) // cfg.n_push

    def handle(rank: int, msg: tuple) -> None:
        if msg[0] == "step":
            _, _, step, loss, _, n_closed = msg
            last_step[rank] = max(last_step[rank], step)
            closed[rank] = n_closed
            rec.losses.append(loss)
            rec.last_loss = loss
            if rec.first_step_s is None:
                rec.first_step_s = rec.elapsed()    # process spawn + imports + first pull + first step
        elif msg[0] == "done":
            done.add(rank)
        elif msg[0] == "error":
            rec.event(f"worker {rank} error: {msg[2].strip().splitlines()[-1]}", progress_updates())
            print(msg[2], file=sys.stderr)

    def drain(rank: int) -> None:
        conn = workers.conns[rank]
        try:
            while conn.poll():
                handle(rank, conn.recv())
        except (EOFError, OSError):
            pass

    try:
        for rank in range(cfg.workers):
            workers.start(rank, 0)
        while len(done | failed) < cfg.workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run exceeded --max-time {cfg.max_time} s")
            live = [r for r in workers.procs if r not in done | failed]
            wait([workers.conns[r] for r in live] + [workers.procs[r].sentinel for r in live], timeout=0.2)
            for rank in live:
                drain(rank)
                proc = workers.procs[rank]
                if rank in done or proc.is_alive():
                    continue
                drain(rank)
                if rank in done:
                    continue
                code = proc.exitcode
                if workers.restarts[rank] < cfg.max_restarts:
                    workers.restarts[rank] += 1
                    start = 0 if cfg.mode == "sync" else last_step[rank] + 1
                    rec.event(f"worker {rank} (pid {proc.pid}) died with exit code {code}; restarted", progress_updates())
                    workers.start(rank, start)
                else:
                    failed.add(rank)
                    rec.event(f"worker {rank} died with exit code {code}; out of restarts", progress_updates())
            now = time.monotonic()
            if now >= poll_at:      # about once a second: store counters, roles, node failures
                poll_at = now + 1.0
                st = client.stats()
                updates = st["pushes"] - pushes0
                rate = (st["pushes"] - poll_prev[1]) / max(now - poll_prev[0], 1e-9)
                poll_prev, version = (now, st["pushes"]), st["version"]
                rows = client.status(timeout=0.5)
                leader = _leader(rows)
                for row in rows:
                    up = row["role"] != "down"
                    if seen_up.get(row["node"]) and not up and row["node"] not in killed:
                        rec.event(f"node {row['node']} down", progress_updates())
                    elif seen_up.get(row["node"]) is False and up:
                        rec.event(f"node {row['node']} up", progress_updates())
                        killed.discard(row["node"])
                    seen_up[row["node"]] = up
            if cfg.kill_leader_at is not None and leader is not None and progress_updates() >= cfg.kill_leader_at * total:
                from raftps.localcluster import LocalCluster
                LocalCluster(cfg.run_dir, nodes=n_nodes).kill(leader)      # SIGKILL by the pid file's pid
                killed.add(leader)
                rec.event(f"kill node {leader} (leader)", progress_updates())
                cfg.kill_leader_at, leader = None, None
            if progress_updates() >= next_eval:
                next_eval += every
                params, updates, version = pull_counted(client, names)
                updates -= updates0
                rec.evaluate(params, updates, version, progress_updates() / per_epoch)
            rec.progress.show(elapsed=rec.elapsed(), done=progress_updates(), total=total,
                              epoch=progress_updates() / per_epoch, loss=rec.last_loss,
                              acc=rec.last["test_acc"], rate=rate, version=version, leader=leader,
                              note=f"restarts {sum(workers.restarts.values())}" if any(workers.restarts.values()) else "")
    finally:
        workers.stop()
    params, updates, version = pull_counted(client, names)
    updates -= updates0
    if rec.last.get("updates") != updates:
        rec.evaluate(params, updates, version, progress_updates() / per_epoch)
    st = client.stats()
    client.close()
    # The store's histogram counts every push since it started: report this run's share.
    staleness = {int(k): v - stale0.get(int(k), 0) for k, v in st.get("staleness", {}).items()}
    return rec.finish(params, {"worker_restarts": sum(workers.restarts.values()), "failed_workers": sorted(failed),
                               "sync_close_step_calls": sum(closed.values()),
                               "staleness": {k: v for k, v in sorted(staleness.items()) if v}, "store_version": version,
                               "cluster": client.addresses})
