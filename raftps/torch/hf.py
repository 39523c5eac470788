"""Hugging Face Trainer and Accelerate on raftps, for K worker processes under torchrun.

    opt = raftps.torch.DistributedOptimizer(torch.optim.AdamW(model.parameters()), model=model, mode="sync")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    raftps.torch.hf.without_ddp(trainer)            # or without_ddp(accelerator, opt) before prepare()
    trainer.train()

Under torchrun both frameworks wrap the model in ``DistributedDataParallel`` when
``Accelerator.prepare`` sees it (the Trainer prepares through its own Accelerator), and DDP
all-reduces every gradient: on top of a raftps sync step that doubles the traffic, and under
``mode="diloco"`` it makes every inner step a synchronous one. ``without_ddp`` makes that
Accelerator prepare the model as Accelerate prepares one for evaluation (device placement, mixed
precision, ``torch.compile``: everything but the distributed wrapper), so the store is the only
channel the gradients take. Everything else stays the framework's: the data is sharded by rank,
gradient accumulation, logging, evaluation and checkpoints on rank 0, skipped fp16 steps.
A sync step the store skipped because another rank's GradScaler found an inf counts as skipped
here too: the optimizer the Accelerator prepares reports it in ``step_was_skipped``, which
Accelerate's scheduler and the Trainer read before stepping the LR schedule (as under DDP,
where every rank's GradScaler sees the inf).
Clipping (``max_grad_norm``, ``accelerator.clip_grad_norm_``) goes to the raftps optimizer's
``clip_grad_norm_``, so in sync mode the store clips the step's mean gradient, as one process
clipping the full batch.

Importing this module imports Accelerate (``pip install 'raftps[frameworks]'``); ``raftps.torch``
itself never does.
"""
from __future__ import annotations

import math
from typing import Any

try:
    import accelerate  # noqa: F401
except ImportError:
    raise ImportError("raftps.torch.hf needs Accelerate (and Transformers for its Trainer): "
                      "pip install 'raftps[frameworks]' (install torch's CPU build first: "
                      "bash cluster/setup.sh --torch)") from None

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

# the Accelerator setups whose model wrapping is plain DDP (FSDP, DeepSpeed, XLA shard or own the optimizer)
UNWRAPPABLE = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}


def without_ddp(trainer_or_accelerator: Any, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Make ``trainer_or_accelerator`` (a ``transformers.Trainer``, or an ``accelerate.Accelerator``
    before its ``prepare``) leave the model unwrapped, and send its gradient clipping to
    ``optimizer``, a raftps ``DistributedOptimizer`` (a Trainer's ``optimizers=(opt, ...)`` by
    default). Returns its argument."""
    accelerator = getattr(trainer_or_accelerator, "accelerator", trainer_or_accelerator)
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"without_ddp takes a transformers.Trainer or an accelerate.Accelerator, "
                        f"got {type(trainer_or_accelerator).__name__}")
    if optimizer is None:
        optimizer = getattr(trainer_or_accelerator, "optimizer", None)
    if not (callable(getattr(optimizer, "clip_grad_norm_", None)) and isinstance(getattr(optimizer, "world_size", None), int)):
        raise ValueError("without_ddp needs the raftps DistributedOptimizer: Trainer(..., optimizers=(opt, None)) "
                         "or without_ddp(accelerator, opt)")
    if accelerator.distributed_type not in UNWRAPPABLE:
        raise ValueError(f"without_ddp supports plain data parallelism only, not {accelerator.distributed_type}: "
                         "FSDP and DeepSpeed shard the model and the optimizer themselves")
    if optimizer.world_size != accelerator.num_processes:
        raise ValueError(f"the DistributedOptimizer has world_size {optimizer.world_size} but the launcher started "
                         f"{accelerator.num_processes} processes; leave rank and world_size to the launcher")
    prepare_model, prepare_optimizer = accelerator.prepare_model, accelerator.prepare_optimizer
    clip_locally = accelerator.clip_grad_norm_

    def prepare_unwrapped(model: torch.nn.Module, device_placement: bool | None = None,
                          evaluation_mode: bool = False) -> torch.nn.Module:
        return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def prepare_reporting_skips(opt: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        prepared = prepare_optimizer(opt, device_placement=device_placement)
        if type(prepared) is AcceleratedOptimizer:     # Accelerate builds it inside prepare: made ours here
            prepared.__class__ = ReportsStoreSkips
        return prepared

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        if not math.isfinite(max_norm):              # the Trainer asks for the norm alone this way
            return clip_locally(parameters, max_norm, norm_type)
        accelerator.unscale_gradients()              # fp16: the scaler's factor out first, as Accelerate does
        return optimizer.clip_grad_norm_(float(max_norm), norm_type)

    accelerator.prepare_model = prepare_unwrapped
    accelerator.prepare_optimizer = prepare_reporting_skips
    accelerator.clip_grad_norm_ = clip_grad_norm_
    return trainer_or_accelerator


class ReportsStoreSkips(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper, whose ``step_was_skipped`` also says when the store skipped
    the step. Accelerate counts a step as skipped when GradScaler did not call ``step()``; with K > 1
    sync ranks GradScaler calls every rank's (raftps/torch/amp.py), and the store skips the step
    for all when one rank's gradients hold an inf: on the other ranks ``step()`` ran, and only the
    store's answer (``last_step_skipped``) says the step was skipped."""

    @property
    def step_was_skipped(self) -> bool:
        return super().step_was_skipped or bool(getattr(self.optimizer, "last_step_skipped", False))
