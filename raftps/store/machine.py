"""The replicated state machine: a pure object that knows nothing of sockets, threads or Raft.

``TensorStore.apply(version, command)`` is called once per write, in log order, on every replica, with the
next store version (the node numbers the writes of each log entry: an entry may carry a batch of them,
group_commit.py). It never raises: a rejected command returns an error result and changes no tensor. Its
state (tensors, optimizer state, client sessions, sync-step buffers, each tensor's recent update indices
for staleness, SSP groups' clocks, statistics, group 0's hosts) is a function of the log alone: no clock,
no randomness, sorted iteration, copy-on-write arrays. Staleness comes from base_version, never time.
``snapshot()`` / ``restore()`` turn it into a codec message and back; ``digest()`` hashes it.

Arrays and who may hold them. Dense updates are copy-on-write: they build new arrays and freeze
them, so a reader may keep a reference outside the apply lock (a pull encodes its reply after
the lock is released; a linearizable read is taken in the tick thread and encoded in a server
thread while later entries apply). A row-sparse push (compress "rows") must cost O(rows
touched), so it updates rows in place, but only in arrays no reader can hold: an array is
writeable exactly while the store alone references it. The first sparse push after a tensor's
arrays were frozen copies them once (data and optimizer state) and keeps the copies writeable;
following sparse pushes update those in place. Every method that hands arrays out of the store
(``read``, ``snapshot``) freezes them first, so the next sparse push copies again: a full copy
is paid only after a full read, which costs as much itself. ``read_rows`` and ``digest`` copy
or consume under the caller's lock and freeze nothing. Values never depend on whether a copy
happened, so every replica still computes the same bits.
"""
from __future__ import annotations

import bisect
import logging
from collections import OrderedDict, deque
from typing import Any, Callable

import numpy as np

from raftps import codec, compress, ops, optim
from raftps.store import store_snapshot
from raftps.errors import (DtypeMismatch, Internal, InvalidRequest, RaftpsError, TensorExists, UnknownTensor,
                           error_result, exception_result)
from raftps.store.hosts import HostsState
from raftps.store.moves import Moves
from raftps.store.assign_state import plan
from raftps.store.ssp_clocks import SspClocks
from raftps.store.write_sessions import Session, SessionLimits, run_once  # noqa: F401  (Session: restore's, tests')
from raftps.store.sync_jobs import SyncJobs, check_job
from raftps.optimizers import OPTIMIZERS
from raftps.tensor import TENSOR_DTYPES, Tensor, check_finite, check_fits, check_name, check_tensors, freeze, freeze_tensor

log = logging.getLogger("raftps.store.machine")
# Optimizers whose step is per coordinate given scalar state, so it can run on a slice of rows
# (each says so in raftps/optimizers/; AdaRevision's whole-tensor gradient sums cannot).
ROW_OPTIMIZERS = tuple(name for name, optimizer in OPTIMIZERS.items() if optimizer.rows)


