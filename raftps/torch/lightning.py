"""PyTorch Lightning on raftps: ``RaftpsStrategy``, for K worker processes under torchrun.

    from raftps.torch.lightning import RaftpsStrategy
    trainer = L.Trainer(accelerator="cpu", devices=K, strategy=RaftpsStrategy(), gradient_clip_val=1.0)

and ``configure_optimizers`` returns ``raftps.torch.DistributedOptimizer(torch_optimizer,
model=self, mode=...)``. Lightning's DDP strategy would wrap the model in
``DistributedDataParallel`` and all-reduce every gradient: on top of a raftps sync step that
doubles the traffic, and under ``mode="diloco"`` it makes every inner step a synchronous one.
This strategy is Lightning's DDP strategy without the wrapper and without a torch process group:
ranks and world size come from the launcher (torchrun's environment, as for DDP), each rank reads
its shard of the data (Lightning's ``DistributedSampler``), the optimizer's store is the only
channel between the ranks (a rank that dies cannot hang the others in a collective), and
checkpoints and logs are written by rank 0, as Lightning does. ``gradient_clip_val`` (by norm) goes
to the optimizer's own ``clip_grad_norm_``: in sync mode the store clips the step's mean gradient,
as one process clipping the full batch. Metrics logged with ``sync_dist=True`` stay per rank
(there is no process group to reduce them).

Importing this module imports Lightning (``pip install 'raftps[frameworks]'``); ``raftps.torch``
itself never does.
"""
from __future__ import annotations

import math
from typing import Any

try:
    import lightning  # noqa: F401
except ImportError:
    raise ImportError("raftps.torch.lightning needs PyTorch Lightning: pip install 'raftps[frameworks]' "
                      "(install torch's CPU build first: bash cluster/setup.sh --torch)") from None

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType


class RaftpsStrategy(DDPStrategy):
    """Lightning's DDP strategy with raftps doing the synchronisation: no DDP wrapper, no torch
    process group, no gradient all-reduce. Every optimizer must be a raftps
    ``DistributedOptimizer`` whose world size is the launcher's; otherwise setup refuses it (a
    plain optimizer would silently train K unrelated models)."""

    strategy_name = "raftps"

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()          # ranks from the cluster environment (torchrun's RANK, WORLD_SIZE, ...)

    def configure_ddp(self) -> None:
        pass                             # the model stays as it is: the store averages the gradients

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        for opt in self.optimizers:
            world = getattr(opt, "world_size", None)
            if not callable(getattr(opt, "clip_grad_norm_", None)) or not isinstance(world, int):
                raise ValueError(f"RaftpsStrategy needs raftps DistributedOptimizers, got {type(opt).__name__}: "
                                 "return raftps.torch.DistributedOptimizer(torch_optimizer, model=self, mode=...) "
                                 "from configure_optimizers")
            if world != self.world_size:
                raise ValueError(f"the DistributedOptimizer has world_size {world} but the launcher started "
                                 f"{self.world_size} processes; leave rank and world_size to the launcher")

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        plugin = self.precision_plugin
        if "clip_grad_by_norm" not in vars(plugin):      # once per plugin, however many fits
            plugin.clip_grad_by_norm = _clip_through_optimizer(plugin.clip_grad_by_norm)
            plugin.clip_gradients = _clip_unscaled_in_the_store(plugin, plugin.clip_gradients)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass                             # no process group: ranks meet in the store's sync steps only

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj


def _clip_unscaled_in_the_store(plugin: Precision, clip_gradients: Any) -> Any:
    """16-mixed refuses to clip for an optimizer that unscales the gradients in its own step (a
    fused one would clip gradients still scaled). A raftps optimizer does so with K > 1 sync
    ranks (so that GradScaler calls every rank's step: raftps/torch/amp.py), and its clipping by
    norm is the store's, on the ranks' unscaled mean gradient: that goes through. Clipping by
    value would clip this rank's scaled gradients, and stays refused."""
    def clip(optimizer: torch.optim.Optimizer, clip_val: float = 0.0,
             gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM and callable(getattr(optimizer, "clip_grad_norm_", None)):
            return Precision.clip_gradients(plugin, optimizer, clip_val, gradient_clip_algorithm)
        return clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
    return clip


def _clip_through_optimizer(clip_locally: Any) -> Any:
    """Lightning's clip-by-norm, sent to the raftps optimizer's ``clip_grad_norm_`` (which clips
    the step's mean gradient in sync mode, this worker's own elsewhere); an infinite limit (a
    norm only) stays torch's."""
    def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if math.isfinite(clip_val) and callable(getattr(optimizer, "clip_grad_norm_", None)):
            optimizer.clip_grad_norm_(float(clip_val))
        else:
            clip_locally(optimizer, clip_val)
    return clip_grad_by_norm
