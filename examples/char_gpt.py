"""A small GPT-style character language model on the Python standard library's own source.

The text is a fixed list of stdlib modules (every machine with Python has them, offline),
concatenated; the first 90% trains, the last 10% validates; the vocabulary is fixed
(printable ASCII, newline, and one token for anything else), so every rank and every machine
agrees on it. The model follows nanoGPT: token + position embeddings, pre-LayerNorm blocks of
causal self-attention and a 4x MLP, a final LayerNorm and a linear head.

    python examples/char_gpt.py --backend local
    torchrun --nproc-per-node 4 examples/char_gpt.py --backend ddp
    torchrun --nproc-per-node 4 examples/char_gpt.py --backend raftps --mode async   # RAFTPS_CLUSTER set
"""
from __future__ import annotations

import os
import sysconfig
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common import parse_args, train

FILES = ["argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "inspect.py",
         "json/decoder.py", "json/encoder.py", "logging/__init__.py", "os.py", "pathlib.py",
         "subprocess.py", "textwrap.py", "threading.py", "typing.py"]
VOCAB = ["\n"] + [chr(c) for c in range(32, 127)] + ["\0"]          # "\0": anything else (tabs, non-ASCII)
STOI = {c: i for i, c in enumerate(VOCAB)}


def load_text() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the concatenated files: (train, validation). Files missing here are skipped."""
    root = sysconfig.get_paths()["stdlib"]
    text = "".join(open(os.path.join(root, f), encoding="utf-8").read()
                   for f in FILES if os.path.exists(os.path.join(root, f)))
    ids = torch.tensor([STOI.get(c, len(VOCAB) - 1) for c in text], dtype=torch.long)
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:]


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, heads: int, d: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


DEFAULTS = dict(steps=300, batch=32, lr=2e-3, eval_every=25, target=2.0)
BLOCK, LAYERS, HEADS, WIDTH = 64, 4, 4, 160


def build(seed: int, batch: int) -> tuple[nn.Module, Callable, Callable, Callable]:
    """The model (seeded: the same initial weights on every rank), ``batch_indices(g)``,
    ``loss_on(model, idx)`` and ``val_loss(model)``: what ``train`` takes, and what other
    training loops (bench/goodput_worker.py) reuse."""
    train_ids, val_ids = load_text()
    block = BLOCK
    torch.manual_seed(seed)
    model = GPT(len(VOCAB), block, LAYERS, HEADS, WIDTH)
    # validation: 64 fixed windows of the held-out text
    starts = np.random.default_rng(12345).integers(0, len(val_ids) - block - 1, 64)
    vx = torch.stack([val_ids[s:s + block] for s in starts])
    vy = torch.stack([val_ids[s + 1:s + block + 1] for s in starts])

    def batch_indices(g: int) -> np.ndarray:
        """Global batch g: ``batch`` random window starts, a function of (seed, g) only."""
        return np.random.default_rng([seed, g]).integers(0, len(train_ids) - block - 1, batch)

    def loss_on(m: nn.Module, idx: np.ndarray) -> torch.Tensor:
        x = torch.stack([train_ids[s:s + block] for s in idx])
        y = torch.stack([train_ids[s + 1:s + block + 1] for s in idx])
        return F.cross_entropy(m(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def val_loss(m: nn.Module) -> float:
        return F.cross_entropy(m(vx).flatten(0, 1), vy.flatten()).item()

    return model, batch_indices, loss_on, val_loss


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], DEFAULTS)
    model, batch_indices, loss_on, val_loss = build(args.seed, args.batch)
    train(args, "char_gpt", model, batch_indices, loss_on, val_loss, "val_loss", higher_is_better=False)


if __name__ == "__main__":
    main()
