"""The raftps client: finds the leader, retries across failures, keeps every write exactly-once.

``Client`` is the public API, composed of three parts that each own one job:

- a transport (transport.py): one attempt at one node (TCP with TLS and the hello, or in
  process for tests: ``in_process_client``), made by the ``transport`` factory it is given;
- a session (session.py): the client id and per-group sequence numbers that make a write
  retried after a lost reply or a leader change apply once;
- a router (router.py): the layout, the placement of moved tensors, each group's leader and the
  retries that find it, and the merging of a request's per-group parts; it is given the
  transport and the session, and sends every request and write;

and of the jobs' steps across Raft groups (job_steps.py, pair_steps.py, step_stream.py),
push_async's lanes (pipeline.py) and a tensor's move (tensor_move.py). Control goes one way: the
Client calls those parts, they call the router, the router calls the transport; nothing calls
back up. A write is atomic and exactly-once within each Raft group; with several groups versions
are ``{group: version}`` maps (an int with one group).
"""
from __future__ import annotations

import functools
import math
import ssl
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from raftps import auth, codec
from raftps.deprecated import renamed_keyword
from raftps.errors import ProtocolError
from raftps.client.job_steps import JobSteps
from raftps.client.pair_steps import PairSteps
from raftps.client.pipeline import Pipeline
from raftps.client.router import Router, newest, parse_addresses  # noqa: F401 (newest: re-exported)
from raftps.client.router import merge as _merge
from raftps.client.session import Session
from raftps.client.step_stream import StepStream
from raftps.client.tensor_move import Mover
from raftps.client.transport import InProcessTransport, TcpTransport, Transport

if TYPE_CHECKING:
    from raftps.server.server import ClientServer

# Makes a transport: (token, tls, limits, connect_timeout) -> Transport (TcpTransport's arguments).
TransportFactory = Callable[[Any, Any, codec.Limits, float], Transport]


