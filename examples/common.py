"""What every example shares: flags, rank/world from the launcher, the three backends, the
batch schedule, metrics files and plots. Each example script only defines its data, its model
and its evaluation, and calls ``train``.

Backends (``--backend``):
  local   one process, torch.optim on the full batch;
  ddp     torch DistributedDataParallel, gloo all-reduce (CPU), started by torchrun; with
          ``--checkpoint`` it saves and resumes (a ``--max-restarts`` restart builds its process
          group again: ``init_gloo``);
  raftps  raftps.torch.DistributedOptimizer against a raftps cluster (``--cluster`` or
          RAFTPS_CLUSTER, token from RAFTPS_TOKEN / RAFTPS_TOKEN_FILE), wrapping the same
          torch.optim.Adam; ``--mode`` sync, async, ssp, easgd, or diloco / diloco-async (Adam is
          the inner optimizer, ``--sync-every`` steps a round, the ``--outer`` step in the store).
          Started by torchrun or anything that sets RANK and WORLD_SIZE.

The global schedule is a sequence of batches g = 0, 1, ... of ``--batch`` examples, a pure
function of (seed, g), so a restarted worker can skip to any g without replaying data.
  ddp, raftps sync (and local): every rank computes the mean gradient of its 1/world part of
      batch g; the all-reduce (or the store) averages the parts: world ranks == one process.
  raftps diloco: every rank takes its inner step on its 1/world part of batch g; every H
      batches the store's outer step applies the ranks' mean pseudo-gradient.
  raftps async / ssp / easgd: rank r trains on whole batches g = r, r + world, r + 2 world, ...
      and every push is one update (Downpour: "each worker its own data shard").
"""
from __future__ import annotations

import time

T_START = time.time()          # about the process's start (before importing torch): startup_s = first step - this

import argparse  # noqa: E402
import csv  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


OUTERS = {"nesterov": {"name": "momentum", "lr": 0.7, "momentum": 0.9, "nesterov": True},
          "average": {"name": "sgd", "lr": 1.0}}


