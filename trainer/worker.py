"""A worker process: its own raftps Client, its own data shard, one of two schedules.

Workers talk to the coordinator only through a one-way pipe of small tuples (each one write
under PIPE_BUF, so a SIGKILLed worker cannot leave half a message for the others):
("step", rank, step, loss, version, closed, acked, bytes_pushed, dropped) after every step
(acknowledged pushes, their bytes and dropped pushes since the previous message), ("event",
rank, text) for the event log, then ("done", rank).
"""
from __future__ import annotations

import time
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
            loop = {"sync": sync_loop, "async": async_loop, "ssp": async_loop, "easgd": easgd_loop,
                    "diloco": diloco_loop}[cfg.mode]
            loop(cfg, rank, conn, start_step, client, data, model)
        conn.send(("done", rank))
    except BaseException:
        conn.send(("error", rank, traceback.format_exc()[-3000:]))
        raise SystemExit(1)


def sync_loop(cfg: Config, rank: int, conn: Connection, start_step: int, client, data, model: MLP) -> None:
    """Every step: gradient of my part of the step's batch, push_step (answered once the step is
    applied, with the new parameters).

    Each worker sends the mean over its shard; shards are equal, so the store's mean of the K
    contributions is the full batch's mean gradient: the same step as one process would take.
    The leader sums the K contributions and replicates the step once (aggregation before
    replication). If a worker died, the leader applies the step step_timeout seconds after its
    first contribution with the contributions that arrived, and everyone moves on."""
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
        result = client.push_step(to_store(names, grads), store_step, cfg.workers, rank=rank,
                                  timeout=cfg.step_timeout, pull=True)
        version = result["version"]
        closed += result["count"] < cfg.workers        # applied without a worker that did not arrive in time
        tensors = result.get("tensors") or {}
        if not set(names.values()) <= set(tensors):    # e.g. the answer to a contribution sent again
            tensors, version = client.pull(list(names.values()), min_version=version, linearizable=False)
        params = from_store(names, tensors)
        conn.send(("step", rank, step, loss, version, closed, 1, 0, 0))


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


def push_bytes(tensors: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in tensors.values())


def replica_step(params: Params, grads: Params, lr: float) -> Params:
    """One of a Downpour replica's own SGD steps between pulls (the paper's Algorithm 7.1)."""
    return {k: v - v.dtype.type(lr) * grads[k] for k, v in params.items()}


def ssp_worker(rank: int) -> str:
    """A worker's name in its run's SSP group (the group is the run's tensor prefix)."""
    return f"rank{rank}"


def async_loop(cfg: Config, rank: int, conn: Connection, start_step: int, client, data, model: MLP) -> None:
    """DownpourSGD (Dean et al. 2012, Algorithm 7.1): pull every n_fetch steps, push the summed
    gradient every n_push steps, no coordination; in between, the replica takes each step itself
    (parameters -= lr * gradient), so its next gradients are computed where its own steps led.
    Each push carries the version last pulled, so the store records staleness.

    --mode ssp: the same with n_fetch = n_push = 1 and the SSP gate before every step (a push is
    one clock tick). --compress: the push is encoded (raftps.compress; top-k keeps a residual)."""
    from raftps import NotInGroup, StaleBase, StalenessBound, compress
    from raftps.ssp import SspMember
    names = store_names(cfg, model)
    shard = async_shard(len(data.x_train), rank, cfg.workers)
    total = cfg.worker_steps(len(data.x_train))
    method, fraction = compress.parse(cfg.compress)
    topk = compress.TopK(fraction) if method == "topk" else None
    ssp = None
    if cfg.mode == "ssp":       # the coordinator enrolled all K before any started: s = 0 is BSP from clock 0
        ssp = SspMember(client, cfg.prefix, ssp_worker(rank), cfg.staleness, cfg.ssp_timeout,
                        on_event=lambda text: conn.send(("event", rank, text)))
    n_fetch, n_push = (1, 1) if ssp else (cfg.n_fetch, cfg.n_push)
    lr = cfg.local_spec()["lr"]             # the replica's own steps (Downpour's alpha)
    if rank and cfg.warmup and start_step == 0:
        wait_for_updates(client, names, cfg.warmup, cfg.max_time)
    tensors, version = client.pull(list(names.values()))
    params = from_store(names, tensors)
    pushed, pending, count = version, None, 0
    step = start_step
    while step < total:
        acked, sent, dropped = 0, 0, 0
        if ssp is not None and cfg.ssp_on_bound == "wait":
            pushed = max(pushed, ssp.wait_turn())
        if ssp is not None or (step > start_step and step % n_fetch == 0):
            # Default: any node that has applied my last push (spreads reads over the followers);
            # --fresh-pull reads through the leader's log: the newest state, less staleness.
            tensors, version = client.pull(list(names.values()), min_version=pushed, linearizable=cfg.fresh_pull)
            params = from_store(names, tensors)
        idx = async_batch(shard, cfg.batch, step, cfg.seed, rank)
        loss, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        pending = grads if pending is None else {k: pending[k] + grads[k] for k in grads}
        count += 1
        if n_fetch > 1:                     # with n_fetch 1 the next pull replaces it anyway
            params = replica_step(params, grads, lr)
        if count == n_push or step == total - 1:
            send, encoding = compress.encode_push(to_store(names, pending), method, topk)
            try:
                pushed = client.push(send, base_version=version, encoding=encoding,
                                     ssp=ssp.field() if ssp else None)
                acked, sent = 1, push_bytes(send)
            except StalenessBound:          # ssp reject mode: too far ahead; wait, redo this step
                pending, count = None, 0
                time.sleep(0.01)
                continue
            except NotInGroup:              # dropped as dead while we were away: rejoin, redo
                ssp.join()
                pending, count = None, 0
                continue
            except StaleBase:               # AdaRevision no longer holds our base: drop, re-pull
                dropped = 1
                tensors, version = client.pull(list(names.values()))
                params = from_store(names, tensors)
            pending, count = None, 0
        conn.send(("step", rank, step, loss, pushed, 0, acked, sent, dropped))
        step += 1
    if ssp is not None:
        ssp.leave()                         # a finished worker must not hold the others back


