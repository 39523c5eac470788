"""One worker of bench/goodput.py's torchft and raftps DiLoCo configurations: the char GPT of
examples/char_gpt.py (its model, data, seed and validation windows, through ``build``) in a
training loop of the library's own shape. Rank 0 (replica group 0) writes metrics.csv as the
examples do (examples/common.py's ``Metrics``).

    torchrun --nproc-per-node 1 bench/goodput_worker.py --kind torchft-ddp ...   # REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE
    RANK=r WORLD_SIZE=4 python bench/goodput_worker.py --kind raftps-diloco ...  # RAFTPS_CLUSTER

Every rank trains on its 1/K part of global batch g (K: replica groups or world size), so one
global batch is the same tokens in every configuration. torchft: a step taken while fewer than K
replica groups participate is appended to ``short_steps.txt`` (those parts of the batch are lost).
"""
from __future__ import annotations

import time

T_START = time.time()          # about the process's start (before importing torch)

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
# Run as a script, this file's folder comes first on sys.path, and bench/profile.py would shadow
# the standard library's profile module (torch imports cProfile).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from char_gpt import DEFAULTS, build  # noqa: E402
from common import Metrics, startup  # noqa: E402

KINDS = ("torchft-ddp", "torchft-diloco", "raftps-diloco", "raftps-diloco-async")
# One inner optimizer for every configuration: DDP's, DDP + checkpoint-restart's, torchft's and
# raftps sync's torch.optim.Adam (default betas 0.9/0.999, no weight decay) is DiLoCo's inner one
# too (the paper's AdamW, wd 0.1, betas 0.9/0.95, would make the comparison one of optimizers).
# The two outer steps (as torch.optim.SGD keywords): the paper's, and plain averaging (what
# reaches a given loss sooner over tens of rounds: bench/results/diloco_quality.md).
OUTERS = {"nesterov": dict(lr=0.7, momentum=0.9, nesterov=True), "average": dict(lr=1.0)}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--steps", type=int, required=True, help="global batches")
    ap.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    ap.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="(inner) Adam learning rate")
    ap.add_argument("--eval-every", type=int, default=DEFAULTS["eval_every"])
    ap.add_argument("--sync-every", type=int, default=20, help="DiLoCo's H")
    ap.add_argument("--outer", choices=sorted(OUTERS), default="average", help="synchronous DiLoCo's outer step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compress", choices=["none", "fp16", "int8"], default="none",
                    help="raftps DiLoCo: pseudo-gradients on the wire (int8: per-block scales, decoded in the store)")
    ap.add_argument("--prefix", default="goodput", help="raftps tensor prefix")
    ap.add_argument("--wrapper", choices=["flat", "pure", "ddp"], default="flat",
                    help="torchft-ddp: one all-reduce of the flattened gradients per step (default), "
                         "torchft.ddp.PureDistributedDataParallel, or its DistributedDataParallel")
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def part(idx, rank: int, ranks: int):
    n = len(idx) // ranks
    return idx[rank * n:(rank + 1) * n]


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    model, batch_indices, loss_on, val_loss = build(args.seed, args.batch)
    if args.kind.startswith("torchft"):
        rank, ranks = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    else:
        rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.batch % ranks:
        raise SystemExit(f"--batch {args.batch} must be divisible by {ranks}")
    meta = {"example": "char_gpt", "label": f"{args.kind} x{ranks}", "steps": args.steps, "batch": args.batch,
            "lr": args.lr, "seed": args.seed, "parameters": sum(p.numel() for p in model.parameters())}
    if args.kind == "torchft-ddp":
        train_torchft_ddp(args, model, batch_indices, loss_on, val_loss, rank, ranks, meta)
    elif args.kind == "torchft-diloco":
        train_torchft_diloco(args, model, batch_indices, loss_on, val_loss, rank, ranks, meta)
    else:
        train_raftps_diloco(args, model, batch_indices, loss_on, val_loss, rank, ranks, meta)


def _metrics(args: argparse.Namespace, meta: dict, start: int) -> Metrics:
    rec = Metrics(args.out, "val_loss", False, None, {**meta, "start_step": start}, resumed=start > 0)
    print(f"[rank 0] char_gpt: {meta['label']}, global batches {start}..{args.steps}", flush=True)
    rec.now()
    return rec


_KEEP: list = []          # objects that must live as long as the process


def _manager(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], rank: int, sync_quorum: bool):
    from torchft import Manager, ProcessGroupGloo
    if os.environ.get("GOODPUT_REPLICA_STORE"):
        # A replica group of one process started without torchrun (bench/goodput_fleet.py): the
        # group's store, which torchrun's agent would hold at MASTER_ADDR:MASTER_PORT, is held here.
        from torch.distributed import TCPStore
        _KEEP.append(TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 1, is_master=True,
                              wait_for_workers=False))

    def state_dict() -> dict:
        return {"model": model.state_dict(), **{f"optim{i}": o.state_dict() for i, o in enumerate(optimizers)}}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        for i, o in enumerate(optimizers):
            o.load_state_dict(sd[f"optim{i}"])

    # As torchft's train_ddp.py / train_diloco.py: gloo on CPU, min_replica_size 1, 10 s timeouts.
    return Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                   load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"goodput_{rank}",
                   timeout=timedelta(seconds=10), use_async_quorum=not sync_quorum)