def parse_args(description: str, defaults: dict[str, Any]) -> argparse.Namespace:
    """The flags every example takes; ``defaults`` sets each script's own steps/batch/lr/target."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--backend", choices=["local", "ddp", "raftps"], default="local")
    ap.add_argument("--mode", default="sync", help="raftps: sync | async | ssp | easgd | diloco | diloco-async")
    ap.add_argument("--sync-every", type=int, default=20, help="raftps diloco: inner steps per round (H)")
    ap.add_argument("--outer", choices=sorted(OUTERS), default="average",
                    help="raftps diloco: the store's outer step (average: SGD lr 1.0, the mean of the ranks' "
                         "parameters, the better here over 300-1200 batches: bench.diloco_quality; nesterov: "
                         "the paper's momentum SGD lr 0.7, momentum 0.9)")
    ap.add_argument("--cluster", default=None, help="raftps addresses host:port,... (default: RAFTPS_CLUSTER)")
    ap.add_argument("--prefix", default=None, help="raftps tensor name prefix (default: the script's name)")
    ap.add_argument("--n-push", type=int, default=1, help="raftps async: local steps summed per push")
    ap.add_argument("--n-fetch", type=int, default=1, help="raftps async: steps between pulls")
    ap.add_argument("--staleness-aware", action="store_true", help="raftps async: store divides lr by staleness")
    ap.add_argument("--chunk-bytes", type=int, default=0,
                    help="raftps sync: each step streamed in chunks of whole tensors of up to this many bytes "
                         "(pays on slow links: docs/design/write-path.md); 0 sends each group's part whole")
    ap.add_argument("--pairs", action="store_true",
                    help="raftps sync with --chunk-bytes: ranks 2i and 2i + 1 add up half of each step's chunks "
                         "each before the store (docs/design/write-path.md)")
    ap.add_argument("--overlap", action="store_true",
                    help="raftps sync with --chunk-bytes: each chunk sent as soon as backward has made its "
                         "gradients, as DDP's buckets (docs/pytorch.md)")
    ap.add_argument("--steps", type=int, default=defaults["steps"], help="global batches in the whole run")
    ap.add_argument("--batch", type=int, default=defaults["batch"], help="global batch (split over ranks in sync/ddp)")
    ap.add_argument("--lr", type=float, default=defaults["lr"], help="Adam learning rate")
    ap.add_argument("--eval-every", type=int, default=defaults["eval_every"], help="global batches between evaluations")
    ap.add_argument("--target", type=float, default=defaults["target"],
                    help="summary records when the eval metric first reaches it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: 1 if several ranks, else torch's)")
    ap.add_argument("--out", default=None, help="directory for metrics.csv and summary.json (rank 0)")
    ap.add_argument("--checkpoint", default=None,
                    help="ddp/local: a torch.save file of model, optimizer and step (a path, or an http:// "
                         "URL of a file server that takes PUT); loaded at start if it exists")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="ddp/local: global batches between checkpoints")
    args = ap.parse_args()
    if args.chunk_bytes < 0 or (args.chunk_bytes and (args.backend, args.mode) != ("raftps", "sync")):
        ap.error(f"--chunk-bytes {args.chunk_bytes}: a byte count >= 0, for --backend raftps --mode sync only "
                 f"(here --backend {args.backend} --mode {args.mode})")
    if args.pairs and not args.chunk_bytes:           # --chunk-bytes above is for raftps sync only
        ap.error("--pairs: for --backend raftps --mode sync only, with --chunk-bytes > 0 "
                 f"(here --backend {args.backend} --mode {args.mode} --chunk-bytes {args.chunk_bytes})")
    if args.overlap and not args.chunk_bytes:
        ap.error("--overlap: for --backend raftps --mode sync only, with --chunk-bytes > 0 "
                 f"(here --backend {args.backend} --mode {args.mode} --chunk-bytes {args.chunk_bytes})")
    return args


def rank_world() -> tuple[int, int]:
    """RANK/WORLD_SIZE as torchrun (or Ray Train) sets them; Slurm's SLURM_PROCID/SLURM_NTASKS
    when started by plain srun; (0, 1) otherwise."""
    for r, w in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if r in os.environ and w in os.environ:
            return int(os.environ[r]), int(os.environ[w])
    return 0, 1


class Backend:
    """One interface over the three backends: ``start_step``, ``model`` (what to call forward
    on), ``zero_grad()``, ``step()``, ``close()``; ``sharded`` says whether a rank computes
    its part of every batch (sync) or whole batches of its own (async)."""

    def __init__(self, args: argparse.Namespace, model: nn.Module, rank: int, world: int, prefix: str):
        self.kind, self.rank, self.world = args.backend, rank, world
        self.model, self.start_step, self.sharded = model, 0, True
        self.checkpoint, self.checkpoint_every = args.checkpoint, args.checkpoint_every
        if args.backend == "raftps" and (args.checkpoint or args.checkpoint_every):
            raise SystemExit("--checkpoint is for ddp/local: raftps resumes from the store")
        if args.backend == "raftps":
            import raftps.torch as rpt
            # The same torch optimizer the other backends use: the store runs it (sync, async, ...),
            # or it is DiLoCo's inner optimizer, run here (diloco, diloco-async).
            adam = torch.optim.Adam(model.parameters(), lr=args.lr)
            options = (dict(sync_every=args.sync_every, outer=OUTERS[args.outer]) if args.mode.startswith("diloco")
                       else dict(n_push=args.n_push, n_fetch=args.n_fetch, staleness_aware=args.staleness_aware))
            if args.chunk_bytes:                          # sync only (parse_args)
                options["chunk_bytes"] = args.chunk_bytes
                options["pairs"] = args.pairs
                options["overlap"] = args.overlap
            self.opt = rpt.DistributedOptimizer(adam, model=model, cluster=args.cluster, mode=args.mode,
                                                prefix=prefix, rank=rank, world_size=world, **options)
            self.start_step = int(self.opt.start_step)
            self.sharded = args.mode in ("sync", "diloco", "diloco-async")
            if args.overlap and args.out and rank == 0:     # the chunks' units, for a store check (bench)
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "stream_units.json"), "w") as f:
                    json.dump([[c.group, c.index, list(c.names)] for c in self.opt.stream_plan], f)
            return
        saved = load_checkpoint(self.checkpoint) if self.checkpoint else None
        if saved is not None:
            model.load_state_dict(saved["model"])
            self.start_step = int(saved["step"])
        if args.backend == "ddp":
            import torch.distributed as dist
            if not dist.is_initialized():             # Ray Train, for one, has made one already
                init_gloo(rank, world)
            self.model = nn.parallel.DistributedDataParallel(model)   # broadcasts rank 0's parameters
        elif world != 1:
            raise SystemExit("--backend local is one process: run it without torchrun (or with --nproc-per-node 1)")
        self.opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        if saved is not None:
            self.opt.load_state_dict(saved["optimizer"])

    def save_checkpoint(self, step: int) -> None:
        """Rank 0 writes model, optimizer and the next step; a rename, so a kill mid-write leaves the last one."""
        if self.rank != 0 or not self.checkpoint or self.kind == "raftps":
            return
        save_checkpoint(self.checkpoint, {"model": self.model.module.state_dict() if self.kind == "ddp" else
                                          self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": step})

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        self.opt.step()

    def close(self) -> None:
        if self.kind == "raftps":
            self.opt.close()
        elif self.kind == "ddp":
            import torch.distributed as dist
            dist.destroy_process_group()


def save_checkpoint(where: str, state: dict) -> None:
    """torch.save to a path (a rename, so a kill mid-write leaves the last one) or an http:// URL
    (PUT to a file server on another host: bench.checkpoint_server, which renames too)."""
    if where.startswith("http://"):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        urllib.request.urlopen(urllib.request.Request(where, data=buffer.getvalue(), method="PUT"), timeout=300).close()
        return
    torch.save(state, where + ".tmp")
    os.replace(where + ".tmp", where)


def load_checkpoint(where: str) -> dict | None:
    """The checkpoint at a path, or at an http:// URL (bench.checkpoint_server: a file server on
    another host, as a shared filesystem would be); None if there is none yet."""
    if not where.startswith("http://"):
        return torch.load(where, weights_only=True) if os.path.exists(where) else None
    try:
        with urllib.request.urlopen(where, timeout=300) as answer:
            return torch.load(io.BytesIO(answer.read()), weights_only=True)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def init_gloo(rank: int, world: int) -> None:
    """The gloo process group, on a store namespace of its own for each torchrun restart.

    torchrun's agent keeps one TCPStore (MASTER_PORT) across ``--max-restarts`` restarts and the
    workers write their gloo addresses into it unprefixed, so a restarted group can read the dead
    group's addresses and fail with ``Gloo connectFullMesh failed ... Connection refused``
    (torch 2.13 CPU, one worker SIGKILLed). A prefix per restart count avoids those keys."""
    import torch.distributed as dist
    from datetime import timedelta
    timeout = timedelta(seconds=120)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or "MASTER_ADDR" not in os.environ:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"restart{restart}", store), rank=rank, world_size=world,
                            timeout=timeout)


def my_batches(backend: Backend, steps: int) -> range:
    """The global batch indices this rank works on, from where the job resumes."""
    if backend.sharded:                 # sync, diloco: start_step is the job's next step
        return range(backend.start_step, steps)
    # async: start_step counts this rank's own steps the store applied; its k-th is g = rank + k world
    return range(backend.rank + backend.start_step * backend.world, steps, backend.world)


def my_part(batch: np.ndarray, backend: Backend) -> np.ndarray:
    """Rank r's equal part of a global batch in sync/ddp mode; the whole batch otherwise."""
    if not backend.sharded:
        return batch
    if len(batch) % backend.world:
        raise SystemExit(f"--batch {len(batch)} must be divisible by the world size {backend.world}")
    n = len(batch) // backend.world
    return batch[backend.rank * n:(backend.rank + 1) * n]


