"""One training worker's link to the store, under ``DistributedOptimizer`` (optimizer.py): the
job's tensors created and resumed, and each step's tensors moved in and out of the mode's engine
(raftps/modes/: ``SyncSteps`` for sync, ``Downpour`` for async and ssp, ``Easgd``; their module
docstrings say what each mode does, for this worker and the numpy trainer alike).

- Tensors are named ``PREFIX/<parameter name>``. Every worker creates them from its own
  ``named_parameters()``; the store keeps the first create and treats the others as no-ops, then
  every worker pulls, so all start from one initialisation, or from where a previous run stopped.
- ``sync``: the job's own step sequence is ``jobs.job_name(PREFIX)`` (``PREFIX/_raftps/group``,
  under the prefix, so a role on the prefix covers it). ``ssp``: the same name is the SSP group's.
  ``easgd``: the store's tensors are centre variables (``elastic``); the worker runs its
  optimizer locally (the wrapped torch optimizer, or the spec's in numpy).
- Async modes count each rank's steps in a tensor of its own (``PREFIX/_raftps/steps.rank<r>``)
  that rides in the same atomic push as the gradients it counts, so ``start_step`` is exactly the
  steps whose gradients the store applied (modes/link.py). Sync mode's step is the job's applied step + 1.
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
  (one synchronisation per step), pulled values come back the same way (host.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

import torch

from raftps import compress as codecs
from raftps import jobs
from raftps.client.client import Client
from raftps.errors import PermissionDenied, UnknownTensor
from raftps.client.job_steps import CREATOR_WAIT, create_chunked, wait_for_tensors
from raftps.modes import DROPPED, Downpour, Easgd, StoreLink, SyncSteps, step_counters
from raftps.client.ssp import SspMember
from raftps.torch.host import STORED_AS, PinnedStage, env_int, from_numpy, load
from raftps.torch.overlap import Overlap, OverlapError
from raftps.torch.host import as_numpy as _as_numpy      # the name _create reads

MODES = ("sync", "async", "ssp", "easgd")
ELASTIC = {"name": "elastic"}


@dataclass
class _Slot:
    """One stored tensor and where it lives in the model."""
    store_name: str
    tensor: torch.Tensor           # a parameter or a buffer, updated in place
    dtype: type                    # numpy dtype in the store
    sparse: bool = False           # the weight of an Embedding(sparse=True): pushed and pulled by rows


class Worker:
    """One training worker's link to the store: creates and resumes the job's tensors, and per
    mode moves a step's gradients into the mode's engine and the store's values back into the
    model; see the module docstring. ``DistributedOptimizer`` (optimizer.py) is the torch
    optimizer users hold; this is its engine's door.

    ``specs``: id(parameter) -> the store spec its tensor is created with (the parameters trained);
    ``local_step``: the wrapped torch optimizer's own step (easgd runs it on the worker's copy),
    else easgd steps with ``specs``' optimizer in numpy.
    """

    def __init__(self, model: torch.nn.Module, specs: dict[int, dict], cluster: str | Iterable[str] | Client | None = None,
                 mode: str = "async", n_push: int = 1, n_fetch: int = 1,
                 compress: str | None = None, prefix: str = "job",
                 rank: int | None = None, world_size: int | None = None, ssp_staleness: int | None = 2,
                 easgd_alpha: float | None = None, step_timeout: float = 10.0, ssp_timeout: float = 10.0,
                 token: str | None = None, timeout: float = 60.0, local_step: Any = None, chunk_bytes: int = 0,
                 pairs: bool = False, overlap: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        for what, n in (("n_push", n_push), ("n_fetch", n_fetch)):
            if type(n) is not int or n < 1:
                raise ValueError(f"{what} must be an int >= 1, got {n!r}")
        self.world_size = world_size if world_size is not None else (env_int("WORLD_SIZE") or 1)
        self.rank = rank if rank is not None else (env_int("RANK") or 0)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        self.mode, self.prefix = mode, prefix
        self.n_push, self.n_fetch = (1, 1) if mode in ("sync", "ssp") else (n_push, n_fetch)
        self.step_timeout = step_timeout
        self.chunk_bytes = chunk_bytes      # sync: push_step's chunk_bytes (a step streamed in chunks)
        self.pairs = pairs                  # sync: push_step's pairs (ranks 2i, 2i + 1 add up half the chunks each)
        if pairs and not (mode == "sync" and chunk_bytes > 0):
            raise ValueError(f"pairs=True works in mode 'sync' with chunk_bytes > 0 (the pair splits a step by its "
                             f"chunks); got mode={mode!r}, chunk_bytes={chunk_bytes}")
        if overlap and not (mode == "sync" and chunk_bytes > 0):
            raise ValueError(f"overlap=True works in mode 'sync' with chunk_bytes > 0 (each chunk leaves when backward "
                             f"has made its gradients); got mode={mode!r}, chunk_bytes={chunk_bytes}")
        self.overlap: Overlap | None = None     # sync overlap=True: the hooks (made once the job's plan is known)
        if codecs.parse(compress or "none")[0] != "none" and mode == "sync":
            raise ValueError("compress works in the async modes; a sync step averages dense contributions")
        self.local_step = local_step
        self.easgd_alpha = easgd_alpha if easgd_alpha is not None else 0.9 / self.world_size

        sparse = {id(m.weight) for m in model.modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
        self.params = self._slots(((n, p) for n, p in model.named_parameters() if id(p) in specs), "parameter",
                                  trainable=True, sparse=sparse)
        # store name -> the spec its tensor is created with (easgd: the worker's own, the store's is elastic)
        self.specs = {s.store_name: specs[id(s.tensor)] for s in self.params}
        self.buffers = self._slots(((n, b) for n, b in model.named_buffers() if b.is_floating_point()), "buffer")
        self.job = jobs.job_name(prefix)          # the job's step sequence, and its SSP group
        self.skip_flags: list[str] = []            # sync: jobs.skip_flag per Raft group of the job's tensors

        self._stage = PinnedStage()
        self._dtypes = {s.store_name: s.dtype for s in self.params}
        self._owns_client = not isinstance(cluster, Client)
        self.client = cluster if isinstance(cluster, Client) else Client(cluster, timeout=timeout, token=token)
        # Async modes: this rank's step counter in each Raft group holding the job's tensors
        self.counters: dict[int, str] = {}
        self.link: StoreLink | None = None
        self.engine: SyncSteps | Downpour | Easgd | None = None
        try:
            stored = [s.store_name for s in self.params + self.buffers]
            if mode != "sync":
                self.counters = step_counters(self.client, prefix, self.rank, stored)
            elif self.world_size > 1:        # one rank keeps torch's own skip (optimizer.py)
                groups = self.client.groups()
                self.skip_flags = [jobs.skip_flag(prefix, g, groups) for g in sorted({self.client.group_of(n) for n in stored})]
            try:
                self._create()
            except PermissionDenied as refused:   # a `read` identity, or a prefix outside its grants
                self._create_refused = refused
            ssp = SspMember(self.client, self.job, f"rank{self.rank}", ssp_staleness, ssp_timeout) \
                if mode == "ssp" else None
            self.link = StoreLink(self.client, ssp, counters=self.counters)
            self.engine = self._engine(compress, overlap)
            self.start_step = self._resume()
            if overlap:
                self.overlap = Overlap(self.params, self.engine.stream,
                                       lambda named: self._stage.to_host(named, self._dtypes), self._dense_grad,
                                       lambda: self.hyper_source())
                self.overlap.step = self.start_step
        except BaseException:
            self.close()
            raise
        self.step_count = self.start_step      # steps taken, counting those of earlier runs
        self._touched: dict[str, torch.Tensor] = {}     # sparse table -> rows in the last push
        self._hyper: dict[str, dict] = {}          # this step's hyperparameters (tensor -> values)
        self._lrs: dict[str, float] = {}           # this step's lr per tensor (Downpour's own steps)
        self._clip_norm: float | None = None       # sync: the store clips this step's mean gradient
        self.last_grad_norm: float | None = None   # sync with clipping: the mean gradient's norm
        self.last_step_skipped = False             # sync: a rank skipped the last step (no gradient applied)
        self._skip, self._grad_scale = False, None  # sync under a GradScaler: this step's (step())

    version = property(lambda self: self.link.version, doc="the store version the model holds")
    pushed = property(lambda self: self.link.pushed, doc="the newest version this worker's writes reached")
    timings = property(lambda self: self.link.timings, doc="'push'/'pull' -> [calls, seconds]")

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
        shared.update({flag: (np.zeros(1, np.float32), ELASTIC) for flag in self.skip_flags})
        own = {counter: (np.zeros(1, np.float64), ELASTIC) for counter in self.counters.values()}
        create_chunked(self.client, {**shared, **own} if self.rank == 0 else own)
        if self.rank != 0:
            wait_for_tensors(self.client, list(shared), CREATOR_WAIT, self.prefix)

    def _resume(self) -> int:
        """Load the store's parameters; return the step to start at."""
        names = [s.store_name for s in self.params + self.buffers]
        refused = getattr(self, "_create_refused", None)
        try:
            tensors, start = self.engine.resume(names)        # linearizable: the newest state
        except UnknownTensor as exc:
            if refused is None:
                raise
            raise PermissionDenied(f"{exc}: this identity may not create the job's tensors ({refused}); "
                                   f"a first run needs write on {self.prefix + '/'!r}") from None
        except PermissionDenied as exc:
            raise (refused or exc) from None                 # the create's refusal says more
        self._install(tensors)
        return start

    def _pulled_names(self) -> list[str]:
        """What a pull brings: all but sparse tables, which async modes pull by rows."""
        return [s.store_name for s in self.params + self.buffers if not s.sparse or self.mode in ("sync", "easgd")]

    def _install(self, tensors: dict[str, np.ndarray]) -> None:
        self._stage.load([(s.store_name, s.tensor, tensors[s.store_name])
                          for s in self.params + self.buffers if s.store_name in tensors])
        # What the store held at this version: a buffer's change since then is this worker's.
        self._buffer_base = {s.store_name: np.array(tensors[s.store_name]) for s in self.buffers}

    def _engine(self, compress: str | None, overlap: bool = False) -> SyncSteps | Downpour | Easgd:
        if self.mode == "sync":
            # overlap: chunks in the order backward makes the gradients (the model's, reversed), then the buffers
            runs = [[s.store_name for s in reversed(self.params)], [s.store_name for s in self.buffers]] \
                if overlap else None
            return SyncSteps(self.link, self.job, self.world_size, self.rank, self.step_timeout, self.skip_flags,
                             self.chunk_bytes, self.pairs, runs)
        if self.mode == "easgd":      # the spec's optimizer in numpy, unless torch's own runs locally
            return Easgd(self.link, self.easgd_alpha, self.n_push, self.specs if self.local_step is None else None)
        return Downpour(self.link, self.n_push, self.n_fetch, compress)

    # ---- the optimizer API ------------------------------------------------------------------

    @torch.no_grad()
    def step(self, hyper: dict[str, dict] | None = None, lrs: dict[str, float] | None = None,
             clip_norm: float | None = None, skip: bool = False, grad_scale: torch.Tensor | None = None,
             under_scaler: bool = False) -> int:
        """Send this step's gradients (per the mode) and bring the replica up to date; returns
        the store version the replica now holds (or last pushed to, between pulls).
        ``hyper``: tensor -> this step's hyperparameters (those that differ from its stored spec);
        ``lrs``: tensor -> this step's lr (Downpour's own steps); ``clip_norm``: sync mode's
        store-side clipping of the step's mean gradient. Sync mode, under a GradScaler (optimizer.py):
        ``skip``: this rank's gradient holds an inf (the step is skipped on every rank);
        ``grad_scale``: the scale the gradients still carry (they are unscaled before sending);
        ``under_scaler``: a GradScaler steps the optimizer (overlap=True refuses it)."""
        self._hyper, self._lrs, self._clip_norm = hyper or {}, lrs or {}, clip_norm
        self._skip, self._grad_scale, self._under_scaler = skip, grad_scale, under_scaler
        self._after_step: Exception | None = None
        {"sync": self._step_sync, "easgd": self._step_easgd}.get(self.mode, self._step_async)()
        self.step_count += 1
        if self.overlap is not None:
            self.overlap.step = self.step_count
        if self._after_step is not None:
            raise self._after_step
        return self.version

    # sync overlap=True: this step's hyperparameters ({tensor: changed values}), read when backward
    # makes the step's first gradient (the optimizer sets it to its own reading)
    hyper_source: Any = staticmethod(lambda: {})

    @torch.no_grad()
    def pull_rows(self, param: torch.Tensor, rows: Any) -> int:
        """Bring rows ``rows`` of a sparse embedding's weight up to date from the store (e.g. the
        rows the next batch looks up); returns the store version they are at."""
        slot = next((s for s in self.params if s.tensor is param), None)
        if slot is None:
            raise ValueError("pull_rows: not a parameter of this optimizer's model")
        return self._pull_rows(slot, torch.as_tensor(rows).reshape(-1).unique())

    def _pull_rows(self, slot: _Slot, rows: torch.Tensor) -> int:
        values, version = self.link.pull_rows(slot.store_name, rows.cpu().numpy())
        src = from_numpy(values)
        # rows and values onto the parameter's device (a GPU table takes no host tensor)
        slot.tensor.index_copy_(0, rows.to(slot.tensor.device), src.to(slot.tensor.device, slot.tensor.dtype))
        return version

    @torch.no_grad()
    def flush(self) -> None:
        """Push the gradients of steps not pushed yet (async with n_push > 1); close() does."""
        if isinstance(self.engine, Downpour) and self.engine.pending:
            self._push_pending()

    def close(self) -> None:
        """Flush, leave the SSP group, close the client (if this optimizer made it)."""
        if self.overlap is not None:
            self.overlap.close()
        if self.engine is not None:
            self.flush()
        if self.link is not None:
            self.link.leave()          # a finished worker must not hold the others back
        if self._owns_client:
            self.client.close()

    # ---- modes: the tensors in and out of the mode's engine ------------------------------------

    def _step_sync(self) -> None:
        if self.overlap is not None:
            with self.link.timing("push"):     # what step() waits once backward is done
                reply, sent_hyper = self.overlap.finish(self.step_count, self._buffer_drift(1),
                                                        self._grad_scale is not None or self._under_scaler)
            self._sync_result(self.engine.answered(reply, self.step_count, self._pulled_names()))
            if sent_hyper != self._hyper:      # raised once the step is counted (step())
                self._after_step = OverlapError(
                    f"the hyperparameters changed between backward and optimizer.step() ({self._hyper} at step(), "
                    f"{sent_hyper} when backward began); overlap=True sends them with the step's first chunk, so the "
                    "step applied with the earlier ones: change them after optimizer.step() (as LR schedulers do)")
            return
        if self._skip:       # no gradient: the leader applies none (the step's shapes still match)
            grads = {s.store_name: np.zeros(tuple(s.tensor.shape), s.dtype) for s in self.params}
        else:                # unscaled as GradScaler.unscale_ does: times the scale's float32 reciprocal
            inv = None if self._grad_scale is None else self._grad_scale.double().reciprocal().float()
            grads = self._stage.to_host({s.store_name: self._dense_grad(s) if inv is None else
                                         self._dense_grad(s) * inv.to(s.tensor.device) for s in self.params}, self._dtypes)
        grads.update(self._buffer_drift(1))
        self._sync_result(self.engine.step(grads, self.step_count, self._pulled_names(), hyper=self._hyper,
                                           clip_norm=self._clip_norm, skip=self._skip))

    def _sync_result(self, result: Any) -> None:
        self.last_grad_norm, self.last_step_skipped = result.grad_norm, result.skipped
        self.step_count = result.next_step - 1       # past the job's step if this one was late
        self._install(result.tensors)

    def _step_async(self) -> None:
        grads = {}
        for s in self.params:
            g = s.tensor.grad
            if g is None:
                continue
            # kept past this step() only when n_push > 1: then zero_grad() must not clear it
            first = s.store_name not in self.engine.pending
            grads[s.store_name] = g.detach().clone() if self.n_push > 1 and first else g.detach()
            if self.engine.own_steps:          # Downpour: the replica takes its own step meanwhile
                s.tensor.add_(g.to(s.tensor.dtype), alpha=-self._lrs.get(s.store_name, self.specs[s.store_name]["lr"]))
        self.engine.add(grads)
        if self.engine.push_due:
            self._push_pending()
        if self.engine.pull_due:               # ssp: the next step waits until it is at most s clocks ahead
            self._pull()

    def _step_easgd(self) -> None:
        if self.local_step is not None:           # the wrapped torch optimizer, on this worker's copy
            with torch.enable_grad():
                self.local_step()
        else:                                      # the spec's optimizer, in numpy
            stepped = [s for s in self.params if s.tensor.grad is not None]
            new = self.engine.local_step({s.store_name: _as_numpy(s.tensor, s.dtype) for s in stepped},
                                         {s.store_name: _as_numpy(self._dense_grad(s), s.dtype) for s in stepped},
                                         self._hyper)
            for s in stepped:
                load(s.tensor, new[s.store_name])
        if self.engine.step_done():
            new = self.engine.exchange({s.store_name: _as_numpy(s.tensor, s.dtype) for s in self.params})
            for s in self.params:
                load(s.tensor, new[s.store_name])

    # ---- moving tensors ---------------------------------------------------------------------

    def _dense_grad(self, s: _Slot) -> torch.Tensor:
        g = s.tensor.grad
        if g is None:
            return torch.zeros_like(s.tensor)
        return g.to_dense() if g.is_sparse else g

    def _push_pending(self) -> None:
        pending = self.engine.take()
        dense = self._stage.to_host({k: g for k, g in pending.items() if not g.is_sparse}, self._dtypes)
        rows = {}
        for name, g in pending.items():
            if g.is_sparse:                        # row indices + rows; the store updates those rows only
                g = g.coalesce()
                self._touched[name] = g.indices()[0].cpu()   # numpy reads host memory only (a GPU table's too)
                rows[name] = (self._touched[name].numpy(), _as_numpy(g.values(), self._dtypes[name]))
        status = self.engine.push(dense, rows, plain=self._buffer_drift(self.world_size), hyper=self._hyper)
        if status == DROPPED:                      # AdaRevision no longer holds our base: re-pull
            self._pull(gate=False)

    def _pull(self, gate: bool = True) -> None:
        with self.link.timing("pull"):
            self._install(self.engine.pull(self._pulled_names(), gate))
            for s in self.params:       # sparse tables: the rows this worker just pushed (others' updates too)
                rows = self._touched.pop(s.store_name, None)
                if rows is not None and s.sparse and self.mode not in ("sync", "easgd"):
                    self._pull_rows(s, rows)

    def _buffer_drift(self, divide: int) -> dict[str, np.ndarray]:
        out = {}
        for s in self.buffers:
            now = _as_numpy(s.tensor, s.dtype)
            drift = now - self._buffer_base[s.store_name]
            out[s.store_name] = drift / drift.dtype.type(divide) if divide > 1 else drift
        return out
