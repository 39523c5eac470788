"""A run: --local here, the cluster modes in coordinator.py, both recorded by recorder.py.
Every run writes metrics.csv, events.csv, summary.json, params.npz and plot.png into --out.
"""
from __future__ import annotations

import time

from .config import Config
from .data import global_batch, load_dataset
from .networks import make_model
from .recorder import TARGET_ACC, Recorder, eval_every  # noqa: F401 (TARGET_ACC: trainer.run's, as before)


def train(cfg: Config) -> dict:
    if cfg.local:
        return train_local(cfg)
    from .coordinator import train_cluster
    return train_cluster(cfg)


def train_local(cfg: Config) -> dict:
    """The baseline: the sync schedule with one process and no store, same optimizer code."""
    from raftps import optim       # pure functions: the exact update rule the state machine applies
    data = load_dataset(cfg.dataset)
    model = make_model(cfg.model, data.features, data.classes, cfg.hidden)
    rec = Recorder(cfg, data, model)
    spec = optim.normalize(cfg.local_spec())
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
                          loss=loss, acc=rec.last.get("test_acc"), rate=(step + 1) / max(rec.elapsed(), 1e-9),
                          version=step + 1, leader="local")
    return rec.finish(params, {})
