"""``python -m bench.diloco_state``: the bytes a DiLoCo rank would add to every round if its inner
optimizer's state were kept in the store (the alternative raftps.client.diloco did not choose: a
restarted rank's inner optimizer starts fresh), against the round's pseudo-gradient.

Measured on examples/char_gpt.py's model (torch AdamW, its state after one step, as
``state_dict()`` holds it) and on the trainer's numpy MLP (the store's adam state, m and v)."""
from __future__ import annotations

import os
import sys

import numpy as np


def char_gpt() -> tuple[int, int]:
    """(pseudo-gradient bytes, AdamW state bytes) of the char GPT."""
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from char_gpt import GPT, VOCAB
    torch.manual_seed(0)
    model = GPT(len(VOCAB), 64, 4, 4, 160)       # as examples/char_gpt.py builds it
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))
    model(torch.zeros(1, 64, dtype=torch.long)).sum().backward()
    opt.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in opt.state_dict()["state"].values()
                for v in s.values() if torch.is_tensor(v))
    return params, state


def numpy_mlp() -> tuple[int, int]:
    """(pseudo-gradient bytes, the store's adam state bytes) of the trainer's default MLP."""
    from raftps import optim
    from trainer.data import load_dataset
    from trainer.networks import make_model
    data = load_dataset("digits")
    params = make_model("mlp", data.features, data.classes, (1000, 1000)).init(0)
    spec = optim.normalize({"name": "adam", "lr": 1e-3})
    state = sum(v.nbytes for p in params.values() for v in optim.init_state(spec, p).values()
                if isinstance(v, np.ndarray))
    return sum(p.nbytes for p in params.values()), state


def main() -> None:
    for name, measure in (("char GPT, torch AdamW", char_gpt), ("trainer MLP 1000,1000, store adam", numpy_mlp)):
        grad, state = measure()
        print(f"{name}: pseudo-gradient {grad:,} bytes per rank per round; inner state {state:,} bytes "
              f"({state / grad:.2f}x): keeping it would send {(grad + state) / grad:.2f}x a round's bytes")


if __name__ == "__main__":
    main()