def easgd_loop(cfg: Config, rank: int, conn: Connection, start_step: int, client, data, model: MLP) -> None:
    """Asynchronous EASGD (Zhang, Choromanska, LeCun 2015, Algorithm 1): local SGD on my own
    copy x; every n_push steps pull the centre c, push delta = alpha (x - c) (the store adds it
    to c) and move x by -delta. A restarted worker starts again from the centre."""
    from raftps import optim
    names = store_names(cfg, model)
    shard = async_shard(len(data.x_train), rank, cfg.workers)
    total = cfg.worker_steps(len(data.x_train))
    alpha = cfg.easgd_alpha if cfg.easgd_alpha is not None else 0.9 / cfg.workers
    spec = optim.normalize(cfg.local_spec())
    tensors, version = client.pull(list(names.values()))
    x = {k: np.array(v) for k, v in from_store(names, tensors).items()}
    state = {k: optim.init_state(spec, v) for k, v in x.items()}
    pushed = version
    for step in range(start_step, total):
        idx = async_batch(shard, cfg.batch, step, cfg.seed, rank)
        loss, grads = model.loss_and_grads(x, data.x_train[idx], data.y_train[idx])
        for k in x:
            x[k], state[k] = optim.step(spec, x[k], grads[k], state[k])
        acked, sent = 0, 0
        if (step + 1) % cfg.n_push == 0 or step == total - 1:
            centre, version = client.pull(list(names.values()), min_version=pushed, linearizable=cfg.fresh_pull)
            centre = from_store(names, centre)
            delta = {k: (x[k] - centre[k]) * x[k].dtype.type(alpha) for k in x}
            x = {k: x[k] - delta[k] for k in x}
            send = to_store(names, delta)
            pushed = client.push(send, base_version=version)
            acked, sent = 1, push_bytes(send)
        conn.send(("step", rank, step, loss, pushed, 0, acked, sent, 0))


def diloco_loop(cfg: Config, rank: int, conn: Connection, start_step: int, client, data, model: MLP) -> None:
    """DiLoCo (raftps/diloco.py): the worker's own optimizer (--optimizer, --lr) on its shard for
    --sync-every steps, then its pseudo-gradient to the store, whose outer step (Nesterov momentum
    SGD, --outer-lr, --outer-momentum) is applied to the round's mean, or to each on arrival with
    --diloco-async; --fragments F syncs F parts of the model at staggered steps. A restarted
    worker resumes at the store's round (``start_step`` is not used) with a fresh inner optimizer."""
    from raftps import optim
    from raftps.diloco import DiLoCo
    shard = async_shard(len(data.x_train), rank, cfg.workers)
    total = cfg.worker_steps(len(data.x_train))
    diloco = DiLoCo(client, cfg.prefix, model.init(cfg.seed), rank=rank, world_size=cfg.workers,
                    sync_every=cfg.sync_every, outer=cfg.outer_spec(), fragments=cfg.fragments,
                    asynchronous=cfg.diloco_async, step_timeout=cfg.step_timeout)
    diloco.create()                 # the coordinator created them: a no-op but for asynchronous counters
    start, params = diloco.resume()
    spec = optim.normalize(cfg.local_spec())
    state = {k: optim.init_state(spec, v) for k, v in params.items()}
    closed = 0
    for step in range(start, total):
        idx = async_batch(shard, cfg.batch, step, cfg.seed, rank)
        loss, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        for k in params:
            params[k], state[k] = optim.step(spec, params[k], grads[k], state[k])
        new = diloco.after_inner_step(step, params)
        if new is not None:
            params.update(new)
            closed += sum(r.count < cfg.workers for r in diloco.rounds) if not cfg.diloco_async else 0
        sent = sum(r.bytes for r in diloco.rounds)
        conn.send(("step", rank, step, loss, diloco.version, closed, len(diloco.rounds), sent, 0))
