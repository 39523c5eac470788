"""A small CNN on scikit-learn's bundled 8x8 digits (1797 images, offline), test accuracy.

    python examples/cnn_digits.py --backend local
    torchrun --nproc-per-node 4 examples/cnn_digits.py --backend ddp
    torchrun --nproc-per-node 4 examples/cnn_digits.py --backend raftps --mode sync    # RAFTPS_CLUSTER set
    torchrun --nproc-per-node 4 examples/cnn_digits.py --backend raftps --mode async --n-push 4 --n-fetch 4
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from common import parse_args, train


class CNN(nn.Module):
    """conv3x3(16) - conv3x3(32) - maxpool - fc(64) - fc(10): 38,282 parameters."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed split: 1437 train, 360 test images, pixels scaled to [0, 1]."""
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]            # N x 1 x 8 x 8
    x_tr, x_te, y_tr, y_te = train_test_split(x, d.target, test_size=0.2, random_state=0, stratify=d.target)
    return torch.from_numpy(x_tr), torch.from_numpy(y_tr), torch.from_numpy(x_te), torch.from_numpy(y_te)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0],
                      dict(steps=300, batch=64, lr=2e-3, eval_every=10, target=0.97))
    x_tr, y_tr, x_te, y_te = load_data()
    torch.manual_seed(args.seed)                                  # same initial weights on every rank
    model = CNN()
    per_epoch = len(x_tr) // args.batch

    def batch_indices(g: int) -> np.ndarray:
        """Global batch g: a slice of epoch g // per_epoch's fixed permutation."""
        perm = np.random.default_rng([args.seed, g // per_epoch]).permutation(len(x_tr))
        return perm[(g % per_epoch) * args.batch:(g % per_epoch + 1) * args.batch]

    def loss_on(m: nn.Module, idx: np.ndarray) -> torch.Tensor:
        return F.cross_entropy(m(x_tr[idx]), y_tr[idx])

    @torch.no_grad()
    def accuracy(m: nn.Module) -> float:
        return (m(x_te).argmax(1) == y_te).float().mean().item()

    train(args, "cnn_digits", model, batch_indices, loss_on, accuracy, "test_acc", higher_is_better=True)


if __name__ == "__main__":
    main()
