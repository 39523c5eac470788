"""Datasets behind one function, and the batch schedules every mode shares.

Only ``digits`` for now (scikit-learn's bundled 8x8 handwritten digits: nothing is downloaded).
A larger dataset is one more branch in ``load_dataset`` returning the same ``Dataset``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPLIT_SEED = 0          # the train/test split never depends on the run's seed: runs stay comparable


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: np.ndarray     # (n, d) float32
    y_train: np.ndarray     # (n,) int64
    x_test: np.ndarray
    y_test: np.ndarray
    classes: int

    @property
    def features(self) -> int:
        return self.x_train.shape[1]


def load_dataset(name: str = "digits", test_fraction: float = 0.2) -> Dataset:
    """A fixed train/test split of dataset ``name``, features scaled to [0, 1], float32."""
    if name != "digits":
        raise ValueError(f"unknown dataset {name!r} (known: digits)")
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:      # the optional extra is missing: say which one
        raise ImportError("the digits dataset needs scikit-learn: pip install 'raftps[train]'") from exc
    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test], int(y.max()) + 1)


def steps_per_epoch(n: int, batch: int) -> int:
    """Whole batches in one pass over ``n`` examples (the remainder is dropped, so every step
    sees exactly ``batch`` examples and sync shards stay equal)."""
    if batch > n:
        raise ValueError(f"batch {batch} is larger than the {n} training examples")
    return n // batch


def global_batch(n: int, batch: int, step: int, seed: int) -> np.ndarray:
    """Indices of the examples of global step ``step`` (local and sync modes).

    Epoch e is a permutation seeded by (seed, e), so any process, including a worker restarted
    in the middle of a run, computes the same batch for the same step."""
    spe = steps_per_epoch(n, batch)
    epoch, k = divmod(step, spe)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[k * batch:(k + 1) * batch]


def sync_shard(n: int, batch: int, step: int, seed: int, rank: int, workers: int) -> np.ndarray:
    """Worker ``rank``'s equal part of global step ``step``'s batch."""
    if batch % workers:
        raise ValueError(f"sync mode needs --batch ({batch}) divisible by --workers ({workers})")
    part = batch // workers
    return global_batch(n, batch, step, seed)[rank * part:(rank + 1) * part]


def async_shard(n: int, rank: int, workers: int) -> np.ndarray:
    """Worker ``rank``'s fixed share of the training set for async (Downpour) training."""
    return np.arange(n)[rank::workers]


def async_batch(shard: np.ndarray, batch: int, step: int, seed: int, rank: int) -> np.ndarray:
    """Indices of async worker ``rank``'s local step ``step``: its shard, reshuffled every epoch."""
    spe = steps_per_epoch(len(shard), batch)
    epoch, k = divmod(step, spe)
    perm = np.random.default_rng([seed, rank, epoch]).permutation(len(shard))
    return shard[perm[k * batch:(k + 1) * batch]]
