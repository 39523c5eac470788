"""A worker process: its own raftps Client, its own data shard, and its mode's engine (sync,
async and ssp, easgd: raftps/modes/; diloco: raftps/client/diloco.py), the one raftps.torch drives too:
this module only moves the numpy network's arrays in and out of it.

Workers talk to the coordinator only through a one-way pipe of small tuples (each one write
under PIPE_BUF, so a SIGKILLed worker cannot leave half a message for the others):
("step", rank, step, loss, version, closed, acked, bytes_pushed, dropped) after every step
(acknowledged pushes, their bytes and dropped pushes since the previous message), ("event",
rank, text) for the event log, then ("done", rank).
"""
from __future__ import annotations

import traceback
from multiprocessing.connection import Connection

import numpy as np

from .config import Config
from .data import async_batch, async_shard, load_dataset, sync_shard
from .networks import MLP, Params, make_model


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
            loop = {"sync": sync_loop, "async": async_loop, "ssp": async_loop, "easgd": easgd_loop,
                    "diloco": diloco_loop}[cfg.mode]
            loop(cfg, rank, conn, start_step, client, data, model)
        conn.send(("done", rank))
    except BaseException:
        conn.send(("error", rank, traceback.format_exc()[-3000:]))
        raise SystemExit(1)


def sync_loop(cfg: Config, rank: int, conn: Connection, start_step: int, client, data, model: MLP) -> None:
    """Every step: gradient of my part of the step's batch, one contribution to the store-wide
    default job's step (raftps/modes/sync.py; its ``sync_applied`` is the one ``stats()`` shows),
    answered once the step is applied, with the new parameters. Shards are equal, so the store's
    mean of the K contributions is the full batch's mean gradient: the same step as one process
    would take. Steps are numbered store-wide from ``cfg.step_offset`` (this run's step 0)."""
    from raftps.modes import StoreLink, SyncSteps
    names = store_names(cfg, model)
    total = cfg.total_updates(len(data.x_train))
    steps = SyncSteps(StoreLink(client), None, cfg.workers, rank, cfg.step_timeout)
    tensors, first = steps.resume(list(names.values()))
    params = from_store(names, tensors)
    step = max(start_step, first - cfg.step_offset)     # a restarted worker: the first step not applied yet
    closed = 0
    while step < total:
        idx = sync_shard(len(data.x_train), cfg.batch, step, cfg.seed, rank, cfg.workers)
        loss, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        result = steps.step(to_store(names, grads), cfg.step_offset + step, list(names.values()))
        closed += result.count < cfg.workers          # applied without a worker that did not arrive in time
        params = from_store(names, result.tensors)
        conn.send(("step", rank, step, loss, result.version, closed, 1, 0, 0))
        step = result.next_step - cfg.step_offset


def ssp_worker(rank: int) -> str:
    """A worker's name in its run's SSP group (the group is the run's tensor prefix)."""
    return f"rank{rank}"


def async_loop(cfg: Config, rank: int, conn: Connection, start_step: int, client, data, model: MLP) -> None:
    """DownpourSGD (raftps/modes/downpour.py): pull every n_fetch steps, push the summed gradient
    every n_push steps, the replica's own steps in between. --mode ssp: the same with n_fetch =
    n_push = 1 and the SSP gate, the run's prefix naming the SSP group (the coordinator enrolled
    all K before any started: s = 0 is BSP from clock 0); --ssp-on-bound reject: a push over the
    bound is refused and the step taken again from a new pull. --compress: the push is encoded;
    --fresh-pull: pulls read through the leader; --warmup: rank 0 trains alone first."""
    from raftps.modes import DROPPED, REFUSED, SENT, Downpour, StoreLink
    from raftps.modes.downpour import own_step, wait_for_updates
    from raftps.client.ssp import SspMember
    names = store_names(cfg, model)
    stored = list(names.values())
    shard = async_shard(len(data.x_train), rank, cfg.workers)
    total = cfg.worker_steps(len(data.x_train))
    ssp = None
    if cfg.mode == "ssp":
        ssp = SspMember(client, cfg.prefix, ssp_worker(rank), cfg.staleness, cfg.ssp_timeout,
                        on_event=lambda text: conn.send(("event", rank, text)))
    link = StoreLink(client, ssp, wait_at_bound=cfg.ssp_on_bound == "wait", linearizable=cfg.fresh_pull)
    downpour = Downpour(link, cfg.n_push, cfg.n_fetch, cfg.compress)
    lr = cfg.local_spec()["lr"]             # the replica's own steps (Downpour's alpha)
    if rank and cfg.warmup and start_step == 0:
        wait_for_updates(client, stored[-1], cfg.warmup, cfg.max_time)
    params = from_store(names, downpour.resume(stored)[0])
    step = start_step
    while step < total:
        idx = async_batch(shard, cfg.batch, step, cfg.seed, rank)
        loss, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        downpour.add(to_store(names, grads))
        if downpour.own_steps:
            params = own_step(params, grads, lr)
        status = None
        if downpour.push_due or step == total - 1:
            status = downpour.push(downpour.take())
            if status == REFUSED:           # ssp reject mode: too far ahead; redo this step from a new pull
                params = from_store(names, downpour.pull(stored))
                continue
        if status == DROPPED or (downpour.pull_due and step < total - 1):
            params = from_store(names, downpour.pull(stored, gate=status != DROPPED))
        conn.send(("step", rank, step, loss, link.pushed, 0, int(status == SENT),
                   downpour.last_push_bytes if status == SENT else 0, int(status == DROPPED)))
        step += 1
    link.leave()                            # a finished worker must not hold the others back


