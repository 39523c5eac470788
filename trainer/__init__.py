"""trainer: data-parallel training of small numpy models against a raftps cluster.

Modes: ``async`` (DownpourSGD: every worker pulls and pushes on its own schedule), ``sync``
(every step's K shard gradients are averaged and applied once, inside the replicated state
machine) and ``--local`` (the same schedule in one process, no cluster: the baseline).
"""
from .data import Dataset, load_dataset
from .networks import MLP, Softmax, make_model

__all__ = ["Dataset", "load_dataset", "MLP", "Softmax", "make_model"]
