"""PyTorch Lightning trains a tiny GPT-2 (built from a config, nothing downloaded) on raftps:
``configure_optimizers`` returns a raftps DistributedOptimizer, and ``RaftpsStrategy`` keeps
Lightning from wrapping the model in DDP (the store is the only channel between the workers).

    bash cluster/start.sh            # its last line: RAFTPS_CLUSTER=...; RAFTPS_TOKEN_FILE=cluster/run/token
    torchrun --nproc-per-node 2 examples/lightning_gpt.py --mode sync --prefix lt-sync
    torchrun --nproc-per-node 2 examples/lightning_gpt.py --mode diloco --sync-every 10 --prefix lt-diloco
    python examples/lightning_gpt.py --mode sync --prefix lt-one        # one process
"""
from __future__ import annotations

import os

import torch
import lightning as L

from raftps.torch.lightning import RaftpsStrategy
from tiny_gpt import StepClock, Windows, optimizer, parse_args, tiny_gpt, write_summary


class Clock(L.Callback):
    def __init__(self) -> None:
        self.clock = StepClock()

    def on_train_batch_end(self, *args) -> None:
        self.clock.tick()


class CharGPT(L.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args, self.model = args, tiny_gpt(args)

    def training_step(self, batch: dict, index: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        opt = optimizer(self.args, self, "lightning-gpt")
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.args.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    module, clock = CharGPT(args), Clock()
    strategy = RaftpsStrategy() if args.backend == "raftps" else ("ddp" if world > 1 else "auto")
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps,
                        gradient_clip_val=args.clip, default_root_dir=args.out, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock])
    trainer.fit(module, torch.utils.data.DataLoader(Windows(args.steps * args.batch * world), batch_size=args.batch))
    if trainer.is_global_zero:                      # rank 0 evaluates and writes, as Lightning itself does
        with torch.no_grad():
            batch = torch.utils.data.default_collate([Windows(64, validation=True)[i] for i in range(64)])
            write_summary(args, val_loss=module.model(**batch).loss.item(), steps_per_s=clock.clock.steady_rate())


if __name__ == "__main__":
    main()
