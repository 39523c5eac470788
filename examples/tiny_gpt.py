"""What examples/lightning_gpt.py and examples/hf_trainer.py share: their flags, a tiny GPT-2
built from a config (transformers' GPT2LMHeadModel: nothing is downloaded), windows of
examples/char_gpt.py's text (Python's standard library, offline) and the raftps optimizer.

Each runs as one process or as K torchrun workers against a raftps cluster (RAFTPS_CLUSTER,
RAFTPS_TOKEN_FILE), in ``--mode sync`` (every step's mean gradient applied in the store) or
``--mode diloco`` (AdamW steps on each worker, the store's outer step every ``--sync-every``).
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")        # built from a config: nothing to fetch

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import raftps.torch as rpt  # noqa: E402
from char_gpt import VOCAB, load_text  # noqa: E402

BLOCK = 64


def parse_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--backend", choices=["raftps", "ddp"], default="raftps",
                    help="ddp: the framework's own DDP with torch's AdamW (the baseline bench/torch_frameworks.py measures)")
    ap.add_argument("--mode", choices=["sync", "async", "diloco"], default="sync")
    ap.add_argument("--prefix", help="the job's tensor names in the store (default: the script's name)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=8, help="windows per worker per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping by norm")
    ap.add_argument("--sync-every", type=int, default=10, help="diloco: inner steps per round")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=64, help="n_embd (4 heads)")
    ap.add_argument("--out", default="runs/frameworks", help="checkpoints and summary.json (rank 0)")
    return ap.parse_args()


def tiny_gpt(args: argparse.Namespace) -> GPT2LMHeadModel:
    """``--layers`` blocks of ``--width`` over examples/char_gpt.py's 97 characters (the same on
    every rank: seeded); 4 blocks of 160 are char_gpt.py's size."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(VOCAB), n_positions=BLOCK, n_layer=args.layers,
                                      n_embd=args.width, n_head=4, bos_token_id=0, eos_token_id=0))


class Windows(torch.utils.data.Dataset):
    """``count`` fixed windows of BLOCK characters of the training (or validation) text."""

    def __init__(self, count: int, validation: bool = False):
        train, val = load_text()
        self.ids = val if validation else train
        self.starts = np.random.default_rng(1 if validation else 0).integers(0, len(self.ids) - BLOCK, count)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        window = self.ids[int(self.starts[i]):int(self.starts[i]) + BLOCK]
        return {"input_ids": window, "labels": window}       # the model shifts the labels itself


def optimizer(args: argparse.Namespace, model: torch.nn.Module, default_prefix: str) -> torch.optim.Optimizer:
    """AdamW on raftps: rank and world size from torchrun, the cluster from RAFTPS_CLUSTER
    (``--backend ddp``: torch's AdamW, for the framework's DDP)."""
    adamw = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if args.backend == "ddp":
        return adamw
    options = {"sync_every": args.sync_every} if args.mode == "diloco" else {}
    return rpt.DistributedOptimizer(adamw, model=model, mode=args.mode, prefix=args.prefix or default_prefix,
                                    **options)


class StepClock:
    """The time of each optimizer step's end, for the steady rate: the steps between 10% and 90%
    of the run over their time (start-up and the last steps left out)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def tick(self) -> None:
        self.times.append(time.perf_counter())

    def steady_rate(self) -> float | None:
        first, last = len(self.times) // 10, (9 * len(self.times)) // 10
        return (last - first) / (self.times[last] - self.times[first]) if last > first else None


def write_summary(args: argparse.Namespace, **results: float | None) -> None:
    os.makedirs(args.out, exist_ok=True)
    summary = {"backend": args.backend, "mode": args.mode, "steps": args.steps,
               "world_size": int(os.environ.get("WORLD_SIZE", "1")), **results}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f)
    print(json.dumps(summary))
