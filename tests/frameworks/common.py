"""Shared by the framework tests and their torchrun worker (worker.py): a tiny GPT-2 built from a
config (nothing downloaded), its token data, and one training run under each framework
(Lightning, Hugging Face Trainer, Accelerate) with the optimizer ``make_opt(model)`` gives: a
plain torch AdamW, or a raftps DistributedOptimizer wrapping one."""
from __future__ import annotations

import os
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import lightning as L  # noqa: E402
from accelerate import Accelerator, DataLoaderConfiguration  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

VOCAB, SEQ = 64, 16
LR, CLIP, ACCUM, WARMUP = 1e-3, 0.5, 2, 5
Recorder = Callable[[torch.nn.Module], None]      # called after each optimizer step with the model


def tiny_gpt(seed: int = 0) -> GPT2LMHeadModel:
    """No dropout: K ranks draw other masks than one process, and would differ by them alone."""
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def token_data(n: int = 320, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return (flat(a) - flat(b)).abs().max().item()


def state_diff(a: dict, b: dict) -> float:
    """The largest difference between two torch optimizer state_dicts' per-parameter tensors
    (their parameter numbering and keys must agree)."""
    assert sorted(a["state"]) == sorted(b["state"]) and a["state"], (sorted(a["state"]), sorted(b["state"]))
    return max((a["state"][i][k].float() - b["state"][i][k].float()).abs().max().item()
               for i in a["state"] for k in a["state"][i])


def overflowing(make_opt, at_backward: int = 3):
    """``make_opt``, with the model's final LayerNorm weight given an infinite gradient in its
    ``at_backward``-th backward pass (the first micro-batch of step 2): GradScaler skips that step."""
    def make(model):
        weight = next(p for n, p in model.named_parameters() if n.endswith("ln_f.weight"))
        calls = [0]

        def hook(grad):
            calls[0] += 1
            return torch.full_like(grad, float("inf")) if calls[0] == at_backward else grad
        weight.register_hook(hook)
        return make_opt(model)
    return make


def give_a_cpu_scaler(accelerator, *_):
    """Accelerate builds its fp16 GradScaler on a GPU only; on this CPU the test hands it torch's
    CPU GradScaler, which its AcceleratedOptimizer then uses as on a GPU. (Its clip_grad_norm_
    unscales first only with a scaler of its own: runs with this one do not clip.)"""
    accelerator.scaler = torch.amp.GradScaler("cpu")


# ---- Lightning ---------------------------------------------------------------------------------

class GptModule(L.LightningModule):
    """The tiny GPT; its optimizer from ``make_opt`` with a per-step warm-up LambdaLR."""

    def __init__(self, make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer]):
        super().__init__()
        self.model, self.make_opt = tiny_gpt(), make_opt

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> dict:
        opt = self.make_opt(self)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _LightningRecorder(L.Callback):
    def __init__(self, record: Recorder):
        self.record, self.steps = record, 0

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if trainer.global_step > self.steps:              # an optimizer step, not an accumulated micro-batch
            self.steps = trainer.global_step
            self.record(module.model)


def lightning_fit(make_opt, steps: int, batch: int, data: torch.Tensor, devices: int = 1, strategy: Any = "auto",
                  ckpt_path: str | None = None, record: Recorder | None = None,
                  shuffled: bool = False, plugins: list | None = None) -> tuple[GptModule, L.Trainer]:
    """``shuffled``: one process reads the batches in the order Lightning's DistributedSampler
    deals them to K ranks (one permutation, seed 0), so it sees the K ranks' batches together."""
    module = GptModule(make_opt)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps,
                        gradient_clip_val=CLIP, accumulate_grad_batches=ACCUM, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[_LightningRecorder(record)] if record else [], plugins=plugins)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=0) if shuffled else None
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler), ckpt_path=ckpt_path)
    return module, trainer


# ---- Hugging Face Trainer ----------------------------------------------------------------------

class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class _HfRecorder(TrainerCallback):
    def __init__(self, record: Recorder):
        self.record = record

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.record(model)


def hf_train(make_opt, steps: int, batch: int, data: torch.Tensor, out_dir: str, resume: str | None = None,
             save_steps: int | None = None, record: Recorder | None = None,
             prepare: Callable[[Trainer], Any] | None = None, clip: float | None = CLIP,
             ) -> tuple[GPT2LMHeadModel, Trainer]:
    model = tiny_gpt()
    opt = make_opt(model)
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=ACCUM, max_grad_norm=clip or 0.0, lr_scheduler_type="linear",
                             warmup_steps=WARMUP, use_cpu=True, report_to=[], logging_strategy="no",
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(data), optimizers=(opt, None),
                      callbacks=[_HfRecorder(record)] if record else None)
    if prepare:
        prepare(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


# ---- Accelerate --------------------------------------------------------------------------------

def accelerate_train(make_opt, steps: int, batch: int, data: torch.Tensor, save_dir: str | None = None,
                     load_dir: str | None = None, record: Recorder | None = None,
                     prepare: Callable[[Accelerator, torch.optim.Optimizer], Any] | None = None,
                     clip: float | None = CLIP) -> tuple[torch.nn.Module, Any, Accelerator]:
    """``steps`` optimizer steps of ``ACCUM`` micro-batches each, clipped at ``clip``, with a
    per-step LambdaLR; resumes from ``load_dir`` (accelerator.load_state) and saves to ``save_dir``."""
    model = tiny_gpt()
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    # split_batches: K processes share each loader batch, so the scheduler steps once per step
    # (Accelerate steps it K times otherwise) and K ranks equal one process on the same batches
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True,
                              dataloader_config=DataLoaderConfiguration(split_batches=True))
    if prepare:
        prepare(accelerator, opt)
    model, opt, loader, sched = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=batch),
                                                    sched)
    done = 0
    if load_dir:
        accelerator.load_state(load_dir)
        done = sched.scheduler.last_epoch
        loader = accelerator.skip_first_batches(loader, done * ACCUM)
    for x in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=x, labels=x).loss)
            if accelerator.sync_gradients and clip is not None:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            done += 1
            if record:
                record(model)
            if done == steps:
                break
    if save_dir:
        accelerator.save_state(save_dir)
    return model, opt, accelerator
