"""Training: time to 0.95 test accuracy on digits with three ways of exchanging gradients.

- ``--local``: one process, no store (trainer.run.train_local);
- raftps: K async (Downpour) or sync workers on a 3-node cluster (trainer.run.train, as
  ``python -m bench.trainer_bench`` runs them), every update a replicated, exactly-once push;
- torch.distributed: K processes on 127.0.0.1, each computing the gradient of its equal shard
  of the step's batch (trainer.data.sync_shard: the sync mode's schedule), one ``all_reduce``
  (SUM, gloo, CPU) of all gradients flattened into one buffer per step (as a DDP bucket would),
  divided by K, then the same optimizer step (raftps.optim) on every rank. Nothing is stored or
  replicated: the no-durability baseline. The model, data, batch, schedule, evaluation
  (trainer.run.Recorder on rank 0, every ``eval_every`` updates) and update rule are the
  trainer's own; numpy computes, torch only moves the bytes (``torch.from_numpy`` shares memory).

Times run from the launch of the run (the coordinator's Recorder for raftps, the parent's launch
for torch), so both include starting the worker processes; ``startup_s`` says how much that is.
torch is optional (``bench/setup.sh`` installs the CPU wheel); without it those rows are skipped.
gloo connects its ranks over ephemeral ports besides the rendezvous port.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from .common import log

TORCH_MISSING = "torch is not installed (bench/setup.sh installs the CPU wheel from /opt/wheels): torch rows skipped"


def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def _config(**kw: Any) -> Any:
    from trainer.config import Config
    return Config(evals_per_epoch=11, **kw)          # trainer_bench's evaluation cadence


def _rank(cfg: Any, rank: int, world: int, port: int, t_launch: float, results: Any) -> None:
    """One torch.distributed rank (spawned)."""
    import torch
    import torch.distributed as dist
    from raftps import optim
    from trainer.data import load_dataset, sync_shard
    from trainer.networks import make_model
    from trainer.run import Recorder, eval_every
    from datetime import timedelta
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        data = load_dataset(cfg.dataset)
        model = make_model(cfg.model, data.features, data.classes, cfg.hidden)
        spec = optim.normalize(cfg.optimizer_spec())
        params = model.init(cfg.seed)
        state = {k: optim.init_state(spec, v) for k, v in params.items()}
        keys = sorted(params)
        offsets = np.cumsum([0] + [params[k].size for k in keys])
        flat = np.empty(offsets[-1], np.float32)
        buf = torch.from_numpy(flat)                # shares flat's memory: all_reduce works in place
        n = len(data.x_train)
        total, every, per_epoch = cfg.total_updates(n), eval_every(cfg, n), cfg.updates_per_epoch(n)
        rec = None
        if rank == 0:
            rec = Recorder(cfg, data, model)
            rec.t0 = t_launch                       # time from the parent's launch, like the coordinator's
            rec.evaluate(params, 0, 0, 0.0)
        spent = {"compute_s": 0.0, "allreduce_s": 0.0, "apply_s": 0.0, "eval_s": 0.0}
        for step in range(total):
            t0 = time.perf_counter()
            idx = sync_shard(n, cfg.batch, step, cfg.seed, rank, world)
            loss, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
            for k, a, b in zip(keys, offsets, offsets[1:]):
                flat[a:b] = grads[k].ravel()
            t1 = time.perf_counter()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            flat /= np.float32(world)               # the mean of equal shards' means: the batch's mean gradient
            t2 = time.perf_counter()
            for k, a, b in zip(keys, offsets, offsets[1:]):
                params[k], state[k] = optim.step(spec, params[k], flat[a:b].reshape(params[k].shape), state[k])
            t3 = time.perf_counter()
            spent["compute_s"] += t1 - t0
            spent["allreduce_s"] += t2 - t1
            spent["apply_s"] += t3 - t2
            if rec is not None:
                if rec.first_step_s is None:
                    rec.first_step_s = rec.elapsed()
                rec.losses.append(loss)
                if (step + 1) % every == 0 or step + 1 == total:
                    rec.evaluate(params, step + 1, step + 1, (step + 1) / per_epoch)
                spent["eval_s"] += time.perf_counter() - t3
        if rec is not None:
            rec.progress.done()
            results.put(rec.finish(params, {"exchange": "torch.distributed all_reduce (gloo, CPU)", **spent}))
    finally:
        dist.destroy_process_group()


def torch_run(cfg: Any, world: int, port: int) -> dict[str, Any]:
    """One run of ``world`` ranks; rank 0's summary (trainer.run.Recorder.finish)."""
    ctx = mp.get_context("spawn")
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")             # one BLAS thread per process, as trainer workers use
    results = ctx.Queue()
    t_launch = time.monotonic()
    procs = [ctx.Process(target=_rank, args=(cfg, r, world, port, t_launch, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        summary = results.get(timeout=cfg.max_time)
        for p in procs:
            p.join(timeout=30)
        return summary
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()                            # SIGKILL by PID
            p.join(timeout=5)


def _row(setting: str, exchange: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """trainer_bench's medians over seeds, plus (torch runs) where rank 0's time went."""
    from .trainer_bench import summarize
    row = {"system": "train", "op": "train", "exchange": exchange, **summarize(setting, runs)}
    for key in ("compute_s", "allreduce_s", "apply_s", "eval_s"):
        if key in runs[0]:
            row[key] = statistics.median([r[key] for r in runs])
    log(f"train {setting} ({exchange}): reached 0.95 in {row['reached']} runs, {row['updates']:.0f} updates "
        f"({row['grad_steps']:.0f} gradient steps), {row['time_s']:.2f} s (startup {row['startup_s']:.2f} s), "
        f"{row['upd_per_s']:.1f} updates/s (steady {row['steady_upd_per_s']:.1f}), final acc {row['final_acc']:.4f}")
    return row


def measure(run_dir: str, base_port: int, settings: list[str], seeds: int, epochs: int,
            torch_workers: list[int], torch_port: int) -> list[dict[str, Any]]:
    """raftps settings on one 3-node cluster (and its raw 4 MB push rate), then the torch runs."""
    from raftps.tools.localcluster import LocalCluster
    from .trainer_bench import raw_push_rates, run_setting
    out: list[dict[str, Any]] = []
    cluster = LocalCluster(os.path.join(run_dir, "cluster"), nodes=3, base_port=base_port)
    os.environ.update(cluster.client_env)   # this process's clients and the workers it starts find the token
    try:
        addresses = cluster.start(timeout=60)
        raw, rows = raw_push_rates(addresses, lambda: [_row(label, "none" if label.startswith("local") else "raftps",
                                                            run_setting(label, addresses, seeds, epochs, run_dir))
                                                       for label in settings])     # trainer_bench.SETTINGS labels
        log(f"train: raw 4 MB push rate (1 client, same cluster) {raw['before']:.1f}/s before the runs, "
            f"{raw['after']:.1f}/s after")
        out += [{"system": "train", "op": "raw_push", **raw}, *rows]
    finally:
        cluster.wipe()
    if torch_version() is None:
        log(TORCH_MISSING)
        out.append({"system": "train", "op": "skipped", "reason": TORCH_MISSING})
        return out
    for k in torch_workers:
        runs = [torch_run(_config(mode="sync", workers=k, epochs=epochs, seed=seed,
                                  out=os.path.join(run_dir, f"torch{k}-{seed}")), k, torch_port)
                for seed in range(seeds)]
        out.append(_row(f"torch all-reduce x{k}", "torch-gloo", runs))
    return out
