"""Tensors between torch and the store's numpy arrays: the dtypes the store keeps, host copies,
and pinned staging for tensors on a GPU. Both torch workers (worker.py, diloco.py) move their
tensors through here; what the store does with them is the engines' (raftps/modes/, raftps/client/diloco.py)."""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch

STORED_AS = {torch.float32: np.float32, torch.float64: np.float64,
             torch.float16: np.float32, torch.bfloat16: np.float32}   # half precisions: float32 master copy


def env_int(name: str) -> int | None:
    """An integer environment variable (torchrun's RANK, WORLD_SIZE), None when unset or empty."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def as_numpy(t: torch.Tensor, dtype: type) -> np.ndarray:
    """A host numpy view (no copy for a contiguous CPU tensor already in the store's dtype)."""
    want = torch.float64 if dtype is np.float64 else torch.float32
    return t.detach().to(device="cpu", dtype=want).contiguous().numpy()


def from_numpy(arr: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)      # a read-only buffer: we only read it
        return torch.from_numpy(arr)


def load(dst: torch.Tensor, arr: np.ndarray) -> None:
    """Copy a pulled array into a parameter's storage (one copy, cast if dst is half precision)."""
    with torch.no_grad():
        dst.copy_(from_numpy(arr))


class PinnedStage:
    """Pinned host buffers for tensors on a GPU, one per tensor name, reused every step: device
    to host copies of a step's gradients all start before one synchronisation, and pulled values
    go back by non-blocking copies, again with one synchronisation (pageable memory would make
    every copy wait on its own). CPU tensors pass straight through."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def _buffer(self, kind: str, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get((kind, name))
        if buf is None or buf.shape != like.shape or buf.dtype != dtype:
            buf = self._buffers[(kind, name)] = torch.empty(like.shape, dtype=dtype, pin_memory=True)
        return buf

    def to_host(self, named: dict[str, torch.Tensor], dtypes: dict[str, type]) -> dict[str, np.ndarray]:
        staged, waiting = {}, False
        for name, t in named.items():
            if t.is_cuda:
                buf = self._buffer("out", name, t, torch.float64 if dtypes[name] is np.float64 else torch.float32)
                buf.copy_(t.detach(), non_blocking=True)
                staged[name], waiting = buf, True
            else:
                staged[name] = t
        if waiting:
            torch.cuda.synchronize()
        return {name: as_numpy(t, dtypes[name]) for name, t in staged.items()}

    def load(self, pairs: list[tuple[str, torch.Tensor, np.ndarray]]) -> None:
        waiting = False
        for name, dst, arr in pairs:
            if dst.is_cuda:
                src = from_numpy(arr)
                buf = self._buffer("in", name, dst, src.dtype)
                buf.copy_(src)
                with torch.no_grad():
                    dst.copy_(buf, non_blocking=True)
                waiting = True
            else:
                load(dst, arr)
        if waiting:          # the next pull reuses these buffers: the copies out of them must be done
            torch.cuda.synchronize()