def easgd_loop(cfg: Config, rank: int, conn: Connection, start_step: int, client, data, model: MLP) -> None:
    """Asynchronous EASGD (raftps/modes/easgd.py): local steps of --optimizer on my own copy x;
    every n_push steps the exchange with the store's centre. A restarted worker starts again
    from the centre."""
    from raftps.modes import Easgd, StoreLink
    names = store_names(cfg, model)
    shard = async_shard(len(data.x_train), rank, cfg.workers)
    total = cfg.worker_steps(len(data.x_train))
    alpha = cfg.easgd_alpha if cfg.easgd_alpha is not None else 0.9 / cfg.workers
    link = StoreLink(client, linearizable=cfg.fresh_pull)
    easgd = Easgd(link, alpha, cfg.n_push, {name: cfg.local_spec() for name in names.values()})
    x = {k: np.array(v) for k, v in easgd.resume(list(names.values()))[0].items()}     # by store name
    for step in range(start_step, total):
        idx = async_batch(shard, cfg.batch, step, cfg.seed, rank)
        loss, grads = model.loss_and_grads(from_store(names, x), data.x_train[idx], data.y_train[idx])
        x = easgd.local_step(x, to_store(names, grads))
        exchanged = easgd.step_done() or step == total - 1
        if exchanged:
            x = easgd.exchange(x)
        conn.send(("step", rank, step, loss, link.pushed, 0, int(exchanged),
                   easgd.last_push_bytes if exchanged else 0, 0))


def diloco_loop(cfg: Config, rank: int, conn: Connection, start_step: int, client, data, model: MLP) -> None:
    """DiLoCo (raftps/client/diloco.py): the worker's own optimizer (--optimizer, --lr) on its shard for
    --sync-every steps, then its pseudo-gradient to the store, whose outer step (Nesterov momentum
    SGD, --outer-lr, --outer-momentum) is applied to the round's mean, or to each on arrival with
    --diloco-async; --fragments F syncs F parts of the model at staggered steps. A restarted
    worker resumes at the store's round (``start_step`` is not used) with a fresh inner optimizer."""
    from raftps.client.diloco import DiLoCo
    from raftps.modes import LocalOptimizer
    shard = async_shard(len(data.x_train), rank, cfg.workers)
    total = cfg.worker_steps(len(data.x_train))
    diloco = DiLoCo(client, cfg.prefix, model.init(cfg.seed), rank=rank, world_size=cfg.workers,
                    sync_every=cfg.sync_every, outer=cfg.outer_spec(), fragments=cfg.fragments,
                    asynchronous=cfg.diloco_async, step_timeout=cfg.step_timeout)
    diloco.create()                 # the coordinator created them: a no-op but for asynchronous counters
    start, params = diloco.resume()
    inner = LocalOptimizer({k: cfg.local_spec() for k in params})
    closed = 0
    for step in range(start, total):
        idx = async_batch(shard, cfg.batch, step, cfg.seed, rank)
        loss, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        params.update(inner.step(params, grads))
        new = diloco.after_inner_step(step, params)
        if new is not None:
            params.update(new)
            closed += sum(r.count < cfg.workers for r in diloco.rounds) if not cfg.diloco_async else 0
        sent = sum(r.bytes for r in diloco.rounds)
        conn.send(("step", rank, step, loss, diloco.version, closed, len(diloco.rounds), sent, 0))
