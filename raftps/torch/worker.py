"""One training worker's link to the store, under ``DistributedOptimizer`` (optimizer.py): the
job's tensors created and resumed, and each mode's pushes and pulls.

- Tensors are named ``PREFIX/<parameter name>``. Every worker creates them from its own
  ``named_parameters()``; the store keeps the first create and treats the others as no-ops, then
  every worker pulls, so all start from one initialisation, or from where a previous run stopped.
- ``sync``: each rank sends the mean gradient of its shard of the global batch with its rank;
  the store applies the mean of the ranks' contributions once (K equal shards: the full batch's
  mean gradient), in the job's own step sequence (``PREFIX/_raftps/group``, under the prefix, so
  a role on the prefix covers it). A rank's second contribution to a step (a restarted worker) is
  ignored. The leader sums a step's contributions and replicates the step once (``push_step``);
  a step whose last rank has not arrived ``step_timeout`` seconds after its first (a dead
  worker) applies with those that did.
- ``async``: DownpourSGD. Push the gradient summed over ``n_push`` steps with the version pulled,
  pull every ``n_fetch`` steps (from any node that has applied our last push); in between the
  replica takes its own SGD steps (Algorithm 7.1 of Dean et al.). ``ssp``: async with n = 1 and
  the SSP gate (``ssp_staleness`` clocks). ``easgd``: the store's tensors are centre variables
  (``elastic``), the worker runs its optimizer locally and every ``n_push`` steps exchanges
  alpha (x - c).
- Async modes count each rank's steps in a tensor of its own (``PREFIX/_raftps/steps.rank<r>``)
  that rides in the same atomic push as the gradients it counts, so ``start_step`` is exactly the
  steps whose gradients the store applied. Sync mode's step is the job's applied step + 1.
- dtypes: float32 and float64 parameters are stored as they are; float16 and bfloat16 ones are
  stored (and updated) in float32 and cast back after each pull, like mixed precision's master
  weights. Other dtypes are refused.
- Buffers (BatchNorm's running statistics): floating buffers are averaged over the workers
  through the store: each worker adds its change since its last pull (divided by the world size
  in async modes; sync steps average it, and their clipping leaves it out: aggregate.py) to a
  tensor with the ``elastic`` rule, and every pull brings the store's value back. Integer buffers (``num_batches_tracked``) stay local.
- Sparse gradients (``nn.Embedding(sparse=True)``) are pushed row-sparse: the store applies the
  optimizer to the touched rows only. Sync mode densifies them (a step averages dense tensors).
- Parameters on a GPU: gradients go to the host through pinned buffers with non-blocking copies
  (one synchronisation per step), pulled values come back the same way.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

import torch

from .. import compress as codecs
from .. import jobs, optim
from ..client import Client, newest
from ..errors import NotInGroup, PermissionDenied, StaleBase, StalenessBound, UnknownTensor
from ..job_steps import CREATOR_WAIT, create_chunked, wait_for_tensors
from ..ssp import SspMember

MODES = ("sync", "async", "ssp", "easgd")
STORED_AS = {torch.float32: np.float32, torch.float64: np.float64,
             torch.float16: np.float32, torch.bfloat16: np.float32}   # half precisions: float32 master copy
ELASTIC = {"name": "elastic"}


@dataclass
class _Slot:
    """One stored tensor and where it lives in the model."""
    store_name: str
    tensor: torch.Tensor           # a parameter or a buffer, updated in place
    dtype: type                    # numpy dtype in the store
    sparse: bool = False           # the weight of an Embedding(sparse=True): pushed and pulled by rows


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _as_numpy(t: torch.Tensor, dtype: type) -> np.ndarray:
    """A host numpy view (no copy for a contiguous CPU tensor already in the store's dtype)."""
    want = torch.float64 if dtype is np.float64 else torch.float32
    return t.detach().to(device="cpu", dtype=want).contiguous().numpy()


class _PinnedStage:
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
        return {name: _as_numpy(t, dtypes[name]) for name, t in staged.items()}

    def load(self, pairs: list[tuple[str, torch.Tensor, np.ndarray]]) -> None:
        waiting = False
        for name, dst, arr in pairs:
            if dst.is_cuda:
                src = _from_numpy(arr)
                buf = self._buffer("in", name, dst, src.dtype)
                buf.copy_(src)
                with torch.no_grad():
                    dst.copy_(buf, non_blocking=True)
                waiting = True
            else:
                _load(dst, arr)
        if waiting:          # the next pull reuses these buffers: the copies out of them must be done
            torch.cuda.synchronize()


def _from_numpy(arr: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)      # a read-only buffer: we only read it
        return torch.from_numpy(arr)


def _load(dst: torch.Tensor, arr: np.ndarray) -> None:
    """Copy a pulled array into a parameter's storage (one copy, cast if dst is half precision)."""
    with torch.no_grad():
        dst.copy_(_from_numpy(arr))


class Worker:
    """One training worker's link to the store: creates and resumes the job's tensors, and per
    mode sends a step's gradients and brings the model up to date; see the module docstring.
    ``DistributedOptimizer`` (optimizer.py) is the torch optimizer users hold; this is its engine.

    ``specs``: id(parameter) -> the store spec its tensor is created with (the parameters trained);
    ``local_step``: the wrapped torch optimizer's own step (easgd runs it on the worker's copy),
    else easgd steps with ``specs``' optimizer in numpy.
    """

    def __init__(self, model: torch.nn.Module, specs: dict[int, dict], cluster: str | Iterable[str] | Client | None = None,
                 mode: str = "async", n_push: int = 1, n_fetch: int = 1,
                 compress: str | None = None, prefix: str = "job",
                 rank: int | None = None, world_size: int | None = None, ssp_staleness: int | None = 2,
                 easgd_alpha: float | None = None, step_timeout: float = 10.0, ssp_timeout: float = 10.0,
                 token: str | None = None, timeout: float = 60.0, local_step: Any = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        for what, n in (("n_push", n_push), ("n_fetch", n_fetch)):
            if type(n) is not int or n < 1:
                raise ValueError(f"{what} must be an int >= 1, got {n!r}")
        self.world_size = world_size if world_size is not None else (_env_int("WORLD_SIZE") or 1)
        self.rank = rank if rank is not None else (_env_int("RANK") or 0)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        self.mode, self.prefix = mode, prefix
        self.n_push, self.n_fetch = (1, 1) if mode in ("sync", "ssp") else (n_push, n_fetch)
        self.step_timeout = step_timeout
        self.compress_method, fraction = codecs.parse(compress or "none")
        if self.compress_method != "none" and mode == "sync":
            raise ValueError("compress works in the async modes; a sync step averages dense contributions")
        self._topk = codecs.TopK(fraction) if self.compress_method == "topk" else None
        self.local_step = local_step
        self.easgd_alpha = easgd_alpha if easgd_alpha is not None else 0.9 / self.world_size

        sparse = {id(m.weight) for m in model.modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
        self.params = self._slots(((n, p) for n, p in model.named_parameters() if id(p) in specs), "parameter",
                                  trainable=True, sparse=sparse)
        # store name -> the spec its tensor is created with (easgd: the worker's own, the store's is elastic)
        self.specs = {s.store_name: specs[id(s.tensor)] for s in self.params}
        self.buffers = self._slots(((n, b) for n, b in model.named_buffers() if b.is_floating_point()), "buffer")
        self.job = jobs.group(prefix)             # the job's step sequence, and its SSP group

        self._stage = _PinnedStage()
        self._dtypes = {s.store_name: s.dtype for s in self.params}
        self._owns_client = not isinstance(cluster, Client)
        self.client = cluster if isinstance(cluster, Client) else Client(cluster, timeout=timeout, token=token)
        # Async modes: this rank's step counter in each Raft group holding the job's tensors
        # (Raft group -> name); the steps a group applied beyond the others before a crash.
        self.counters: dict[int, str] = {}
        self._ahead: dict[int, int] = {}
        try:
            if mode != "sync":
                groups = self.client.groups()
                held = sorted({self.client.group_of(s.store_name) for s in self.params + self.buffers})
                self.counters = {g: jobs.step_counter(prefix, self.rank, g, groups) for g in held}
            try:
                self._create()
            except PermissionDenied as refused:   # a `read` identity, or a prefix outside its grants
                self._create_refused = refused
            self.ssp = (SspMember(self.client, self.job, f"rank{self.rank}", ssp_staleness, ssp_timeout)
                        if mode == "ssp" else None)
            self.start_step = self._resume()
        except BaseException:
            self.close()
            raise
        self.step_count = self.start_step      # steps taken, counting those of earlier runs
        self._pending: dict[str, torch.Tensor] = {}
        self._touched: dict[str, torch.Tensor] = {}     # sparse table -> rows in the last push
        self._since_push = self._since_fetch = 0
        self._easgd_state = {s.store_name: optim.init_state(self.specs[s.store_name], _as_numpy(s.tensor, s.dtype))
                             for s in self.params} if mode == "easgd" and local_step is None else {}
        self._hyper: dict[str, dict] = {}          # this step's hyperparameters (tensor -> values)
        self._lrs: dict[str, float] = {}           # this step's lr per tensor (Downpour's own steps)
        self._clip_norm: float | None = None       # sync: the store clips this step's mean gradient
        self.last_grad_norm: float | None = None   # sync with clipping: the mean gradient's norm
        self.timings = {"push": [0, 0.0], "pull": [0, 0.0]}    # what -> [calls, seconds]

    # ---- setup ------------------------------------------------------------------------------

    def _slots(self, named: Iterable[tuple[str, torch.Tensor]], what: str, trainable: bool = False,
               sparse: set[int] = frozenset()) -> list[_Slot]:
        out = []
        for name, t in named:
            if trainable and not t.requires_grad:
                continue
            if t.dtype not in STORED_AS:
                raise TypeError(f"{what} {name!r} has dtype {t.dtype}: raftps stores float32/float64 "
                                "(float16 and bfloat16 are kept in float32)")
            out.append(_Slot(jobs.tensor(self.prefix, name), t, STORED_AS[t.dtype], id(t) in sparse))
        if trainable and not out:
            raise ValueError("the model has no trainable parameters")
        return out

    def _create(self) -> None:
        """Rank 0 creates the job's tensors (a no-op for those that exist: the first creator's
        values win); every rank creates its own step counters, and the others wait until rank 0's
        tensors exist (TimeoutError naming the job after job_steps.CREATOR_WAIT s). Every rank
        sending the whole model in a create of its own put K models' bytes on the store's link:
        on a 20 Mbit/s link no create was answered in 60 s."""
        shared = {s.store_name: (_as_numpy(s.tensor, s.dtype), ELASTIC if self.mode == "easgd" else self.specs[s.store_name])
                  for s in self.params}
        shared.update({s.store_name: (_as_numpy(s.tensor, s.dtype), ELASTIC) for s in self.buffers})
        own = {counter: (np.zeros(1, np.float64), ELASTIC) for counter in self.counters.values()}
        create_chunked(self.client, {**shared, **own} if self.rank == 0 else own)
        if self.rank != 0:
            wait_for_tensors(self.client, list(shared), CREATOR_WAIT, self.prefix)

    def _resume(self) -> int:
        """Load the store's parameters; return the step to start at."""
        names = [s.store_name for s in self.params + self.buffers] + list(self.counters.values())
        refused = getattr(self, "_create_refused", None)
        try:
            result = self.client.pull_result(names)             # linearizable: the newest state
        except UnknownTensor as exc:
            if refused is None:
                raise
            raise PermissionDenied(f"{exc}: this identity may not create the job's tensors ({refused}); "
                                   f"a first run needs write on {self.prefix + '/'!r}") from None
        except PermissionDenied as exc:
            raise (refused or exc) from None                 # the create's refusal says more
        self._install(result["tensors"], result["version"])
        if self.mode == "sync":
            return self.client.sync_applied(self.job) + 1
        # A crash between the groups' parts of one push leaves some groups a push ahead: start
        # where every group is, and leave the groups ahead out of pushes until the others catch up.
        applied = {g: int(result["tensors"][name][0]) for g, name in self.counters.items()}
        start = min(applied.values())
        self._ahead = {g: n - start for g, n in applied.items() if n > start}
        return start

    def _pulled_names(self) -> list[str]:
        """What a pull brings: all but sparse tables, which async modes pull by rows."""
        return [s.store_name for s in self.params + self.buffers if not s.sparse or self.mode in ("sync", "easgd")]

    def _install(self, tensors: dict[str, np.ndarray], version: int) -> None:
        self._stage.load([(s.store_name, s.tensor, tensors[s.store_name])
                          for s in self.params + self.buffers if s.store_name in tensors])
        # What the store held at this version: a buffer's change since then is this worker's.
        self._buffer_base = {s.store_name: np.array(tensors[s.store_name]) for s in self.buffers}
        self.version = self.pushed = version

    # ---- the optimizer API ------------------------------------------------------------------

    @torch.no_grad()
    def step(self, hyper: dict[str, dict] | None = None, lrs: dict[str, float] | None = None,
             clip_norm: float | None = None) -> int:
        """Send this step's gradients (per the mode) and bring the replica up to date; returns
        the store version the replica now holds (or last pushed to, between pulls).
        ``hyper``: tensor -> this step's hyperparameters (those that differ from its stored spec);
        ``lrs``: tensor -> this step's lr (Downpour's own steps); ``clip_norm``: sync mode's
        store-side clipping of the step's mean gradient."""
        self._hyper, self._lrs, self._clip_norm = hyper or {}, lrs or {}, clip_norm
        {"sync": self._step_sync, "easgd": self._step_easgd}.get(self.mode, self._step_async)()
        self.step_count += 1
        return self.version

    @torch.no_grad()
    def pull_rows(self, param: torch.Tensor, rows: Any) -> int:
        """Bring rows ``rows`` of a sparse embedding's weight up to date from the store (e.g. the
        rows the next batch looks up); returns the store version they are at."""
        slot = next((s for s in self.params if s.tensor is param), None)
        if slot is None:
            raise ValueError("pull_rows: not a parameter of this optimizer's model")
        return self._pull_rows(slot, torch.as_tensor(rows).reshape(-1).unique())

    def _pull_rows(self, slot: _Slot, rows: torch.Tensor) -> int:
        values, version = self.client.pull_rows(slot.store_name, rows.cpu().numpy(), min_version=self.pushed,
                                                linearizable=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)      # a read-only buffer: we only read it
            src = torch.from_numpy(values)
        # rows and values onto the parameter's device (a GPU table takes no host tensor)
        slot.tensor.index_copy_(0, rows.to(slot.tensor.device), src.to(slot.tensor.device, slot.tensor.dtype))
        return version

    @torch.no_grad()
    def flush(self) -> None:
        """Push the gradients of steps not pushed yet (async with n_push > 1); close() does."""
        if self.mode in ("async", "ssp") and self._pending:
            self._push_pending()

    def close(self) -> None:
        """Flush, leave the SSP group, close the client (if this optimizer made it)."""
        if getattr(self, "_pending", None):
            self.flush()
        if getattr(self, "ssp", None) is not None:
            try:
                self.ssp.leave()          # a finished worker must not hold the others back
            finally:
                self.ssp = None
        if self._owns_client:
            self.client.close()

    # ---- modes ------------------------------------------------------------------------------

    def _step_sync(self) -> None:
        grads = self._stage.to_host({s.store_name: self._dense_grad(s) for s in self.params}, self._dtypes)
        grads.update(self._buffer_drift(1))
        step = self.step_count
        t0 = time.perf_counter()
        # answered once the step is applied; a rank that died is left out step_timeout seconds
        # after the step's first contribution
        result = self.client.push_step(grads, step, self.world_size, job=self.job, rank=self.rank,
                                       timeout=self.step_timeout, pull=True, hyper=self._hyper or None,
                                       clip_norm=self._clip_norm)
        self._timed("push", t0)
        self.last_grad_norm = result.get("grad_norm")
        if result.get("late"):     # the step was applied without us (we were away): rejoin at the job's step
            self.step_count = max(self.step_count, self.client.sync_applied(self.job))
        tensors = result.get("tensors") or {}
        if set(self._pulled_names()) <= set(tensors):     # the step's values came with the answer
            self._install(tensors, result["version"])
        else:
            self._pull(result["version"])

    def _step_async(self) -> None:
        for s in self.params:
            g = s.tensor.grad
            if g is None:
                continue
            prev = self._pending.get(s.store_name)
            if prev is not None:
                self._pending[s.store_name] = prev + g
            else:   # kept past this step() only when n_push > 1: then zero_grad() must not clear it
                self._pending[s.store_name] = g.detach().clone() if self.n_push > 1 else g.detach()
            if self.n_fetch > 1:               # Downpour: the replica takes its own step meanwhile
                s.tensor.add_(g.to(s.tensor.dtype), alpha=-self._lrs.get(s.store_name, self.specs[s.store_name]["lr"]))
        self._since_push += 1
        self._since_fetch += 1
        if self._since_push >= self.n_push:
            self._push_pending()
        if self._since_fetch >= self.n_fetch:
            if self.ssp is not None:          # the next step waits until it is at most s clocks ahead
                self.pushed = newest(self.pushed, self.ssp.wait_turn())
            self._pull(self.pushed)

    def _step_easgd(self) -> None:
        if self.local_step is not None:           # the wrapped torch optimizer, on this worker's copy
            with torch.enable_grad():
                self.local_step()
        for s in self.params if self.local_step is None else ():     # the spec's optimizer, in numpy
            if s.tensor.grad is None:
                continue
            x = _as_numpy(s.tensor, s.dtype)
            spec = optim.with_hyperparameters(self.specs[s.store_name], self._hyper.get(s.store_name), s.store_name)
            new, self._easgd_state[s.store_name] = optim.step(
                spec, x, _as_numpy(self._dense_grad(s), s.dtype), self._easgd_state[s.store_name])
            _load(s.tensor, new)
        self._since_push += 1
        if self._since_push < self.n_push:
            return
        centre, self.version = self.client.pull([s.store_name for s in self.params], min_version=self.pushed,
                                                linearizable=False)
        delta = {}
        for s in self.params:
            x = _as_numpy(s.tensor, s.dtype)
            delta[s.store_name] = (x - centre[s.store_name]) * x.dtype.type(self.easgd_alpha)
            _load(s.tensor, x - delta[s.store_name])
        self._send(delta, encoding=None, steps=self._since_push)

    # ---- pushes and pulls ---------------------------------------------------------------------

    def _dense_grad(self, s: _Slot) -> torch.Tensor:
        g = s.tensor.grad
        if g is None:
            return torch.zeros_like(s.tensor)
        return g.to_dense() if g.is_sparse else g

    def _push_pending(self) -> None:
        dense = self._stage.to_host({k: g for k, g in self._pending.items() if not g.is_sparse}, self._dtypes)
        grads, encoding = codecs.encode_push(dense, self.compress_method, self._topk)
        grads, encoding = dict(grads), dict(encoding or {})
        for name, g in self._pending.items():
            if g.is_sparse:                        # row indices + rows; the store updates those rows only
                g = g.coalesce()
                rows = g.indices()[0].cpu()          # numpy reads host memory only (a GPU table's too)
                self._touched[name] = rows
                parts, enc = codecs.encode_rows(name, rows.numpy(),
                                                _as_numpy(g.values(), self._dtypes[name]))
                grads.update(parts)
                encoding.update(enc)
        grads.update(self._buffer_drift(self.world_size))
        self._pending = {}
        self._send(grads, encoding or None, steps=self._since_push)

    def _send(self, grads: dict[str, np.ndarray], encoding: dict | None, steps: int) -> None:
        """One push, atomic in each Raft group: gradients, buffer drift and, per group, the count
        of the steps they carry. A group that applied these steps before a crash is left out."""
        for g, counter in self.counters.items():
            grads[counter] = np.array([float(steps)])
        for g in [g for g, n in self._ahead.items() if n >= steps]:
            self._ahead[g] -= steps
            grads = {k: v for k, v in grads.items() if self.client.group_of(k) != g}
            if encoding:
                encoding = {k: v for k, v in encoding.items() if self.client.group_of(k) != g} or None
        if not grads:
            self._since_push = 0
            return
        hyper = {k: v for k, v in self._hyper.items() if k in grads} if self.mode != "easgd" else {}
        t0 = time.perf_counter()
        while True:
            try:
                self.pushed = self.client.push(grads, base_version=self.version, encoding=encoding,
                                               ssp=self.ssp.field() if self.ssp else None, hyper=hyper or None)
                break
            except StalenessBound:        # too far ahead after all: wait for the slowest, send again
                self.ssp.wait_turn()
            except NotInGroup:            # dropped as dead while away: join again, send again
                self.ssp.join()
            except StaleBase:             # AdaRevision no longer holds our base: drop it, re-pull
                self._pull(self.pushed)
                break
        self._timed("push", t0)
        self._since_push = 0

    def _pull(self, min_version: int) -> None:
        t0 = time.perf_counter()
        tensors, version = self.client.pull(self._pulled_names(), min_version=min_version, linearizable=False)
        self._install(tensors, version)
        for s in self.params:       # sparse tables: the rows this worker just pushed (others' updates too)
            rows = self._touched.pop(s.store_name, None)
            if rows is not None and s.sparse and self.mode not in ("sync", "easgd"):
                self._pull_rows(s, rows)
        self._timed("pull", t0)
        self._since_fetch = 0

    def _buffer_drift(self, divide: int) -> dict[str, np.ndarray]:
        out = {}
        for s in self.buffers:
            now = _as_numpy(s.tensor, s.dtype)
            drift = now - self._buffer_base[s.store_name]
            out[s.store_name] = drift / drift.dtype.type(divide) if divide > 1 else drift
        return out

    def _timed(self, what: str, t0: float) -> None:
        self.timings[what][0] += 1
        self.timings[what][1] += time.perf_counter() - t0