class Client:
    """``token``: the cluster's client token (default $RAFTPS_TOKEN, else the file named by
    $RAFTPS_TOKEN_FILE). ``tls``: a CA file to verify the nodes' certificates against (or True
    for the system CAs; default $RAFTPS_TLS_CA), for nodes serving TLS. ``transport``: what makes
    a transport (one for the client's requests, one per push_async lane), called as
    ``transport(token, tls, limits, connect_timeout)``: ``TcpTransport``, or for tests an
    in-process one (``in_process_client``)."""

    def __init__(self, addresses: str | Iterable[str] | None = None, timeout: float = 30.0,
                 attempt_timeout: float = 4.0, limits: codec.Limits = codec.DEFAULT_LIMITS,
                 token: str | None = None, tls: str | bool | ssl.SSLContext | None = None,
                 max_in_flight: int = 16, transport: TransportFactory = TcpTransport):
        addresses = parse_addresses(addresses)
        self.token = auth.client_token(token)
        self.tls = auth.client_tls_context(tls)
        self.timeout = timeout
        self.attempt_timeout = attempt_timeout
        self.limits = limits
        self._lock = threading.RLock()            # one request at a time on this client's connections
        new_transport = functools.partial(transport, self.token, self.tls, limits, min(2.0, attempt_timeout))
        self._session = Session()
        self._router = Router(addresses, new_transport(), self._session, timeout, attempt_timeout, self._lock)
        # push_async: up to max_in_flight pushes on their way at once, each lane a transport of its own
        self._pipeline = Pipeline(max_in_flight, new_transport)
        self._steps = JobSteps(self._router, self._lock, self._pipeline.submit)
        self._pairs = PairSteps(self, self._steps, self._router, self._lock, self._pipeline.submit)

    @property
    def addresses(self) -> list[str]:
        """The client addresses this client starts from (the router's: setting them re-aims it)."""
        return self._router.addresses

    @addresses.setter
    def addresses(self, addresses: str | Iterable[str]) -> None:
        self._router.addresses = parse_addresses(addresses)

    @property
    def client_id(self) -> str:
        """This session's id: every write carries it with its seq (exactly-once)."""
        return self._session.client_id

    @property
    def refusals(self) -> dict[str, int]:
        """Parts sent again because of a move: {"Moving": waited, "Moved": re-routed}."""
        return self._router.refusals

    def push_async(self, grads: dict[str, np.ndarray], base_version: Any = None,
                   encoding: dict | None = None) -> "Future[dict]":
        """Send a push without waiting for the ones before it: up to ``max_in_flight`` (the
        constructor's) are on their way at once, each on a connection of its own, each still
        exactly-once with its own seq; the leader's group commit puts those that arrive together
        in one log entry. The future gives push_result's reply. Pushes in flight together may be
        applied in any order. One Raft group only (with several, use push)."""
        if self.groups() > 1:
            raise ValueError("push_async works on a cluster of one Raft group; use push")
        fields: dict[str, Any] = {"tensors": {k: np.asarray(v) for k, v in grads.items()}}
        if base_version is not None:
            fields["base_version"] = int(base_version)
        if encoding is not None:
            fields["encoding"] = encoding
        return self._pipeline.submit(lambda call: self._router.write("push", 0, call=call, **fields))

    @property
    def max_in_flight(self) -> int:
        return self._pipeline.max_in_flight

    @max_in_flight.setter
    def max_in_flight(self, value: int) -> None:        # before the first push_async
        self._pipeline.max_in_flight = value

    # ---- Raft groups -----------------------------------------------------------------------

    def groups(self) -> int:
        """How many Raft groups the cluster shards tensors over (asked once, then cached)."""
        return self._router.groups()

    def refresh_placement(self) -> dict[str, int]:
        """Learn again where moved tensors live (group 0's placement table, a linearizable read).
        Routing uses this cache; a group that no longer holds a tensor answers Moved, which
        refreshes it, so a stale cache costs a round trip, never a misplaced write."""
        return self._router.refresh_placement()

    def group_of(self, name: str) -> int:
        """The Raft group that holds tensor ``name`` (an index tensor goes with its tensor): its
        placement if it was moved (``move``), else the hash of its name."""
        return self._router.group_of(name)

    # ---- the API --------------------------------------------------------------------------

    def create(self, name: str, array: np.ndarray, optimizer: dict) -> Any:
        """Create a tensor with its optimizer; the same call again is a no-op."""
        return self.create_many({name: array}, {name: optimizer})

    def create_many(self, tensors: dict[str, np.ndarray], optimizers: dict[str, dict]) -> Any:
        """Create several tensors in one write (each with its optimizer spec); existing ones
        with the same shape, dtype and optimizer are left as they are."""
        return self.create_result(tensors, optimizers)["version"]

    def create_result(self, tensors: dict[str, np.ndarray], optimizers: dict[str, dict]) -> dict:
        """As create_many, but the whole result: version and ``created`` (the names that did not exist)."""
        tensors = {k: np.asarray(v) for k, v in tensors.items()}
        if self.groups() == 1:
            return self._router.write("create", tensors=tensors, optimizer=dict(optimizers))
        return self._router.each_group(lambda g, part: self._router.write(
            "create", g, tensors=part, optimizer={k: v for k, v in optimizers.items() if k in part}),
            self._router.split(tensors))

    def push(self, grads: dict[str, np.ndarray], base_version: Any = None,
             encoding: dict | None = None, ssp: dict | None = None, hyper: dict | None = None) -> Any:
        """Apply one gradient per tensor, atomically, exactly once; returns the store version.
        ``encoding``: compressed tensors (raftps.compress); ``ssp``: {ssp_group, worker} (SSP gate);
        ``hyper``: {tensor: {"lr": ..., ...}}, this step's hyperparameters over the tensor's stored
        optimizer spec (raftps.optim.STEP_HYPERPARAMETERS; a torch param group's current values)."""
        return self.push_result(grads, base_version, encoding, ssp, hyper)["version"]

    def push_result(self, grads: dict[str, np.ndarray], base_version: Any = None,
                    encoding: dict | None = None, ssp: dict | None = None, hyper: dict | None = None) -> dict:
        """As push, but the whole result: version, staleness (with a base), clock (with ssp)."""
        grads = {k: np.asarray(v) for k, v in grads.items()}
        many = self.groups() > 1

        def write(raft_group: int, part: dict) -> dict:
            fields: dict[str, Any] = {"tensors": part}
            if hyper:
                fields["hyper"] = {k: v for k, v in hyper.items() if k in part} if many else hyper
            base = base_version.get(raft_group) if isinstance(base_version, dict) else base_version
            if base is not None:
                fields["base_version"] = int(base)
            if encoding is not None:
                chosen = {k: v for k, v in encoding.items() if k in part}
                if chosen or not many:
                    fields["encoding"] = chosen if many else encoding
            if ssp is not None:
                fields["ssp"] = ssp
            return self._router.write("push", raft_group, **fields)
        if not many:
            return write(0, grads)
        return self._router.each_group(write, self._router.split(grads))

    def assign(self, values: dict[str, np.ndarray]) -> Any:
        values = {k: np.asarray(v) for k, v in values.items()}
        if self.groups() == 1:
            return self._router.write("assign", tensors=values)["version"]
        parts = self._router.split(values)
        return self._router.each_group(lambda g, part: self._router.write("assign", g, tensors=part), parts)["version"]

    def assign_state(self, values: dict[str, np.ndarray], states: dict[str, dict[str, Any]]) -> Any:
        """Set tensors' values and their optimizers' state at once (atomically in each Raft
        group): ``states[name]`` has exactly the keys the tensor's optimizer keeps (arrays of its
        shape and dtype, and scalars: Adam's ``beta1_t``/``beta2_t``, ``step``), as
        ``export(prefix, state=True)`` returns them. Returns the store version."""
        missing = sorted(set(values) ^ set(states))
        if missing:
            raise ValueError(f"assign_state: values and states must name the same tensors ({missing[:5]} differ)")

        def write(raft_group: int, part: dict) -> dict:
            records, parts = [], {}
            for i, name in enumerate(sorted(part)):
                scalars = {k: v for k, v in states[name].items() if not isinstance(v, np.ndarray)}
                records.append({"name": name, "scalars": scalars})
                parts[str(i)] = np.asarray(values[name])
                parts.update({f"{i}.{k}": v for k, v in states[name].items() if isinstance(v, np.ndarray)})
            return self._router.write("assign_state", raft_group, records=records, tensors=parts)
        if self.groups() == 1:
            return write(0, values)["version"]
        return self._router.each_group(write, self._router.split(dict(values)))["version"]

    def delete(self, names: list[str]) -> Any:
        if self.groups() == 1:
            return self._router.write("delete", names=list(names))["version"]
        parts = self._router.split({n: None for n in names})
        return self._router.each_group(lambda g, part: self._router.write("delete", g, names=list(part)), parts)["version"]

    @renamed_keyword("group", "job")
    def push_sync(self, grads: dict[str, np.ndarray], step: int, workers: int, job: str | None = None,
                  rank: int | None = None) -> Any:
        """One worker's contribution to synchronous step ``step`` of job ``job`` (a sync step
        sequence's name; None: the store-wide default job); the mean of ``workers`` contributions is applied
        once, when the last one arrives. With ``rank`` (0 <= rank < workers) the step counts
        distinct ranks: a rank's second contribution (a restarted worker) is ignored. With several
        Raft groups each group applies its part of the step when its ``workers`` parts are in."""
        return self.push_sync_result(grads, step, workers, job, rank)["version"]

    @renamed_keyword("group", "job")
    def push_sync_result(self, grads: dict[str, np.ndarray], step: int, workers: int, job: str | None = None,
                         rank: int | None = None) -> dict:
        """As push_sync, but the whole result: version, step, applied, count, and late (the step
        was applied before) or duplicate_rank (this rank had contributed; nothing changed)."""
        return self._steps.contribute("push_sync", grads, step, workers, job, rank)

    @renamed_keyword("group", "job")
    def push_step(self, grads: dict[str, np.ndarray], step: int, workers: int, job: str | None = None,
                  rank: int | None = None, timeout: float = 10.0, pull: bool = False, hyper: dict | None = None,
                  clip_norm: float | None = None, encoding: dict | None = None, spread_answers: bool = False,
                  chunk_bytes: int = 0, pairs: bool = False) -> dict:
        """One worker's contribution to synchronous step ``step`` of job ``job``, summed on
        the leader with the step's other contributions (in rank order, so the sum's bits do not
        depend on arrival order) and replicated once as the step (aggregation
        before replication); returns when the step is applied: version, step, applied, count (the
        contributions in it: fewer than ``workers`` if ``timeout`` seconds after the step's latest
        contribution some had not arrived), and late (the step was applied without this one) or
        duplicate_rank. With ``pull``, also ``tensors`` (and ``tensor_versions``): the step's tensors
        as its entry left them, read on the leader right after the apply, so no pull is needed (a
        reply without them, e.g. to a contribution sent again, means: pull). Exactly-once: a
        contribution in flight when the leader died is sent again to the new leader with the same
        seq. With several Raft groups, every group's part at once (push_async's lanes).

        ``hyper``: as push's, and every contribution to a step must carry the same (else refused).
        ``clip_norm``: the leader scales the step's mean gradient to at most this L2 norm, as
        ``torch.nn.utils.clip_grad_norm_`` on one process's full batch (each Raft group clips its
        own part); the answer's ``grad_norm`` is the mean's norm before clipping. ``encoding``: as
        push's, fp16 only (``raftps.compress.encode_fp16``); the leader decodes each contribution
        before it joins the step's sum. ``spread_answers`` (with ``pull``): the tensors read at the
        step's version from member ``rank`` mod the members (``read_version``): K answers, N links.
        ``chunk_bytes``: each group's part goes as chunks of whole tensors of up to this many bytes,
        one after another, each its own aggregation unit and entry (job ``JOB:chunkN`` for all but
        the first), so a chunk's replication and answer overlap the next chunk's arrival; every
        rank of a job must pass the same value. A skip flag (jobs.skip_flag) goes in every chunk,
        so a skipped step skips them all. Not with ``clip_norm`` (its norm spans the whole part):
        the part then goes whole.

        ``pairs`` (with ``pull``, ``rank`` and ``chunk_bytes``; every rank of the job the same):
        ranks 2i and 2i + 1 add up half of the step's chunks each and send the store their sum,
        then relay its answers to each other (pair_steps.py): the links of the workers carry a
        ring all-reduce's bytes and the store's links less. A pair's sum is added to the step's as
        one contribution: the step's bits are those of the pairwise sum (g0 + g1) + (g2 + g3),
        the same every run. An odd world's last rank, and a rank whose partner is gone, go
        unpaired. Not with ``encoding`` or ``clip_norm`` (the step then goes unpaired)."""
        if not (math.isfinite(timeout) and timeout >= 0):
            raise ValueError(f"push_step timeout must be a finite number of seconds >= 0, not {timeout!r}")
        if pairs and not (pull and rank is not None and chunk_bytes > 0):
            raise ValueError("push_step pairs=True needs pull=True, a rank and chunk_bytes > 0 (the pair "
                             f"splits the step by its chunks); got pull={pull}, rank={rank}, chunk_bytes={chunk_bytes}")
        if pairs and not encoding and clip_norm is None:
            return self._pairs.contribute(grads, step, workers, job, int(rank), float(timeout), int(chunk_bytes), hyper)
        extra: dict[str, Any] = {"pull": True, "spread_answers": spread_answers} if pull else {}
        if hyper:
            extra["hyper"] = hyper
        if clip_norm is not None:
            extra["clip_norm"] = float(clip_norm)
        if encoding:
            extra["encoding"] = encoding
        return self._steps.contribute("push_step", grads, step, workers, job, rank, waits=float(timeout),
                                      chunk_bytes=int(chunk_bytes), timeout=float(timeout), **extra)

    def expect_chunks(self, job: str | None, tensors: dict[str, tuple[tuple[int, ...], str]], chunk_bytes: int) -> None:
        """Job ``job``'s steps go in chunks (push_step's ``chunk_bytes``) over ``tensors``
        ({name: (shape, dtype)}, as ``tensors()`` lists them): from now on wait_step, close_step
        and sync_applied of the job cover each chunk's job, before this client sent a step of it
        (a rank that resumes reads the lowest step every chunk applied)."""
        self._steps.expect_chunks(job, tensors, int(chunk_bytes))

    def step_stream(self, *args: Any, pairs: bool = False, **kwargs: Any) -> StepStream:
        """A StepStream(job, workers, rank, timeout, plan, sizes) on this client (sync's overlap)."""
        return StepStream(self._router, self._pipeline.submit, self._steps, self._pairs if pairs else None, *args, **kwargs)

    @renamed_keyword("group", "job")
    def close_step(self, step: int, job: str | None = None) -> Any:
        """Apply sync step ``step`` of job ``job`` now with the contributions that arrived (no-op if applied)."""
        return self._steps.close(step, job)

    @renamed_keyword("group", "job")
    def wait_step(self, step: int, timeout: float, job: str | None = None) -> Any:
        """Block until sync step ``step`` of job ``job`` is applied; returns the store version then
        (with several Raft groups: {raft_group: version} over the Raft groups the job's steps live in)."""
        return self._steps.wait(step, timeout, job)

    @renamed_keyword("group", "job")
    def sync_applied(self, job: str | None = None) -> int:
        """The last applied sync step of job ``job`` (-1 if none), a linearizable read at the leader.
        With several Raft groups: the lowest over the Raft groups that have applied a step of it."""
        return self._steps.applied(job)

    # ---- SSP groups (bounded staleness); with several Raft groups, one clock per Raft group ----

    def _ssp_write(self, op: str, key: str, **fields: Any) -> Any:
        if self.groups() == 1:
            return self._router.write(op, **fields)[key]
        replies = [self._router.write(op, g, **fields)[key] for g in range(self.groups())]
        return max(replies) if key == "clock" else all(replies)

    @renamed_keyword("group", "ssp_group")
    def ssp_join(self, ssp_group: str, worker: str, staleness: int | None) -> int:
        """Join SSP group ``ssp_group`` (created with bound ``staleness``; None: unbounded); returns the clock."""
        return self._ssp_write("ssp_join", "clock", ssp_group=ssp_group, worker=worker, staleness=staleness)

    @renamed_keyword("group", "ssp_group")
    def ssp_leave(self, ssp_group: str, worker: str) -> bool:
        return self._ssp_write("ssp_leave", "left", ssp_group=ssp_group, worker=worker)

    @renamed_keyword("group", "ssp_group")
    def ssp_drop(self, ssp_group: str, worker: str, clock: int) -> bool:
        """Drop ``worker`` from the SSP group if its clock is still ``clock`` (it made no progress)."""
        return self._ssp_write("ssp_drop", "dropped", ssp_group=ssp_group, worker=worker, clock=int(clock))

    @renamed_keyword("group", "ssp_group")
    def ssp_wait(self, ssp_group: str, worker: str, timeout: float) -> dict:
        """Wait (at the leader, at most ``timeout`` s) until ``worker`` may take its next step:
        {version, ready, member, clock, min_clock, slowest: [[worker, clock], ...]}."""
        request = {"op": "ssp_wait", "ssp_group": ssp_group, "worker": worker, "timeout": float(timeout)}
        with self._lock:
            if self.groups() == 1:
                return self._router.request(request, attempt_timeout=float(timeout) + 5.0)
            replies = {g: self._router.request(request, attempt_timeout=float(timeout) + 5.0, raft_group=g)
                       for g in range(self.groups())}
        slowest = min(replies.values(), key=lambda r: r["min_clock"])
        return {"version": {g: r["version"] for g, r in replies.items()},
                "ready": all(r["ready"] for r in replies.values()),
                "member": all(r["member"] for r in replies.values()),
                "clock": max((r["clock"] for r in replies.values() if r["clock"] is not None), default=None),
                "min_clock": slowest["min_clock"], "slowest": slowest["slowest"]}

    def pull(self, names: list[str] | None = None, min_version: Any = None,
             linearizable: bool = True) -> tuple[dict[str, np.ndarray], Any]:
        """Tensors and the store version they are at. Linearizable reads are served by the leader
        (ReadIndex, or a barrier entry: serve --read-mode); others by any node that has applied
        at least ``min_version``. With several Raft groups each group's part is read on its own
        (linearizable per group; not one cut across groups) and the version is {group: version}."""
        reply = self.pull_result(names, min_version, linearizable)
        return reply["tensors"], reply["version"]

    def pull_result(self, names: list[str] | None = None, min_version: Any = None,
                    linearizable: bool = True) -> dict:
        """As pull, but the whole reply: tensors, version and tensor_versions (each tensor's own
        update count, read from the same state as the tensors)."""
        def read(raft_group: int, part: list[str] | None) -> dict:
            request = {"op": "pull", "names": part, "linearizable": linearizable,
                       "min_version": self._router.min_version(min_version, raft_group)}
            with self._lock:
                return self._router.request(request, to_leader=linearizable, raft_group=raft_group)
        if self.groups() == 1:
            return read(0, list(names) if names is not None else None)
        parts = {g: None for g in range(self.groups())} if names is None else \
            {g: list(part) for g, part in self._router.split({n: None for n in names}).items()}
        return self._router.each_group(read, parts)

    def pull_rows(self, name: str, rows: Any, min_version: Any = None,
                  linearizable: bool = True) -> tuple[np.ndarray, Any]:
        """Rows ``rows`` (integers in [0, rows of the tensor), any order) of tensor ``name`` and
        the store version they are at; the reply's size grows with len(rows), not the table."""
        rows = np.asarray(rows)
        if rows.size == 0 or rows.dtype.kind in "iu" and rows.dtype not in (np.int32, np.int64):
            rows = rows.astype(np.int64)      # the store takes int32 or int64; others are refused there
        def read(raft_group: int, _: Any) -> dict:
            request = {"op": "pull_rows", "name": name, "rows": rows, "linearizable": linearizable,
                       "min_version": self._router.min_version(min_version, raft_group)}
            with self._lock:
                return self._router.request(request, to_leader=linearizable, raft_group=raft_group)
        if self.groups() == 1:
            reply = read(0, None)
            return reply["rows"], reply["version"]
        reply = self._router.each_group(read, {self.group_of(name): [name]})
        return reply["rows"], reply["version"]

    def tensors(self, prefix: str | None = None) -> list[dict]:
        """Name, dtype, shape, version and optimizer of every tensor (from the leader) whose name
        starts with ``prefix`` and that this client's token may read; with several Raft groups,
        each row also names its ``group``."""
        request: dict[str, Any] = {"op": "tensors"}
        if prefix:
            request["prefix"] = prefix
        with self._lock:
            if self.groups() == 1:
                return self._router.request(request)["tensors"]
            rows = [{**row, "group": g} for g in range(self.groups())
                    for row in self._router.request(request, raft_group=g)["tensors"]]
        return sorted(rows, key=lambda row: row["name"])

    def export(self, prefix: str, state: bool = False) -> dict:
        """Every tensor whose name starts with ``prefix`` (a plain string prefix), in one
        linearizable read at the leader: tensors, tensor_versions, optimizers, version, and the
        store's digest at that version (with several Raft groups: per group, as maps); with
        ``state``, also ``states``: each tensor's optimizer state (assign_state's form)."""
        request = {"op": "export", "prefix": prefix, **({"state": True} if state else {})}
        with self._lock:
            if self.groups() == 1:
                return self._router.request(request)
            return _merge({g: self._router.request(dict(request), raft_group=g) for g in range(self.groups())})

    def snapshot(self) -> dict:
        """The whole store at one version: {version, digest, snapshot} (``TensorStore.snapshot()``
        form); with several Raft groups, {"groups": [that, per group]}. A store beyond this client's ``limits`` (1 GiB, 4096 arrays by default) needs a
        Client with larger ones (``raftps snapshot save`` makes one)."""
        with self._lock:
            if self.groups() > 1:             # each group at a version of its own
                return {"groups": [self._router.request({"op": "snapshot"}, raft_group=g)
                                   for g in range(self.groups())]}
            return self._router.request({"op": "snapshot"})

    # ---- moving a tensor to another Raft group (moves.py has the state machine's side) ----------

    @renamed_keyword("group", "raft_group")
    def move(self, name: str, raft_group: int) -> dict:
        """Move tensor ``name`` (with its index tensor ``name:indices``, if stored) to Raft group
        ``raft_group``, online (tensor_move.py): freeze it in its Raft group (writes to it wait), read
        its whole state there, install that state in ``raft_group``, record the placement in group 0,
        then leave a tombstone that sends every later request to ``raft_group``. Every step is idempotent:
        a move interrupted at any point completes when run again. Returns {tensor, from, to, names}."""
        return Mover(self._router, self.limits, self._lock).move(name, raft_group)

    def members(self, action: str = "list", node: str | None = None, old: str | None = None) -> dict:
        """Cluster membership (Raft addresses): ``list``, or ``add`` / ``remove`` ``node``, or
        ``replace`` ``old`` with ``node``. Returns members and, for changes, ``changed``."""
        with self._lock:
            return self._router.request({"op": "member", "action": action, "node": node, "old": old},
                                 attempt_timeout=max(self.attempt_timeout, 25.0))

    def stats(self) -> dict:
        with self._lock:
            if self.groups() == 1:
                return self._router.request({"op": "stats"})
            return _merge({g: self._router.request({"op": "stats"}, raft_group=g) for g in range(self.groups())})

    def status(self, timeout: float = 2.0, digest: bool = True) -> list[dict]:
        """One dict per node (node, address, role, term, applied, digest, ...) and, with several
        Raft groups, per group the node hosts (``group``); 'down' if unreachable.
        ``digest=False``: no digest (each node hashes its whole store for it)."""
        out = []
        with self._lock:
            for number, address in enumerate(self.addresses, 1):
                try:
                    reply = self._router.call(address, {"op": "status", "digest": digest}, timeout)
                except (OSError, ConnectionError, ProtocolError) as exc:
                    out.append({"node": number, "address": address, "role": "down", "term": None,
                                "applied": None, "digest": None, "error": str(exc) or type(exc).__name__})
                    continue
                # a row per Raft group the node hosts (one group: the node's row, as always)
                rows = reply.pop("groups", None) or [reply]
                out.extend({**row, "connections": reply.get("connections")} for row in rows)
        return out

    def close(self) -> None:
        self._pairs.close()
        self._pipeline.close()
        with self._lock:
            self._router.transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def in_process_client(servers: "dict[str, ClientServer]", **kwargs: Any) -> Client:
    """A Client of ClientServers in this process, by their client addresses, over no socket
    (transport.InProcessTransport): for tests. ``kwargs`` as Client's."""
    def transport(token: str | None, tls: Any, limits: codec.Limits, connect_timeout: float) -> Transport:
        return InProcessTransport(servers, token, limits)
    return Client(list(servers), transport=transport, **kwargs)
