"""Sync's ``overlap=True``: a step's chunks sent while backward still runs, as DDP's buckets
(docs/pytorch.md, "Overlap with backward").

Every trained parameter gets a ``register_post_accumulate_grad_hook``: its gradient is final
for this step once it fires. The step's chunks (raftps/client/step_stream.py) are planned over
the parameters in the reverse of their order in the model (the order backward makes their
gradients, DDP's bucket order), then the floating buffers in chunks of their own; a chunk whose
parameters' hooks have all fired goes to the store at once. ``finish`` (the optimizer's step)
sends the rest: chunks with parameters that got no gradient (zeros, as without overlap) and the
buffers' drift, and waits for every answer.

What overlap cannot see is checked on the first step of each process, before anything is sent:
that step's hooks only note which gradients were made (and keep a copy), and ``finish``
refuses the step if one changed after its hook (torch's ``clip_grad_norm_``, a GradScaler's
``unscale_``) or a GradScaler steps the optimizer, changing nothing; from the second step on
the hooks send. ``no_sync()`` suppresses the hooks for micro-batches that do not end a step; a
gradient made twice in one step outside it is refused.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch

from raftps.client.step_stream import StepStream


class OverlapError(RuntimeError):
    """Something overlap cannot do (it sends gradients before optimizer.step())."""


class Overlap:
    """The hooks and the per-step state of one worker's overlapped steps. ``to_host(named)``:
    the worker's gradients to numpy (its pinned stage); ``dense(slot)``: a slot's gradient, dense
    (zeros where it has none); ``hyper()``: this step's hyperparameters as the optimizer reads them."""

    def __init__(self, slots: list[Any], stream: StepStream, to_host: Callable[[dict], dict[str, np.ndarray]],
                 dense: Callable[[Any], torch.Tensor], hyper: Callable[[], dict]):
        self.slots, self.stream, self._to_host, self._dense = slots, stream, to_host, dense
        self.hyper = hyper
        index = {s.store_name: i for i, s in enumerate(slots)}
        self._chunk_params = [[index[n] for n in c.names if n in index] for c in stream.plan]
        self._chunk_of = {p: ci for ci, params in enumerate(self._chunk_params) for p in params}
        self._lock = threading.Lock()
        self._suppressed = 0          # no_sync() depth
        self.armed = False            # the first step checked: the hooks send from now on
        self._reset()
        self._handles = [s.tensor.register_post_accumulate_grad_hook(self._hook(i)) for i, s in enumerate(slots)]

    def _reset(self) -> None:
        self._fired: set[int] = set()
        self._waiting = [len(params) for params in self._chunk_params]   # per chunk: hooks still to fire
        self._sent: set[int] = set()
        self._copies: dict[int, torch.Tensor] = {}      # the first step: each gradient as its hook saw it
        self._hyper: dict | None = None                  # read when the step's first gradient was made

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self._lock:
            self._suppressed += 1
        try:
            yield
        finally:
            with self._lock:
                self._suppressed -= 1

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            with self._lock:
                if self._suppressed:
                    return
                if i in self._fired:
                    raise OverlapError(
                        f"parameter {self.slots[i].store_name!r}: its gradient was made twice in one step outside "
                        "no_sync() (overlap=True sends it when it is made): run every micro-batch but a step's last "
                        "inside `with opt.no_sync():`, or call opt.step() after each backward")
                self._fired.add(i)
                if not self.armed:
                    self._copies[i] = param.grad.detach().clone()
                    return
                if self._hyper is None:
                    self._begin()
                c = self._chunk_of[i]
                self._waiting[c] -= 1
                if self._waiting[c] == 0:
                    self._send(c, {})
        return hook

    def _begin(self) -> None:
        self._hyper = self.hyper()
        self.stream.begin(self.step, self._hyper)

    def _send(self, c: int, buffers: dict[str, np.ndarray]) -> None:
        params = {self.slots[p].store_name: self._dense(self.slots[p]) for p in self._chunk_params[c]}
        self._sent.add(c)
        self.stream.ready(c, {**self._to_host(params), **buffers})

    def finish(self, step: int, buffers: dict[str, np.ndarray], under_scaler: bool) -> tuple[dict, dict]:
        """The rest of step ``step`` sent (``buffers``: the buffers' drift), and its reply; with
        the hyperparameters it was sent with. Raises OverlapError, before sending anything on the
        first step, for what overlap cannot do."""
        with self._lock:
            try:
                if under_scaler:
                    raise OverlapError("a GradScaler steps this optimizer: its gradients are scaled, and final only "
                                       "after its check for infs, but overlap=True sends them as backward makes them; "
                                       "use a GradScaler without overlap")
                if not self.armed:
                    self._check_first_step()
            except OverlapError:
                self._reset()
                raise
            self.step = step
            if self._hyper is None:                 # nothing sent yet (the first step, or no gradient made)
                self._begin()
            for c in range(len(self.stream.plan)):
                if c not in self._sent:
                    self._send(c, {n: buffers[n] for n in self.stream.plan[c].names if n in buffers})
            hyper = self._hyper
            try:
                reply = self.stream.finish()
            finally:
                self._reset()
                self.armed = True
        return reply, hyper

    def _check_first_step(self) -> None:
        for i, copy in self._copies.items():
            grad = self.slots[i].tensor.grad
            same = grad is not None and grad.shape == copy.shape and grad.is_sparse == copy.is_sparse and \
                torch.equal(grad.to_dense() if grad.is_sparse else grad, copy.to_dense() if copy.is_sparse else copy)
            if not same:
                raise OverlapError(
                    f"parameter {self.slots[i].store_name!r}: its gradient changed between backward and "
                    "optimizer.step() (torch.nn.utils.clip_grad_norm_, a GradScaler's unscale_, ...); "
                    "overlap=True sends gradients as backward makes them: train without overlap to change them")

    step = 0        # the step the next hooks contribute to (the worker sets it)
