"""The Hugging Face Trainer trains a tiny GPT-2 (built from a config, nothing downloaded) on raftps:
``Trainer(optimizers=(raftps DistributedOptimizer, None))``, and ``without_ddp`` keeps the
Trainer's Accelerator from wrapping the model in DDP (the store is the only channel between the
workers' gradients). Its scheduler, clipping, accumulation, evaluation and rank-0 logging are
the Trainer's own.

    bash cluster/start.sh            # its last line: RAFTPS_CLUSTER=...; RAFTPS_TOKEN_FILE=cluster/run/token
    torchrun --nproc-per-node 2 examples/hf_trainer.py --mode sync --prefix hf-sync
    torchrun --nproc-per-node 2 examples/hf_trainer.py --mode diloco --sync-every 10 --prefix hf-diloco
    python examples/hf_trainer.py --mode sync --prefix hf-one           # one process
"""
from __future__ import annotations

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from raftps.torch.hf import without_ddp
from tiny_gpt import StepClock, Windows, optimizer, parse_args, tiny_gpt, write_summary


class Clock(TrainerCallback):
    def __init__(self) -> None:
        self.clock = StepClock()

    def on_step_end(self, *args, **kwargs) -> None:
        self.clock.tick()


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    model, clock = tiny_gpt(args), Clock()
    opt = optimizer(args, model, "hf-trainer")
    training = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                                 max_grad_norm=args.clip, lr_scheduler_type="cosine", warmup_steps=args.steps // 10,
                                 use_cpu=True, report_to=[], save_strategy="no", logging_steps=10,
                                 disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=Windows(args.steps * args.batch * training.world_size),
                      eval_dataset=Windows(64, validation=True), optimizers=(opt, None), callbacks=[clock])
    if args.backend == "raftps":
        without_ddp(trainer)
    trainer.train()
    val_loss = trainer.evaluate()["eval_loss"]      # every rank its share, gathered: the Trainer's own
    if trainer.is_world_process_zero():
        write_summary(args, val_loss=val_loss, steps_per_s=clock.clock.steady_rate())
    if torch.distributed.is_initialized():   # the Trainer's gloo group, closed before exit: torn down at
        torch.distributed.destroy_process_group()   # interpreter exit it aborted a finished rank (SIGABRT)


if __name__ == "__main__":
    main()
