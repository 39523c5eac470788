"""How far a model and its optimizer are from plain torch's: every parameter, every buffer
(BatchNorm's running statistics and num_batches_tracked) and every optimizer state tensor."""
from __future__ import annotations

import torch


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest absolute difference over the two models' state_dicts (parameters and buffers),
    which must hold the same names."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb), (list(sa), list(sb))
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


def state_diff(got: dict, want: dict) -> float:
    """The largest absolute difference between two torch optimizer state_dicts' per-parameter
    state, which must hold the same parameters and keys (an entry torch keeps as None, SGD's
    momentum_buffer without momentum, counts as absent)."""
    def tensors(sd: dict) -> dict:
        return {(i, k): v for i, entry in sd["state"].items() for k, v in entry.items() if v is not None}
    g, w = tensors(got), tensors(want)
    assert sorted(g) == sorted(w), (sorted(g), sorted(w))
    return max((torch.as_tensor(g[k]).double() - torch.as_tensor(w[k]).double()).abs().max().item()
               for k in w) if w else 0.0