def flat_allreduce(manager: Any, model: torch.nn.Module) -> None:
    """The step's gradients averaged in one ``manager.allreduce`` of them flattened (one bucket, as
    DDP's buckets would be at this model's size), waited before the optimizer step.

    torchft 0.2.0's PureDistributedDataParallel starts one all-reduce per gradient and never waits
    on them on CPU (``should_commit`` synchronises only an accelerator), so the step could read
    gradients gloo is still summing; its DistributedDataParallel (a comm hook) raised
    AssertionError (ddp.py:76, ``assert fut._fut``) in the surviving replica groups once a peer
    was SIGKILLed; one waited call per gradient (53 here) is what its docstring calls very slow."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()                  # averages over the participants
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _contributing(rank: int, step: int, imported: float = T_START, ready: float = T_START) -> bool:
    """The line bench/goodput_fleet.py times a returning worker to: its first step is done (with
    the phases of its start, when the caller timed them)."""
    phases = f" ({startup(imported, ready, T_START)})" if ready > T_START else ""
    print(f"[rank {rank}] contributing: first step done at batch {step}{phases}", flush=True)
    return True


def train_torchft_ddp(args, model, batch_indices, loss_on, val_loss, rank, ranks, meta) -> None:
    from torchft import DistributedDataParallel, Optimizer
    from torchft.ddp import PureDistributedDataParallel
    inner = torch.optim.Adam(model.parameters(), lr=args.lr)
    manager = _manager(model, [inner], rank, sync_quorum=False)
    wrap = {"ddp": DistributedDataParallel, "pure": PureDistributedDataParallel}.get(args.wrapper)
    ddp, opt = (wrap(manager, model) if wrap else model), Optimizer(manager, inner)
    rec = _metrics(args, meta, manager.current_step()) if rank == 0 else None
    short = open(os.path.join(args.out, "short_steps.txt"), "a") if rank == 0 else None
    ema, said = None, False
    while manager.current_step() < args.steps:
        opt.zero_grad()                               # starts the step's quorum
        g = manager.current_step()
        loss = loss_on(ddp, part(batch_indices(g), rank, ranks))
        loss.backward()
        if args.wrapper == "flat":
            flat_allreduce(manager, model)
        opt.step()                                    # commits only if every participant's all-reduce worked
        said = said or _contributing(rank, manager.current_step())
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if rec is not None:
            if manager.num_participants() < ranks:
                short.write(f"{g + 1}\n")
                short.flush()
            step = manager.current_step()
            rec.log_step(step, ema, val_loss(model) if step % args.eval_every == 0 or step == 1 else None)
    if rec is not None:
        rec.finish(val_loss(model))


def train_torchft_diloco(args, model, batch_indices, loss_on, val_loss, rank, ranks, meta) -> None:
    from torchft.local_sgd import DiLoCo
    inner = torch.optim.Adam(model.parameters(), lr=args.lr)
    outer = torch.optim.SGD(model.parameters(), **OUTERS[args.outer])
    manager = _manager(model, [inner, outer], rank, sync_quorum=True)   # train_diloco.py's setting
    H = args.sync_every
    rec = None
    ema, said = None, False
    with DiLoCo(manager, [model], inner, outer, sync_every=H, pin_memory=False):
        local = 0                                     # inner steps since the last round
        while manager.current_step() * H + local < args.steps:
            g = manager.current_step() * H + local    # the round's steps: the same batches on a rejoin
            if rec is None and rank == 0:
                rec = _metrics(args, meta, g)
                short = open(os.path.join(args.out, "short_steps.txt"), "a")
            inner.zero_grad()
            loss = loss_on(model, part(batch_indices(g), rank, ranks))
            loss.backward()
            inner.step()                              # DiLoCo's hook syncs at the round's H-th step
            local = (local + 1) % H                   # a failed round does not advance the step: redone
            said = said or _contributing(rank, g + 1)
            ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
            if rec is not None:
                step = g + 1
                if local == 0 and manager.num_participants() < ranks:
                    short.write(f"{step}\n")
                    short.flush()
                rec.log_step(step, ema, val_loss(model) if step % args.eval_every == 0 or step == 1 else None)
    if rec is not None:
        rec.finish(val_loss(model))


def train_raftps_diloco(args, model, batch_indices, loss_on, val_loss, rank, ranks, meta) -> None:
    import raftps.torch as rpt
    imported = time.time()
    inner = torch.optim.Adam(model.parameters(), lr=args.lr)
    mode = args.kind[len("raftps-"):]
    # synchronous: the outer step torchft's DiLoCo runs in the same run; asynchronous: raftps's
    # default (averaging: the paper's momentum diverges when pseudo-gradients apply on arrival)
    spec = OUTERS[args.outer]
    outer = ({"outer": {"name": "momentum" if spec.get("momentum") else "sgd", **spec}} if mode == "diloco" else {})
    opt = rpt.DistributedOptimizer(inner, model=model, mode=mode, sync_every=args.sync_every, prefix=args.prefix,
                                   rank=rank, world_size=ranks, compress=None if args.compress == "none" else args.compress,
                                   **outer)
    start, ready = int(opt.start_step), time.time()
    if rank != 0 and start:
        print(f"[rank {rank}] char_gpt: resumed at global batch {start}", flush=True)
    rec = _metrics(args, meta, start) if rank == 0 else None
    acked = open(os.path.join(args.out, "rounds_acked.txt"), "a")     # bench/goodput_report.py, store_check
    ema = None
    for g in range(start, args.steps):
        opt.zero_grad()
        loss = loss_on(model, part(batch_indices(g), rank, ranks))
        loss.backward()
        opt.step()
        if g == start:
            _contributing(rank, g + 1, imported, ready)
        for r in opt.synced:
            if not r.late:
                acked.write(f"{rank} {r.fragment} {r.round}\n")
                acked.flush()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if rec is not None:
            step = g + 1
            rec.log_step(step, ema, val_loss(model) if step % args.eval_every == 0 or step == 1 else None)
    if rec is not None:
        rec.finish(val_loss(model))
    opt.close()


if __name__ == "__main__":
    main()
