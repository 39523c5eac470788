"""One rank of test_workers.py's torchrun job: Lightning (RaftpsStrategy), the HF Trainer and
Accelerate (raftps.torch.hf.without_ddp), each in sync and in diloco mode, one after the other
in this process. After every optimizer step the model's parameters are recorded; each run's
record goes to OUT/<framework>-<mode>-rank<R>.pt (a tensor: one row per step). Then each
framework in sync mode with a GradScaler, rank 0's gradient holding an inf in step 2 and
rank 1's not: OUT/<framework>-skip-rank<R>.pt ({"steps": one row per step, "scale": the
GradScaler's scale at the end}).

    python -m torch.distributed.run --nproc-per-node 2 tests/frameworks/worker.py OUT
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

import raftps.torch as rpt  # noqa: E402
from raftps.torch.hf import without_ddp  # noqa: E402
from raftps.torch.lightning import RaftpsStrategy  # noqa: E402
from tests.frameworks.common import (accelerate_train, adamw, flat, give_a_cpu_scaler, hf_train,  # noqa: E402
                                     lightning_fit, overflowing, token_data)

STEPS, SYNC_EVERY, BATCH = 6, 3, 4       # BATCH: each rank's (Lightning, Trainer); Accelerate splits 2 * BATCH
MODES = {"sync": {}, "diloco": {"sync_every": SYNC_EVERY}}


def main(out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = token_data()
    for mode, options in MODES.items():
        def make_opt(model: torch.nn.Module, prefix: str) -> torch.optim.Optimizer:
            return rpt.DistributedOptimizer(adamw(model), model=model, mode=mode, prefix=prefix, **options)
        for framework in ("lightning", "hf", "accelerate"):
            steps: list[torch.Tensor] = []
            record = lambda model: steps.append(flat(model))                       # noqa: E731
            prefix = f"{framework}-{mode}"
            opt_for = lambda model: make_opt(model, prefix)                         # noqa: E731, B023
            save = mode == "sync"          # the framework's checkpoint (written by rank 0, as it does)
            if framework == "lightning":
                _, trainer = lightning_fit(opt_for, STEPS, BATCH, data, devices=world, strategy=RaftpsStrategy(),
                                           record=record)
                if save:
                    trainer.save_checkpoint(os.path.join(out, "lightning-sync.ckpt"))
            elif framework == "hf":
                hf_train(opt_for, STEPS, BATCH, data, os.path.join(out, prefix), record=record, prepare=without_ddp,
                         save_steps=STEPS if save else None)
            else:
                accelerate_train(opt_for, STEPS, world * BATCH, data, record=record, prepare=without_ddp)
            torch.save(torch.stack(steps), os.path.join(out, f"{prefix}-rank{rank}.pt"))
    # rank 0's GradScaler finds an infinite gradient in step 2, rank 1's does not: the store skips
    # the step for both, as DDP's all-reduced inf would on every rank
    for framework in ("lightning", "accelerate", "hf"):
        steps = []
        make = lambda model: rpt.DistributedOptimizer(adamw(model), model=model, mode="sync",       # noqa: E731
                                                      prefix=f"{framework}-skip")
        make = overflowing(make) if rank == 0 else make
        record = lambda model: steps.append(flat(model))                                           # noqa: E731
        scaler = run_with_a_scaler(framework, make, world, data, record, os.path.join(out, "hf-skip"))
        torch.save({"steps": torch.stack(steps), "scale": scaler.get_scale()},
                   os.path.join(out, f"{framework}-skip-rank{rank}.pt"))
    if torch.distributed.is_initialized():     # Accelerate's gloo group, closed here: gloo torn down
        torch.distributed.destroy_process_group()   # at interpreter exit once aborted a rank (SIGABRT)


def run_with_a_scaler(framework: str, make_opt, world: int, data: torch.Tensor, record, out: str) -> torch.amp.GradScaler:
    """``framework``'s sync run with a GradScaler (Lightning's 16-mixed, torch's CPU GradScaler
    handed to Accelerate and the Trainer), unclipped but Lightning's; returns the GradScaler."""
    if framework == "lightning":
        _, trainer = lightning_fit(make_opt, STEPS, BATCH, data, devices=world, strategy=RaftpsStrategy(),
                                   record=record, plugins=[MixedPrecision("16-mixed", "cpu")])
        return trainer.precision_plugin.scaler
    if framework == "accelerate":
        def scaled_without_ddp(accelerator, opt):
            give_a_cpu_scaler(accelerator)
            without_ddp(accelerator, opt)
        return accelerate_train(make_opt, STEPS, world * BATCH, data, record=record, prepare=scaled_without_ddp,
                                clip=None)[2].scaler

    def scaled_trainer(trainer):
        give_a_cpu_scaler(trainer.accelerator)
        without_ddp(trainer)
    return hf_train(make_opt, STEPS, BATCH, data, out, record=record, prepare=scaled_trainer, clip=None)[1].accelerator.scaler


if __name__ == "__main__":
    main(sys.argv[1])