class TensorStore:
    """Named, versioned tensors with their optimizers; see the module docstring."""

    def __init__(self, session_limits: SessionLimits = SessionLimits(), staleness_window: int = 4096):
        self.version = 0                                   # writes applied (the version of the last one)
        self.tensors: dict[str, Tensor] = {}
        self.sessions: OrderedDict[str, Session] = OrderedDict()   # least recently active first
        self.session_limits = session_limits
        self.sync = SyncJobs()                             # sync steps per job (sync_jobs.py)
        # tensor -> Raft indices of its latest updates (as many as staleness_window): a push's staleness
        # tau is how many of them come after its base version (past the window, staleness_window).
        self.staleness_window = staleness_window
        self.update_indices: dict[str, deque[int]] = {}
        self.ssp = SspClocks()                              # SSP groups' bounds and clocks (ssp_clocks.py)
        self.stats = {"pushes": 0, "rejected": 0, "duplicates": 0, "staleness": {}}
        self.moves = Moves()                               # frozen, tombstoned, placed tensors (moves.py)
        self.hosts = HostsState()                          # group 0: which nodes serve which group (hosts.py)
        self._digest_cache: tuple[int, str] | None = None

    # ---- apply -----------------------------------------------------------------------------

    def apply(self, index: int, command: dict) -> dict:
        self.version = index
        try:
            command = ops.current_names(command)     # an entry logged under old field names applies the same
            op = command.get("op") if isinstance(command, dict) else None
            handler = self._OPS.get(op) if isinstance(op, str) else None
            if handler is None:
                raise InvalidRequest(f"unknown operation {op!r}")
            if op == "barrier":
                return {"version": index}
            if op == "step":                 # its contributors' sessions are kept one by one
                return handler(self, index, command)
            # a write naming a tensor moved away (or being moved) is refused whole (moves.py)
            return self._in_session(index, command,
                                    lambda: self.moves.check_placed_here(command) or handler(self, index, command))
        except RaftpsError as exc:
            self.stats["rejected"] += 1
            return exception_result(exc)
        except Exception as exc:
            # A bug, or an input no check foresaw. Raising here would stop the tick thread on
            # every replica at this entry (and again at every restart, replaying it): instead the
            # entry is answered Internal. Deterministic code fails the same way on every replica,
            # so the replicas stay identical. The client port's schema exists so this never runs.
            log.exception("entry %d failed: %r", index, exc)
            self.stats["rejected"] += 1
            return error_result(Internal, f"internal error applying entry {index}: {type(exc).__name__}")

    def _in_session(self, index: int, command: dict, run: Callable[[], dict]) -> dict:
        return run_once(self.sessions, self.session_limits, self.stats, index, command, run)

    # ---- operations ------------------------------------------------------------------------

    def _existing(self, name: str) -> Tensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            self.moves.raise_if_moved(name)
            raise UnknownTensor(f"unknown tensor {name!r}")
        return tensor

    def check_like(self, name: str, arr: np.ndarray, what: str) -> Tensor:
        """The tensor ``name`` if ``arr`` fits it (dtype, shape, finite), else the error to answer."""
        return check_fits(name, arr, self._existing(name), what)

    def _create(self, index: int, command: dict) -> dict:
        tensors = check_tensors(command.get("tensors"))
        specs = command.get("optimizer")
        created = {}
        for name, arr in tensors.items():
            spec = optim.normalize(specs.get(name) if isinstance(specs, dict) else None, name)
            if codec.dtype_name(arr.dtype) not in TENSOR_DTYPES:
                raise DtypeMismatch(f"tensor {name!r}: dtype {arr.dtype} not supported (use {TENSOR_DTYPES})")
            check_finite(name, arr, "initial value")
            old = self.tensors.get(name)
            if old is not None:      # a spec stored before an option existed compares with its default filled in
                if old.data.shape != arr.shape or old.data.dtype != arr.dtype \
                        or optim.normalize(old.optimizer, name) != spec:
                    raise TensorExists(f"tensor {name!r} exists with shape {old.data.shape}, dtype "
                                       f"{old.data.dtype}, optimizer {old.optimizer}; cannot create it "
                                       f"with shape {arr.shape}, dtype {arr.dtype}, optimizer {spec}")
                continue
            created[name] = (arr, spec)
        for name, (arr, spec) in created.items():
            data = freeze(arr.copy())
            state = {k: freeze(v) if isinstance(v, np.ndarray) else v for k, v in optim.init_state(spec, data).items()}
            self.tensors[name] = Tensor(data, 0, spec, state)
        return {"version": index, "created": sorted(created)}

    def _update(self, name: str, grad: np.ndarray, ctx: optim.Context = optim.NO_CONTEXT,
                spec: dict | None = None) -> None:
        """One optimizer step on tensor ``name``; ``spec``: this step's (the stored one with the
        push's hyperparameters over it, optim.with_hyperparameters), else the stored one."""
        tensor = self.tensors[name]
        data, state = optim.step(spec or tensor.optimizer, tensor.data, grad, tensor.state, ctx)
        state = {k: freeze(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}
        self.tensors[name] = Tensor(freeze(data), tensor.version + 1, tensor.optimizer, state)
        self._record_update(name)

    def _record_update(self, name: str) -> None:
        indices = self.update_indices.get(name)
        if indices is None:
            indices = self.update_indices[name] = deque(maxlen=self.staleness_window)
        indices.append(self.version)

    def tensor_staleness(self, name: str, base: int) -> int:
        """Updates applied to tensor ``name`` after store version ``base`` (saturating at the
        window). Counted per tensor, not in Raft indices: other tensors' updates, creates,
        barriers and rejected entries do not make a gradient staler."""
        indices = self.update_indices.get(name, ())
        return len(indices) - bisect.bisect_right(indices, base)

    def _check_rows(self, name: str, rows: compress.Rows) -> None:
        """A decoded row-sparse gradient (shape, dtype, order and range checked by the decoder)."""
        tensor = self._existing(name)
        if tensor.optimizer["name"] not in ROW_OPTIMIZERS:
            raise InvalidRequest(f"tensor {name!r}: optimizer {tensor.optimizer['name']!r} cannot apply a "
                                 f"row-sparse push (rows encoding works with {ROW_OPTIMIZERS}); push it dense")
        check_finite(name, rows.values, "gradient")

    def _owned(self, name: str) -> tuple[np.ndarray, dict]:
        """The tensor's data and state arrays, writeable and referenced by the store alone: the
        current ones if no reader got them (they are writeable), else fresh copies."""
        tensor = self.tensors[name]
        arrays = [tensor.data] + [v for v in tensor.state.values() if isinstance(v, np.ndarray)]
        if all(a.flags.writeable for a in arrays):
            return tensor.data, dict(tensor.state)
        return tensor.data.copy(), {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in tensor.state.items()}

    def _update_rows(self, name: str, rows: compress.Rows, ctx: optim.Context, spec: dict | None = None) -> None:
        """The tensor's optimizer on the pushed rows only, in place: the same formula as a dense
        step (optim.step on the row slices), so the touched rows get the bits a dense step on them
        would; other rows and their optimizer state are untouched (lazy, like SparseAdam). Scalar
        state (Adam's beta^t) advances once per push."""
        tensor = self.tensors[name]
        data, state = self._owned(name)
        idx = rows.indices
        sub = {k: v[idx] if isinstance(v, np.ndarray) else v for k, v in state.items()}
        new_rows, new_sub = optim.step(spec or tensor.optimizer, data[idx], rows.values, sub, ctx)
        data[idx] = new_rows
        for k, v in new_sub.items():
            if isinstance(v, np.ndarray):
                state[k][idx] = v
            else:
                state[k] = v
        self.tensors[name] = Tensor(data, tensor.version + 1, tensor.optimizer, state)
        self._record_update(name)

    def _push(self, index: int, command: dict) -> dict:
        raw = check_tensors(command.get("tensors"))
        base = command.get("base_version")
        if base is not None and (type(base) is not int or not 0 <= base < index):
            raise InvalidRequest(f"base_version must be an int in [0, {index}) (a version already applied), got {base!r}")
        encoding = command.get("encoding")
        like = {name: self._existing(name).data for name in raw if name in self.tensors}
        grads = compress.decode_push(raw, encoding, like)
        for name, grad in grads.items():
            if isinstance(grad, compress.Rows):
                self._check_rows(name, grad)
            else:
                self.check_like(name, grad, "gradient")
        specs = self._step_specs(command.get("hyper"), grads)
        member = self.ssp.check(command.get("ssp"))
        taus = {name: self.tensor_staleness(name, base) if base is not None else 0 for name in grads}
        contexts = {name: optim.Context(index, base, taus[name]) for name in grads}
        for name, ctx in contexts.items():
            tensor = self.tensors[name]
            optim.check_applicable(tensor.optimizer, tensor.state, ctx)
        for name, grad in grads.items():
            if isinstance(grad, compress.Rows):
                self._update_rows(name, grad, contexts[name], specs.get(name))
            else:
                self._update(name, grad, contexts[name], specs.get(name))
        result = {"version": index}
        if base is not None:
            tau = max(taus.values())
            hist = self.stats["staleness"]
            hist[tau] = hist.get(tau, 0) + 1
            result["staleness"] = tau
        if member is not None:
            result["clock"] = self.ssp.advance(*member)
        self.stats["pushes"] += 1
        return result

    def _step_specs(self, hyper: Any, grads: dict) -> dict[str, dict]:
        """Tensor -> the spec this write applies to it, for the tensors whose write carries
        hyperparameters (``hyper``: {name: {"lr": ..., ...}}, a torch param group's current values);
        raises before any tensor is updated, so a bad value refuses the write whole."""
        if hyper is None:
            return {}
        if not isinstance(hyper, dict):
            raise InvalidRequest(f"'hyper' must be a map of tensor name to hyperparameters, got {type(hyper).__name__}")
        stray = sorted(set(hyper) - set(grads))
        if stray:
            raise InvalidRequest(f"'hyper' names {stray[:5]}, which this write does not update")
        return {name: optim.with_hyperparameters(self.tensors[name].optimizer, hyper[name], name)
                for name in sorted(hyper)}

    # ---- SSP: bounded staleness (ssp_clocks.py) ---------------------------------------------

    def _ssp_join(self, index: int, command: dict) -> dict:
        return {"version": index, "clock": self.ssp.join(command)}

    def _ssp_leave(self, index: int, command: dict) -> dict:
        return {"version": index, "left": self.ssp.leave(command)}

    def _ssp_drop(self, index: int, command: dict) -> dict:
        return {"version": index, "dropped": self.ssp.drop(command)}

    def _assign(self, index: int, command: dict) -> dict:
        values = check_tensors(command.get("tensors"))
        for name, value in values.items():
            self.check_like(name, value, "value")
        for name, value in values.items():
            old = self.tensors[name]
            self.tensors[name] = Tensor(freeze(value.copy()), old.version + 1, old.optimizer, old.state)
            self._record_update(name)
        return {"version": index}

    def _assign_state(self, index: int, command: dict) -> dict:
        """Set tensors' values and optimizer state at once (a torch optimizer's state_dict loaded
        into the store); assign_state.py checks the whole write before anything changes."""
        planned = plan(command.get("records"), command.get("tensors"), self._existing)
        for name, value, state in planned:
            old = self.tensors[name]
            self.tensors[name] = Tensor(freeze(value.copy()), old.version + 1, old.optimizer, state)
            self._record_update(name)
        return {"version": index, "assigned": sorted(name for name, _, _ in planned)}

    def _delete(self, index: int, command: dict) -> dict:
        names = command.get("names")
        if not isinstance(names, list) or not names:
            raise InvalidRequest("'names' must be a non-empty list")
        for name in names:
            self._existing(check_name(name))
        for name in names:
            self.tensors.pop(name, None)
            self.update_indices.pop(name, None)
        return {"version": index}

    # ---- synchronous steps, per job (sync_jobs.py) -------------------------------------------

    def sync_step_applied(self, job: str = "") -> int:
        """The last step applied in job ``job`` (-1 if none)."""
        return self.sync.applied(job)

    def sync_count(self, job: str, step: int) -> int:
        """Contributions received so far to a step not yet applied."""
        return self.sync.count(job, step)

    @property
    def sync_applied(self) -> int:          # the default job: what trainer/ and stats use
        return self.sync.applied("")

    def _push_sync(self, index: int, command: dict) -> dict:
        grads = check_tensors(command.get("tensors"))
        step, workers, rank = command.get("step"), command.get("workers"), command.get("rank")
        if type(step) is not int or step < 0 or type(workers) is not int or workers < 1:
            raise InvalidRequest("push_sync needs step (int >= 0) and workers (int >= 1)")
        if rank is not None and (type(rank) is not int or not 0 <= rank < workers):
            raise InvalidRequest(f"push_sync rank must be an int in [0, workers={workers}), got {rank!r}")
        job = check_job(command.get("job"))
        for name, grad in grads.items():
            self.check_like(name, grad, "gradient")
        if step <= self.sync_step_applied(job):
            return {"version": index, "step": step, "applied": True, "late": True}
        buf = self.sync.add(job, step, workers, rank, grads)
        if buf is None:      # a restarted worker (a new client session) pushing its step again: counted once
            return {"version": index, "step": step, "applied": False, "count": self.sync.count(job, step),
                    "duplicate_rank": True}
        applied = buf["count"] >= workers
        if applied:
            self._apply_step(job, step)
        return {"version": index, "step": step, "applied": applied, "count": buf["count"]}

    def _apply_step(self, job: str, step: int) -> None:
        buf = self.sync.buffer(job, step)
        self._apply_mean(job, step, self.sync.total(job, step), buf["count"] if buf else 0)

    def _apply_mean(self, job: str, step: int, sums: dict[str, np.ndarray], count: int,
                    specs: dict[str, dict] | None = None, scale: float = 1.0) -> None:
        """Apply step ``step`` of job ``job``: the mean of ``count`` contributions summed in ``sums``
        (nothing if none arrived), times ``scale`` (a clipping factor the leader computed from the
        mean's norm), with ``specs`` (the step's hyperparameters); the step and every earlier one
        are then done."""
        specs = specs or {}
        if count:
            for name in sorted(sums):
                if name in self.tensors:     # deleted meanwhile: nothing to update
                    total = sums[name]
                    mean = total / total.dtype.type(count)
                    if scale != 1.0:
                        np.multiply(mean, mean.dtype.type(scale), out=mean)
                    self._update(name, mean, spec=specs.get(name))
            self.stats["pushes"] += 1
        self.sync.done(job, step)

    def _step(self, index: int, command: dict) -> dict:
        """A sync step aggregated by the leader (aggregate.py): the sum of ``count`` contributions
        and each contributor's [client, seq, ack, counted]. The step's mean is applied once (an
        entry for a step already applied changes nothing), and each contributor's session records
        its answer, so a contributor that sends again after this entry finds it instead of
        counting twice."""
        job = check_job(command.get("job"))
        step, workers, count = command.get("step"), command.get("workers"), command.get("count")
        contributors = command.get("contributors")
        if type(step) is not int or step < 0 or type(workers) is not int or workers < 1 \
                or type(count) is not int or not 0 <= count <= workers or not isinstance(contributors, list) \
                or not all(_is_contributor(c) for c in contributors):
            raise InvalidRequest("a step entry needs group, step (int >= 0), workers (int >= 1), count "
                                 "(0..workers) and contributors ([client, seq, ack, counted] each)")
        sums = check_tensors(command.get("tensors")) if count else {}
        scale = command.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, float) or not 0.0 < scale <= 1.0:
            raise InvalidRequest(f"a step entry's scale must be a float in (0, 1], got {scale!r}")
        late = step <= self.sync_step_applied(job)
        # a tensor frozen or moved away since the leader checked it (moves.py): the step is not
        # applied here, and every contributor is told so (Moving / Moved) and sends its part again
        moved = self.moves.placement_refusal(sums) if not late and count else None
        if moved is not None:
            done = moved
        elif not late and count:
            for name, total in sums.items():
                if name in self.tensors:     # deleted since the leader checked it: nothing to update
                    self.check_like(name, total, "gradient sum")
            hyper = command.get("hyper")
            if isinstance(hyper, dict):      # a tensor deleted since the leader checked it takes none
                hyper = {name: h for name, h in hyper.items() if name in self.tensors}
            specs = self._step_specs(hyper, {name: None for name in sums if name in self.tensors})
            self._apply_mean(job, step, sums, count, specs, scale)
        if moved is None:
            flag = {"late": True} if late else {"skipped": True} if command.get("skipped") is True else {}   # aggregate.py
            done = {"version": index, "step": step, "applied": True, "count": count, **flag}
        each = []
        for client, seq, ack, counted in contributors:
            answer = dict(done) if late or counted or moved else dict(done, duplicate_rank=True)
            try:
                each.append(self._in_session(index, {"client": client, "seq": seq, "ack": ack}, lambda: answer))
            except RaftpsError as exc:     # e.g. its session expired: this contributor alone is told
                each.append(error_result(type(exc), str(exc)))
        return {**done, "each": each}

    def _close_step(self, index: int, command: dict) -> dict:
        step = command.get("step")
        if type(step) is not int or step < 0:
            raise InvalidRequest("close_step needs step (int >= 0)")
        job = check_job(command.get("job"))
        if step <= self.sync_step_applied(job):
            return {"version": index, "step": step, "applied": True, "late": True}
        count = self.sync_count(job, step)
        self._apply_step(job, step)
        return {"version": index, "step": step, "applied": True, "count": count}

    # ---- moving tensors between Raft groups: the steps' state is self.moves's (moves.py) -------

    def _move_freeze(self, index: int, command: dict) -> dict:
        return self.moves.freeze(index, command, self.tensors, self.sync.holding)

    def _move_install(self, index: int, command: dict) -> dict:
        result, arrived = self.moves.install(index, command, self.tensors)
        for name, tensor in arrived.items():
            self.tensors[name] = tensor
            self.update_indices.pop(name, None)
        return result

    def _move_done(self, index: int, command: dict) -> dict:
        result = self.moves.done(index, command)
        for name in result["names"]:
            del self.tensors[name]
            self.update_indices.pop(name, None)
        return result

    def _place(self, index: int, command: dict) -> dict:
        return self.moves.place(index, command)

    def _hosts_change(self, index: int, command: dict) -> dict:
        return {"version": index, **self.hosts.apply_change(command)}

    _OPS: dict[str, Callable[["TensorStore", int, dict], dict] | None]   # entry op -> handler (ops.py; below)

    # ---- reads (callers hold whatever lock guards apply) ------------------------------------

    def read(self, names: list[str] | None) -> tuple[dict[str, Tensor], int]:
        """The tensors themselves, for use outside the lock: frozen first (see the docstring)."""
        if names is None:
            out = dict(sorted(self.tensors.items()))
        else:
            out = {name: self._existing(name) for name in names}
        for tensor in out.values():
            freeze_tensor(tensor)
        return out, self.version

    def read_rows(self, name: Any, rows: Any) -> tuple[np.ndarray, int, int]:
        """(a copy of the given rows, the tensor's version, the store version): O(rows)."""
        tensor = self._existing(check_name(name))
        if not isinstance(rows, np.ndarray) or rows.dtype not in compress.INDEX_DTYPES or rows.ndim != 1:
            raise InvalidRequest(f"tensor {name!r}: rows must be a 1-D int32 or int64 array, got "
                                 f"{rows.dtype if isinstance(rows, np.ndarray) else type(rows).__name__}"
                                 f"{' of shape ' + str(rows.shape) if isinstance(rows, np.ndarray) else ''}")
        if tensor.data.ndim < 1:
            raise InvalidRequest(f"tensor {name!r}: a scalar tensor has no rows")
        n = tensor.data.shape[0]
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise InvalidRequest(f"tensor {name!r}: row index out of range [0, {n}): "
                                 f"min {int(rows.min())}, max {int(rows.max())}")
        return tensor.data[rows], tensor.version, self.version

    def staleness_histogram(self) -> dict[int, int]:
        return dict(sorted(self.stats["staleness"].items()))

    def ssp_state(self, ssp_group: str) -> dict | None:
        return self.ssp.state(ssp_group)

    def move_state(self, name: str, full: bool = False) -> dict:
        """Where tensor ``name`` stands in this group's moves; ``full``: its frozen state to install."""
        return self.moves.state(name, full, self.tensors, self.version)

    def placement_table(self) -> dict[str, int]:
        return self.moves.table()

    # ---- snapshot / restore / digest --------------------------------------------------------

    def snapshot(self, share: bool = True) -> dict:
        """The whole state as a codec message (store_snapshot.py); building it copies no array.
        ``share=False`` only for a caller done with the message before the next apply (digest; the
        node's snapshot writer, which runs in the apply thread): the arrays then stay writeable."""
        return store_snapshot.message(self, share)

    def restore(self, snap: dict) -> None:
        fresh = TensorStore(self.session_limits, self.staleness_window)
        store_snapshot.fill(fresh, snap)
        self.__dict__.update(fresh.__dict__)

    def digest(self) -> str:
        """A hash of the snapshot encoding: equal digests at equal versions mean equal bits."""
        if self._digest_cache is None or self._digest_cache[0] != self.version:
            self._digest_cache = (self.version, store_snapshot.snapshot_digest(self.snapshot(share=False)))
        return self._digest_cache[1]

    def model_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _is_contributor(c: Any) -> bool:
    return isinstance(c, list) and [type(x) for x in c[1:]] == [int, int, bool] and isinstance(c[0], str)


# "barrier" is a read's entry (read_mode log): it changes nothing but the version.
TensorStore._OPS = {"barrier": None, **{entry: getattr(TensorStore, method)
                                        for entry, method in ops.entry_handlers().items()}}
