"""The statistical cost of staleness on its own, with no cluster: async SGD with a fixed delay.

K simulated workers take turns; each computes its gradient (on its own async shard, with the
same batch schedule as a real async worker) at the parameters as they were ``delay`` updates
ago, and the update is applied to the newest parameters with the store's own optimizer code.
With K workers that each pull right before computing, the steady-state staleness is K - 1, so
``delay=K-1`` is what a perfect parameter server (zero latency, zero overhead) would give.

A real run that needs about as many applied updates as this simulation is paying only for
staleness, not for the system. Closing the rest of the gap takes an algorithm (staleness-aware
learning rates, AdaRevision), not a faster store.

    python -m trainer.delay_sim --workers 4 --seeds 3
    python -m trainer.delay_sim --workers 8 --optimizer adarevision --lr 0.05
    python -m trainer.delay_sim --workers 8 --staleness-aware --lr 0.4
    python -m trainer.delay_sim --workers 4 --staleness-aware --n-push 4   # Downpour, 4 local steps per push

Each update passes the store's own ``optim.Context`` (index, base version, staleness), so
staleness-aware learning rates and AdaRevision see exactly what they see in the store.
"""
from __future__ import annotations

import argparse
import statistics

from .config import Config
from .data import async_batch, async_shard, load_dataset
from .run import TARGET_ACC


def updates_to_target(cfg: Config, delay: int, max_updates: int = 400, target: float = TARGET_ACC) -> int | None:
    """Applied updates until test accuracy first reaches ``target`` (checked after every update)."""
    from raftps import optim
    from .networks import make_model
    data = load_dataset(cfg.dataset)
    model = make_model(cfg.model, data.features, data.classes, cfg.hidden)
    spec = optim.normalize(cfg.optimizer_spec())
    params = model.init(cfg.seed)
    state = {k: optim.init_state(spec, v) for k, v in params.items()}
    history = [params]                 # history[-1 - d]: the parameters d updates ago
    shards = [async_shard(len(data.x_train), r, cfg.workers) for r in range(cfg.workers)]
    local_steps = [0] * cfg.workers
    lr = cfg.local_spec()["lr"]
    for update in range(1, max_updates + 1):
        rank = (update - 1) % cfg.workers
        seen = history[max(0, len(history) - 1 - delay)]
        grads = local_sgd(model, data, seen, cfg, shards[rank], rank, local_steps[rank], lr)
        local_steps[rank] += cfg.n_push
        params = dict(params)
        tau = min(delay, update - 1)           # update u is applied at "index" u and saw u - 1 - tau
        ctx = optim.Context(index=update, base=update - 1 - tau, staleness=tau)
        for k in params:
            params[k], state[k] = optim.step(spec, params[k], grads[k], state[k], ctx)
        history = (history + [params])[-(delay + 1):]
        if model.accuracy(params, data.x_test, data.y_test) >= target:
            return update
    return None


def local_sgd(model, data, params, cfg: Config, shard, rank: int, step: int, lr: float) -> dict:
    """The summed gradient of ``cfg.n_push`` Downpour replica steps from ``params`` (the replica
    takes each step itself, as Downpour does with n_fetch = n_push: raftps/modes/downpour.py)."""
    from raftps.modes.downpour import own_step
    total = None
    for k in range(cfg.n_push):
        idx = async_batch(shard, cfg.batch, step + k, cfg.seed, rank)
        _, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        total = grads if total is None else {n: total[n] + grads[n] for n in grads}
        if k + 1 < cfg.n_push:
            params = own_step(params, grads, lr)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.delay_sim")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--staleness-aware", action="store_true")
    ap.add_argument("--n-push", type=int, default=1, help="replica steps per push (Downpour, n_fetch = n_push)")
    ap.add_argument("--hidden", default="1000,1000")
    ap.add_argument("--max-updates", type=int, default=400)
    args = ap.parse_args(argv)
    hidden = tuple(int(w) for w in args.hidden.split(",") if w)
    for delay in sorted({0, args.workers - 1}):
        runs = [updates_to_target(Config(workers=args.workers if delay else 1, lr=args.lr, seed=s, hidden=hidden,
                                         optimizer=args.optimizer, staleness_aware=args.staleness_aware,
                                         n_fetch=args.n_push, n_push=args.n_push),
                                  delay, args.max_updates)
                for s in range(args.seeds)]
        hit = [r for r in runs if r is not None]
        median = statistics.median(hit) if hit else float("nan")
        print(f"delay {delay}: updates to {TARGET_ACC}: {runs} (median {median})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
