"""One rank of test_workers.py's torchrun job: Lightning (RaftpsStrategy), the HF Trainer and
Accelerate (raftps.torch.hf.without_ddp), each in sync and in diloco mode, one after the other
in this process. After every optimizer step the model's parameters are recorded; each run's
record goes to OUT/<framework>-<mode>-rank<R>.pt (a tensor: one row per step). Then Accelerate and
the HF Trainer in sync mode with a GradScaler, rank 0's gradient holding an inf in step 2 and
rank 1's not: OUT/<framework>-skip-rank<R>.pt ({"steps": one row per step, "scale": the
GradScaler's scale at the end}).

    python -m torch.distributed.run --nproc-per-node 2 tests/frameworks/worker.py OUT
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

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
    for framework in ("accelerate", "hf"):
        steps = []
        make = lambda model: rpt.DistributedOptimizer(adamw(model), model=model, mode="sync",       # noqa: E731
                                                      prefix=f"{framework}-skip")
        record = lambda model: steps.append(flat(model))                                           # noqa: E731
        if framework == "accelerate":
            def scaled_without_ddp(accelerator, opt):
                give_a_cpu_scaler(accelerator)
                without_ddp(accelerator, opt)
            _, _, accelerator = accelerate_train(overflowing(make) if rank == 0 else make, STEPS, world * BATCH, data,
                                                 record=record, prepare=scaled_without_ddp, clip=None)
        else:
            def scaled_trainer(trainer):
                give_a_cpu_scaler(trainer.accelerator)
                without_ddp(trainer)
            _, trainer = hf_train(overflowing(make) if rank == 0 else make, STEPS, BATCH, data,
                                  os.path.join(out, "hf-skip"), record=record, prepare=scaled_trainer, clip=None)
            accelerator = trainer.accelerator
        torch.save({"steps": torch.stack(steps), "scale": accelerator.scaler.get_scale()},
                   os.path.join(out, f"{framework}-skip-rank{rank}.pt"))
    if torch.distributed.is_initialized():     # Accelerate's gloo group, closed here: gloo torn down
        torch.distributed.destroy_process_group()   # at interpreter exit once aborted a rank (SIGABRT)

if __name__ == "__main__":
    main(sys.argv[1])