class Metrics:
    """Rank 0's metrics.csv (time, step, loss, metric, unix) and summary.json. time is seconds
    since the job's first training step; startup_s (process start to first step) is in the
    summary. Rows are appended as they come, so a killed worker loses none; a resumed job
    (start_step > 0) appends to the file its earlier run wrote and keeps its time axis."""

    def __init__(self, out: str | None, metric: str, higher_is_better: bool, target: float | None, meta: dict,
                 resumed: bool = False):
        self.out, self.metric, self.higher, self.target = out, metric, higher_is_better, target
        self.meta, self.t0, self.first_step = meta, None, None
        self.reached: tuple[float, int] | None = None
        self.step_times: list[tuple[float, int]] = []
        self.fields = ["time", "step", "loss", metric, "unix"]
        self.file = None
        if out:
            os.makedirs(out, exist_ok=True)
            path = os.path.join(out, "metrics.csv")
            earlier = []
            if resumed and os.path.exists(path):
                with open(path, newline="") as f:
                    earlier = [r for r in csv.DictReader(f) if r.get("unix")]
            if earlier:                  # the job's time axis starts at its first run's first step
                self.t0 = float(earlier[0]["unix"]) - float(earlier[0]["time"])
                for r in earlier:
                    if r[metric] != "":
                        self._check_target(float(r["time"]), int(r["step"]), float(r[metric]))
            self.file = open(path, "a" if earlier else "w", newline="")
            self.writer = csv.DictWriter(self.file, fieldnames=self.fields)
            if not earlier:
                self.writer.writeheader()

    def now(self) -> float:
        if self.first_step is None:
            self.first_step = time.time()
            self.t0 = self.t0 if self.t0 is not None else self.first_step
        return time.time() - self.t0

    def _check_target(self, t: float, step: int, metric: float) -> None:
        hit = self.target is not None and (metric >= self.target if self.higher else metric <= self.target)
        if hit and self.reached is None:
            self.reached = (t, step)

    def log_step(self, step: int, loss: float, metric: float | None = None) -> None:
        t = self.now()
        self.step_times.append((t, step))
        if self.file is not None:
            self.writer.writerow({"time": round(t, 4), "step": step, "loss": round(loss, 5),
                                  self.metric: "" if metric is None else round(metric, 5), "unix": round(time.time(), 3)})
            self.file.flush()
        if metric is not None:
            self._check_target(t, step, metric)
            print(f"[rank 0] step {step:5d}  {t:7.1f} s  loss {loss:.4f}  {self.metric} {metric:.4f}", flush=True)

    def steady_rate(self) -> float:
        """Global batches per second between 10% and 90% of the logged steps (no startup, no tail)."""
        if len(self.step_times) < 10:
            return float("nan")
        (ta, sa), (tb, sb) = self.step_times[len(self.step_times) // 10], self.step_times[9 * len(self.step_times) // 10]
        return (sb - sa) / (tb - ta) if tb > ta else float("nan")

    def finish(self, final_metric: float, extra: dict | None = None) -> dict:
        s = {**self.meta, "final_" + self.metric: final_metric, "target": self.target,
             "time_to_target_s": self.reached[0] if self.reached else None,
             "step_at_target": self.reached[1] if self.reached else None,
             "train_s": self.now(), "startup_s": (self.first_step or time.time()) - T_START,
             "first_step_unix": self.first_step,
             "steady_steps_per_s": self.steady_rate(), **(extra or {})}
        if self.out:
            self.file.close()
            with open(os.path.join(self.out, "summary.json"), "w") as f:
                json.dump(s, f, indent=1, default=float)
        return s


def startup(imported: float, backend_ready: float, started: float = T_START) -> str:
    """A process's start, in phases (s): what a returning worker's time to contribute went to."""
    now = time.time()
    return (f"since the process started {now - started:.1f} s: imports and model {imported - started:.1f}, "
            f"backend {backend_ready - imported:.1f}, first step {now - backend_ready:.1f}")


def train(args: argparse.Namespace, name: str, model: nn.Module, batch_indices: Callable[[int], np.ndarray],
          loss_on: Callable[[nn.Module, np.ndarray], torch.Tensor], evaluate: Callable[[nn.Module], float],
          metric: str, higher_is_better: bool) -> dict | None:
    """The loop every example runs. ``batch_indices(g)``: global batch g (example indices);
    ``loss_on(model, idx)``: the mean loss on those examples; ``evaluate(model)``: the metric.
    Returns rank 0's summary (None on other ranks)."""
    rank, world = rank_world()
    torch.set_num_threads(args.threads or (1 if world > 1 else torch.get_num_threads()))
    trained_from = time.time()                  # imports and the model built: the backend (store, rendezvous) next
    backend = Backend(args, model, rank, world, args.prefix or name)
    backend_ready = time.time()
    label = args.backend + (f" {args.mode}" if args.backend == "raftps" else "") + f" x{world}"
    if args.backend == "raftps" and (args.n_push, args.n_fetch) != (1, 1):
        label += f" (n_push {args.n_push}, n_fetch {args.n_fetch})"
    meta = {"example": name, "backend": args.backend, "mode": args.mode if args.backend == "raftps" else None,
            "world_size": world, "label": label, "steps": args.steps, "batch": args.batch, "lr": args.lr,
            "n_push": args.n_push, "n_fetch": args.n_fetch, "seed": args.seed, "start_step": backend.start_step,
            "parameters": sum(p.numel() for p in model.parameters())}
    rec = Metrics(args.out, metric, higher_is_better, args.target, meta, resumed=backend.start_step > 0) \
        if rank == 0 else None
    mine = my_batches(backend, args.steps)
    if rank == 0 or backend.start_step:
        print(f"[rank {rank}] {name}: {label}, {meta['parameters']:,} parameters, global batches "
              f"{mine.start}..{args.steps} (start_step {backend.start_step})", flush=True)
    ema = None
    if rec is not None:
        rec.now()                                   # time 0: the first training step starts
    for g in mine:
        idx = my_part(batch_indices(g), backend)
        backend.zero_grad()
        loss = loss_on(backend.model, idx)
        loss.backward()
        backend.step()
        if backend.checkpoint_every and (g + 1) % backend.checkpoint_every == 0:
            backend.save_checkpoint(g + 1)
        if g == mine.start:         # bench/goodput_fleet.py times a returning worker to this line
            print(f"[rank {rank}] contributing: first step done at batch {g + 1} ({startup(trained_from, backend_ready)})",
                  flush=True)
        w = 0.9 ** (1 if backend.sharded else world)    # the same time constant in global batches
        ema = loss.item() if ema is None else w * ema + (1 - w) * loss.item()
        if rec is not None:
            # evaluate when this rank's batches cross a multiple of eval_every (async ranks skip g's)
            due = (g + (1 if backend.sharded else world)) // args.eval_every > g // args.eval_every
            rec.log_step(g + 1, ema, evaluate(model) if due or g == 0 else None)
    summary = None
    if rec is not None:
        final = evaluate(model)
        rec.log_step(args.steps, ema if ema is not None else math.nan, final)
        extra = {}
        if backend.kind == "raftps":         # rank 0's time in the store: {push|pull}: [calls, seconds]
            extra = {f"raftps_{k}_{u}": v[i] for k, v in backend.opt.timings.items() for i, u in ((0, "calls"), (1, "s"))}
        summary = rec.finish(final, extra)
        print(f"[rank 0] done: {metric} {final:.4f}, steady {summary['steady_steps_per_s']:.2f} steps/s, "
              f"time to target {summary['time_to_target_s']}", flush=True)
    backend.close()
    return summary
