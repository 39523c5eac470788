"""A worker process: its own raftps Client, its own data shard, one of two schedules.

Workers talk to the coordinator only through a one-way pipe of small tuples (each one write
under PIPE_BUF, so a SIGKILLed worker cannot leave half a message for the others):
("step", rank, step, loss, version, closed) after every step, then ("done", rank).
"""
from __future__ import annotations

import traceback
from multiprocessing.connection import Connection

import numpy as np

from .config import Config
from .data import async_batch, async_shard, load_dataset, sync_shard
from .models import MLP, Params, make_model


def store_names(cfg: Config, model: MLP) -> dict[str, str]:
    """Model parameter name -> store tensor name."""
    return {k: f"{cfg.prefix}/{k}" for k in model.init(0)}


def to_store(names: dict[str, str], arrays: Params) -> Params:
    return {names[k]: v for k, v in arrays.items()}


def from_store(names: dict[str, str], tensors: dict[str, np.ndarray]) -> Params:
    return {k: tensors[s] for k, s in names.items()}


def run_worker(cfg: Config, rank: int, conn: Connection, start_step: int) -> None:
    """Process entry point (multiprocessing, spawn)."""
    from raftps import Client     # imported here so the coordinator's --local needs no cluster code
    try:
        data = load_dataset(cfg.dataset)
        model = make_model(cfg.model, data.features, data.classes, cfg.hidden)
        with Client(cfg.cluster, timeout=cfg.client_timeout) as client:
            loop = sync_loop if cfg.mode == "sync" else async_loop
            loop(cfg, rank, conn, start_step, client, data, model)
        conn.send(("done", rank))
    except BaseException:
        conn.send(("error", rank, traceback.format_exc()[-3000:]))
        raise SystemExit(1)


def sync_loop(cfg: Config, rank: int, conn: Connection, start_step: int, client, data, model: MLP) -> None:
    """Every step: gradient of my part of the step's batch, push_sync, wait for the step, pull.

    Each worker sends the mean over its shard; shards are equal, so the store's mean of the K
    contributions is the full batch's mean gradient: the same step as one process would take.
    If the step is not applied within step_timeout (a worker died), close_step applies the mean
    of the contributions that arrived and everyone moves on."""
    from raftps import StepTimeout
    names = store_names(cfg, model)
    total = cfg.total_updates(len(data.x_train))
    # A restarted worker rejoins at the first step the store has not applied yet.
    step = max(start_step, client.stats()["sync_applied"] + 1 - cfg.step_offset)
    tensors, version = client.pull(list(names.values()))
    params = from_store(names, tensors)
    closed = 0
    for step in range(step, total):
        idx = sync_shard(len(data.x_train), cfg.batch, step, cfg.seed, rank, cfg.workers)
        loss, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        store_step = cfg.step_offset + step
        client.push_sync(to_store(names, grads), store_step, cfg.workers)
        try:
            version = client.wait_step(store_step, cfg.step_timeout)
        except StepTimeout:
            version = client.close_step(store_step)    # no-op if another worker closed it first
            closed += 1
        tensors, version = client.pull(list(names.values()), min_version=version, linearizable=False)
        params = from_store(names, tensors)
        conn.send(("step", rank, step, loss, version, closed))


def wait_for_updates(client, names: dict[str, str], updates: int, timeout: float) -> None:
    """Downpour's warm start: let rank 0 train alone until the store has applied ``updates``
    pushes, so the others do not start from (and push stale gradients of) the random init."""
    import time
    probe = list(names.values())[-1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if next(t["version"] for t in client.tensors() if t["name"] == probe) >= updates:
            return
        time.sleep(0.05)
    raise TimeoutError(f"warm-up: fewer than {updates} updates within {timeout} s")


def async_loop(cfg: Config, rank: int, conn: Connection, start_step: int, client, data, model: MLP) -> None:
    """DownpourSGD: pull every n_fetch steps, push the summed gradient every n_push steps, no
    coordination. Each push carries the version last pulled, so the store records staleness."""
    names = store_names(cfg, model)
    shard = async_shard(len(data.x_train), rank, cfg.workers)
    total = cfg.worker_steps(len(data.x_train))
    if rank and cfg.warmup and start_step == 0:
        wait_for_updates(client, names, cfg.warmup, cfg.max_time)
    tensors, version = client.pull(list(names.values()))
    params = from_store(names, tensors)
    pushed, pending, count = version, None, 0
    for step in range(start_step, total):
        if step > start_step and step % cfg.n_fetch == 0:
            # Default: any node that has applied my last push (spreads reads over the followers);
            # --fresh-pull reads through the leader's log: the newest state, less staleness.
            tensors, version = client.pull(list(names.values()), min_version=pushed, linearizable=cfg.fresh_pull)
            params = from_store(names, tensors)
        idx = async_batch(shard, cfg.batch, step, cfg.seed, rank)
        loss, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        pending = grads if pending is None else {k: pending[k] + grads[k] for k in grads}
        count += 1
        if count == cfg.n_push or step == total - 1:
            pushed = client.push(to_store(names, pending), base_version=version)
            pending, count = None, 0
        conn.send(("step", rank, step, loss, pushed, 0))
