"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105) with its outer step in the replicated store.

Each rank runs its own inner optimizer for H (``sync_every``) steps; then its pseudo-gradient
(the global parameters at the round's start minus its own) goes to the store, whose tensors hold
the global parameters with the outer optimizer (default Nesterov momentum SGD, lr 0.7, momentum
0.9), and the rank continues from the new global parameters. The outer state lives once, in the
store, applied once per round whatever dies. This module works on numpy arrays and imports no
torch: trainer/ and raftps.torch both drive it.

    d = DiLoCo(client, "job", params, rank=r, world_size=K, sync_every=H)   # checks only: no I/O
    d.create()                          # rank 0 creates the job's tensors; the others wait for them
    start, params = d.resume()          # the step to start at and the global parameters
    for step in range(start, steps):
        params = inner_step(params)                      # the rank's own optimizer, locally
        new = d.after_inner_step(step, params)           # None, or {name: array} for synced tensors
        if new is not None:
            params.update(new)                           # the inner optimizer's state is kept

``params`` maps names (``named_parameters()`` order) to float32/float64 arrays; the store names
them ``PREFIX/<name>`` (jobs.tensor). ``after_inner_step`` returns writeable arrays of the new
global values; ``rounds`` lists what the last call synced (fragment, round, count, late, bytes),
``bytes_sent`` totals the pseudo-gradient bytes sent, ``version`` is the newest store version
the rank has seen.

Synchronous (default): the round's end is the H-th step of a round (it takes its inner step,
then syncs). Every rank sends its pseudo-gradient with ``Client.push_step`` in the job's round
sequence (jobs.diloco_job), ranked, ``pull=True``: the leader sums the K contributions and
replicates the round once, the store applies the outer optimizer to their mean, and each answer
carries the new values. A rank that has not arrived ``step_timeout`` seconds after the round's
latest contribution is left out (push_step's semantics); a rank whose contribution comes after its
round applied (``late``) loses that round's work and rejoins at the store's next round.

Asynchronous (``asynchronous=True``, the Downpour of outer steps): each rank's pseudo-gradient is
applied when it arrives, by ``Client.push`` with ``base_version`` = the version of the globals its
round started from, then the rank pulls the new globals; nobody waits. The outer spec gets
``staleness_aware: True`` unless it says otherwise, so the store divides lr by max(1, tau), tau =
updates to the tensor since that version. A push carries the pseudo-gradient times c = d / K,
d = K - 1 (at least 1) with staleness_aware, 1 without: d is the divisor the store applies when the
K ranks run at one pace (each push then finds the other K - 1 since its pull), so K pushes of a
round add up to one synchronous round's step on the mean; a staler push counts less. Each rank
counts its applied rounds per fragment in a tensor of its own (jobs.diloco_rounds) that rides in
the same atomic push (exact on a cluster of one Raft group; with several, a push is atomic per
group, so a crash between groups' parts may count a round the other group did not apply).

Streaming (``fragments=F``, Douillard et al. 2025, arXiv 2501.18512): the tensors are split, in
order and whole, into F contiguous fragments balanced by bytes; fragment f has its own round
sequence and syncs every H steps at offset f*H//F: its round r ends once (r+1)*H + f*H//F inner
steps are taken (its first round is the longer by its offset), so a round's bytes are spread
over the interval. Only the fragment's tensors are replaced after its sync.

Warm-up (``warmup=W``): the first W inner steps are rounds of one step each (every rank syncs
after every step, all fragments at once), then rounds of H begin, offsets and all, counted from
step W. Starting DiLoCo from a random model is what costs it most at small budgets (the paper
and OpenDiLoCo start from a pretrained model); W rounds of one step are the bytes of W
synchronous steps.

Restarts: ``resume`` reads where the store is (each fragment's applied round; asynchronous: the
rank's own counters) and returns the step after the latest round end among the fragments, with
the global parameters: a restarted rank resumes at the store's round (with fragments, the rounds
of the others that began earlier are shorter for it). Its inner optimizer starts fresh (the
caller makes a new one): its moments are re-estimated within a few inner steps. The alternative,
keeping each rank's inner state in the store at every round end, would add the inner state's
bytes to every round: for AdamW, 2x the parameters per rank (exp_avg, exp_avg_sq: 10,229,972
bytes for examples/char_gpt.py's 1,278,720-parameter model, against its 5,114,880-byte
pseudo-gradient: ``python -m bench.diloco_state``), so 3x a round's traffic and 2K model-sized
arrays more in the store, to save a few inner steps of moment warm-up.

Compression: ``compress="fp16"`` sends pseudo-gradients as float16 with a power-of-two scale
(raftps.compress), half the bytes; ``compress="int8"`` as int8 codes with one scale per
block of 256 elements (block-wise absmax, Dettmers et al. 2022, arXiv 2110.02861; a scale
travels as a msgpack float64), 0.258x the bytes. Synchronous rounds' contributions are decoded
by the leader before they join the round's sum (push_step's ``encoding``), asynchronous ones by
the state machine (push's): the log and every replica see plain arrays.

Overlap (``overlap=True``; Streaming DiLoCo's overlapped communication, Douillard et al. 2025,
arXiv 2501.18512): at a round's end the rank sends the round (the same one push_step or push as
without overlap, so the store's rounds and exactly-once are unchanged) on a background thread,
snapshots the fragment's local values x_s and returns at once; it keeps taking inner steps.
The first ``after_inner_step`` after the round's answer arrives returns the fragment's new values
x_g + (x_local - x_s): the new global parameters plus the local progress made since the snapshot
(the paper mixes instead, alpha x_local + (1 - alpha) x_g, which with its recommended alpha drops
part of that progress; here it is kept whole, and it is counted in the next round's
pseudo-gradient, x_g - x_local, since x_g is that round's anchor). A fragment's next round end
waits for its previous round's answer first. ``ready()`` says whether an answer waits to be
applied (a caller that copies parameters to the host only when it must asks it each step);
``finish(params)`` waits for every round in flight and returns their values (the store's exactly,
when no inner step was taken since the last round's end); ``close()`` stops the thread.

Bad input (H < 1, F outside [1, number of tensors], an outer spec the store would refuse, a rank
outside [0, K), a non-float parameter) raises before any I/O: the constructor sends nothing.
"""
from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from raftps import jobs, optim
from raftps.jobs import MAX_STEP_TIMEOUT
from raftps.client.client import Client
from raftps.compress import encode_fp16, encode_int8
from raftps.errors import InvalidOptimizer
from raftps.client.job_steps import CREATOR_WAIT, create_chunked, wait_for_tensors
from raftps.schema import NAME_PATTERN

DEFAULT_OUTER = {"name": "momentum", "lr": 0.7, "momentum": 0.9, "nesterov": True}
# Asynchronous rounds apply each rank's pseudo-gradient on arrival: the paper's Nesterov momentum
# diverged there (char GPT x4, H = 20: validation loss 7.96 after 300 batches, plain averaging
# 2.19: python -m bench.diloco_quality --modes diloco-async --no-sync --h 20), so its default is
# averaging, each push scaled as the module docstring says.
ASYNC_DEFAULT_OUTER = {"name": "sgd", "lr": 1.0}
COUNTER_SPEC = {"name": "sgd", "lr": 1.0}   # a push of -1 adds one
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class Round:
    """One fragment's sync, as ``after_inner_step`` did it."""
    fragment: int
    round: int
    count: int          # contributions in the applied round (asynchronous: 1)
    late: bool          # the round had applied without this rank's pseudo-gradient
    bytes: int          # pseudo-gradient bytes sent


def split_fragments(sizes: list[int], fragments: int) -> list[range]:
    """``fragments`` contiguous, non-empty runs of tensor indices whose byte sizes are as even as
    possible: each cut falls where the running total is nearest k/F of the whole (ties: earlier)."""
    if not 1 <= fragments <= len(sizes):
        raise ValueError(f"fragments must be in [1, {len(sizes)}] (the number of tensors), got {fragments}")
    total = sum(sizes)
    running = [0]
    for size in sizes:
        running.append(running[-1] + size)
    cuts = [0]
    for k in range(1, fragments):
        lo, hi = cuts[-1] + 1, len(sizes) - (fragments - k)
        cuts.append(min(range(lo, hi + 1), key=lambda i: (abs(running[i] * fragments - k * total), i)))
    cuts.append(len(sizes))
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def outer_spec(outer: Any, asynchronous: bool) -> dict:
    """The store spec of the global tensors, complete and checked (InvalidOptimizer as the store
    would answer it), with staleness_aware on by default in asynchronous mode."""
    if outer is None:
        outer = ASYNC_DEFAULT_OUTER if asynchronous else DEFAULT_OUTER
    spec = dict(outer) if isinstance(outer, dict) else outer
    if isinstance(spec, dict) and spec.get("name") == "elastic":
        raise InvalidOptimizer("DiLoCo's outer optimizer cannot be 'elastic' (it adds the push to the "
                               "parameters; a pseudo-gradient is subtracted): for plain averaging use "
                               "{'name': 'sgd', 'lr': 1.0}")
    if asynchronous and isinstance(spec, dict) and "staleness_aware" not in spec \
            and "staleness_aware" in optim.SPECS.get(spec.get("name"), {}):
        spec["staleness_aware"] = True
    return optim.normalize(spec, "DiLoCo outer optimizer")


class DiLoCo:
    """One rank's DiLoCo rounds against the store; see the module docstring."""

    def __init__(self, client: Client, prefix: str, params: Mapping[str, np.ndarray], rank: int = 0,
                 world_size: int = 1, sync_every: int = 100, outer: dict | None = None, fragments: int = 1,
                 asynchronous: bool = False, step_timeout: float = 10.0, compress: str | None = None,
                 warmup: int = 0, overlap: bool = False):
        for what, value, low in (("sync_every (H)", sync_every, 1), ("world_size", world_size, 1),
                                 ("fragments", fragments, 1), ("warmup", warmup, 0)):
            if type(value) is not int or value < low:
                raise ValueError(f"DiLoCo: {what} must be an int >= {low}, got {value!r}")
        if type(rank) is not int or not 0 <= rank < world_size:
            raise ValueError(f"DiLoCo: rank must be an int in [0, world_size={world_size}), got {rank!r}")
        if isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float)) \
                or not (math.isfinite(step_timeout) and 0 <= step_timeout <= MAX_STEP_TIMEOUT):
            raise ValueError(f"DiLoCo: step_timeout must be seconds in [0, {MAX_STEP_TIMEOUT:g}], got {step_timeout!r}")
        if compress not in (None, "none", "fp16", "int8"):
            raise ValueError(f"DiLoCo: compress must be None, 'fp16' or 'int8', got {compress!r}")
        if type(overlap) is not bool:
            raise ValueError(f"DiLoCo: overlap must be True or False, got {overlap!r}")
        self.outer = outer_spec(outer, bool(asynchronous))
        self.init = _checked_params(prefix, params)
        names = list(self.init)
        if fragments > len(names):
            raise ValueError(f"DiLoCo: fragments={fragments} exceeds the {len(names)} tensors: a fragment "
                             "is one or more whole tensors")
        self.client, self.prefix, self.rank, self.world_size = client, prefix, rank, world_size
        self.sync_every, self.asynchronous, self.step_timeout = sync_every, bool(asynchronous), float(step_timeout)
        self.warmup = warmup
        self.compress = compress if compress in ("fp16", "int8") else None
        self.overlap = overlap
        self.fragments = [[names[i] for i in part]
                          for part in split_fragments([self.init[n].nbytes for n in names], fragments)]
        self.jobs = [jobs.diloco_job(prefix, f, fragments) for f in range(fragments)]   # each fragment's round sequence
        self.counter = jobs.diloco_rounds(prefix, rank, fragments)
        scale = max(1, world_size - 1) if self.outer.get("staleness_aware") else 1
        self.push_scale = scale / world_size        # asynchronous: see the module docstring
        self.next_round = [0] * fragments           # per fragment: the round this rank contributes to next
        self.anchor: dict[str, np.ndarray] = {}     # global values at the start of each fragment's round
        self.base: list[Any] = [None] * fragments   # asynchronous: store version of each fragment's anchor
        self.rounds: list[Round] = []               # what the last after_inner_step synced
        self.bytes_sent = 0
        self.version: Any = None                    # the newest store version this rank has seen
        # overlap: fragment -> (its round's answer to come, the local values it was sent from, the
        # step they were taken at); one sender thread, so the client is used by one thread at a time
        self.in_flight: dict[int, tuple[Future, dict[str, np.ndarray], int]] = {}
        self.last_step = -1
        self._sender: ThreadPoolExecutor | None = None

    # ---- schedule ------------------------------------------------------------------------------

    def offset(self, fragment: int) -> int:
        return fragment * self.sync_every // len(self.fragments)

    def round_start(self, fragment: int, round_: int) -> int:
        """Inner steps taken before round ``round_`` of ``fragment`` begins."""
        if round_ <= self.warmup:
            return round_
        return self.warmup + (round_ - self.warmup) * self.sync_every + self.offset(fragment)

    def due(self, step: int) -> list[int]:
        """The fragments whose round ends with inner step ``step`` (0-based)."""
        taken = step + 1
        if taken <= self.warmup:
            return list(range(len(self.fragments)))
        since = taken - self.warmup
        return [f for f in range(len(self.fragments))
                if since - self.offset(f) >= self.sync_every and (since - self.offset(f)) % self.sync_every == 0]

    def store_name(self, name: str) -> str:
        return jobs.tensor(self.prefix, name)

    # ---- I/O -----------------------------------------------------------------------------------

    def create(self) -> list[str]:
        """Rank 0 creates the job's global tensors from the constructor's ``params`` (tensors that
        exist are left as they are); asynchronous, every rank creates its round counter. The other
        ranks then wait until the global tensors exist (TimeoutError naming the job after
        job_steps.CREATOR_WAIT s): K ranks each sending the whole model put K models' bytes on the
        store's link. Returns the names created."""
        shared = {self.store_name(n): (a, self.outer) for n, a in self.init.items()}
        own = {self.counter: (np.zeros(len(self.fragments), np.float64), COUNTER_SPEC)} if self.asynchronous else {}
        created = create_chunked(self.client, {**shared, **own} if self.rank == 0 else own)
        if self.rank != 0:
            wait_for_tensors(self.client, list(shared), CREATOR_WAIT, self.prefix)
        return created

    def resume(self) -> tuple[int, dict[str, np.ndarray]]:
        """Where this rank starts: (the inner step to start at, the global parameters by name).
        The rounds applied are read before the parameters, so the parameters are never older
        than the rounds they count (if a round applies in between, this rank's contribution to
        it is answered late and it rejoins at the next)."""
        if self.asynchronous:
            tensors, _ = self.client.pull([self.counter])
            self.next_round = [int(x) for x in tensors[self.counter]]
        else:
            self.next_round = [self.client.sync_applied(job) + 1 for job in self.jobs]
        names = [n for part in self.fragments for n in part]
        tensors, version = self.client.pull([self.store_name(n) for n in names])
        self.anchor = {n: tensors[self.store_name(n)] for n in names}
        self.base = [version] * len(self.fragments)
        self.version = version
        start = max(self.round_start(f, r) for f, r in enumerate(self.next_round))
        return start, {n: np.array(a) for n, a in self.anchor.items()}

    def after_inner_step(self, step: int, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Call after inner step ``step`` (0-based, as counted from ``resume``'s start). At a round's
        end, sync the fragment(s) due and return their new global values (writeable arrays by
        name); otherwise None and no I/O. With ``overlap``: the rounds whose answers have arrived
        are applied (their fragments' values returned, see the module docstring) and the rounds
        due are sent in the background."""
        due = self.due(step)
        self.rounds = []
        self.last_step = step
        out = {f: None for f, (future, _, _) in self.in_flight.items() if future.done() or f in due}
        if not due and not out:
            return None
        if not self.anchor:
            raise RuntimeError("DiLoCo: call resume() before the first inner step")
        values: dict[str, np.ndarray] = {}
        for f in sorted(out):
            values.update(self._applied(f, {**params, **values}))
        for f in due:
            current = {**params, **values}
            if self.overlap:
                self._send_in_background(f, current, step)
            else:
                values.update(self._finish(f, self._round(f, *self._outgoing(f, current))))
        return values or None

    def ready(self) -> bool:
        """Overlap: whether a round's answer has arrived and waits for ``after_inner_step``."""
        return any(future.done() for future, _, _ in self.in_flight.values())

    def finish(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Wait for every round in flight (overlap) and return their fragments' values, applied to
        ``params`` (the local values now); {} when none is in flight."""
        self.rounds = []
        values: dict[str, np.ndarray] = {}
        for f in sorted(self.in_flight):
            values.update(self._applied(f, {**params, **values}))
        return values

    def close(self) -> None:
        """Stop the overlap's sender thread (a round it is sending is finished first)."""
        if self._sender is not None:
            self._sender.shutdown(wait=True)
            self._sender = None

    def _send_in_background(self, f: int, params: Mapping[str, np.ndarray], step: int) -> None:
        snapshot = {n: np.array(params[n]) for n in self.fragments[f]}
        outgoing = self._outgoing(f, snapshot)
        if self._sender is None:
            self._sender = ThreadPoolExecutor(1, thread_name_prefix=f"diloco-{self.prefix}-{self.rank}")
        self.in_flight[f] = (self._sender.submit(self._round, f, *outgoing), snapshot, step)

    def _applied(self, f: int, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Fragment ``f``'s round in flight, waited for and applied: x_g + (x_local - x_snapshot)."""
        future, snapshot, step = self.in_flight.pop(f)
        new = self._finish(f, future.result())
        if step == self.last_step:              # no inner step since the snapshot: the store's bits
            return new
        return {n: np.add(new[n], np.subtract(np.asarray(params[n]), snapshot[n])) for n in new}

    def _outgoing(self, f: int, params: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
        """Fragment ``f``'s pseudo-gradients by store name (asynchronous: times the push scale), as
        they are sent (compressed with ``compress``), and their encoding (empty when sent as
        they are)."""
        scale = self.push_scale if self.asynchronous else 1.0
        grads: dict[str, np.ndarray] = {}
        encoding: dict[str, dict] = {}
        for n in self.fragments[f]:
            g = _pseudo_gradient(self.anchor[n], params[n], n)
            if scale != 1:
                np.multiply(g, g.dtype.type(scale), out=g)
            if self.compress == "fp16":
                g, encoding[self.store_name(n)] = encode_fp16(g)
            elif self.compress == "int8":
                g, encoding[self.store_name(n)] = encode_int8(g)
            grads[self.store_name(n)] = g
        return grads, encoding

    def _round(self, f: int, grads: dict[str, np.ndarray], encoding: dict[str, dict]) -> tuple:
        """Fragment ``f``'s round on the wire (no state of this object changes here: it may run on
        the sender thread): (new global tensors by store name, version, Round, next round)."""
        sent = sum(g.nbytes for g in grads.values()) + sum(8 * len(e.get("scales", ())) for e in encoding.values())
        round_ = self.next_round[f]
        if self.asynchronous:
            count = np.zeros(len(self.fragments), np.float64)
            count[f] = -1.0                                  # the counter's sgd lr 1 adds one
            version = self.client.push({**grads, self.counter: count}, base_version=self.base[f],
                                       encoding=encoding or None)
            tensors, version = self.client.pull(list(grads), min_version=version)
            return tensors, version, Round(f, round_, 1, False, sent), round_ + 1
        answer = self.client.push_step(grads, round_, self.world_size, job=self.jobs[f], rank=self.rank,
                                       timeout=self.step_timeout, pull=True, encoding=encoding or None)
        late = bool(answer.get("late"))
        tensors, version, next_round = answer.get("tensors") or {}, answer["version"], round_ + 1
        if late:        # left out: rejoin at the store's next round, from the newest values
            next_round = self.client.sync_applied(self.jobs[f]) + 1
            tensors, version = self.client.pull(list(grads))
        elif not set(grads) <= set(tensors):           # a contribution sent again: read them
            tensors, _ = self.client.pull(list(grads), min_version=answer["version"], linearizable=False)
        return tensors, version, Round(f, round_, int(answer.get("count", 0)), late, sent), next_round

    def _finish(self, f: int, result: tuple) -> dict[str, np.ndarray]:
        tensors, version, round_, next_round = result
        self.version = version
        if self.asynchronous:
            self.base[f] = version
        self.next_round[f] = next_round
        self.rounds.append(round_)
        self.bytes_sent += round_.bytes
        return self._install(self.fragments[f], tensors)

    def _install(self, names: list[str], tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for n in names:
            self.anchor[n] = tensors[self.store_name(n)]
        return {n: np.array(self.anchor[n]) for n in names}


def _pseudo_gradient(anchor: np.ndarray, local: np.ndarray, name: str) -> np.ndarray:
    local = np.asarray(local)
    if local.shape != anchor.shape or local.dtype != anchor.dtype:
        raise ValueError(f"DiLoCo: parameter {name!r} is {local.dtype}{list(local.shape)}, its global value "
                         f"{anchor.dtype}{list(anchor.shape)}")
    return np.subtract(anchor, local)


def _checked_params(prefix: Any, params: Any) -> dict[str, np.ndarray]:
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"DiLoCo: prefix must be a non-empty string, got {prefix!r}")
    if not isinstance(params, Mapping) or not params:
        raise ValueError("DiLoCo: params must be a non-empty mapping of names to float32/float64 arrays")
    out = {}
    for name, arr in params.items():
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(jobs.tensor(prefix, name)):
            raise ValueError(f"DiLoCo: {prefix!r}/{name!r} is not a store name (1-200 characters from "
                             "[A-Za-z0-9_.:/-])")
        arr = np.asarray(arr)
        if arr.dtype not in DTYPES:
            raise ValueError(f"DiLoCo: parameter {name!r} is {arr.dtype}; the store holds float32 or float64")
        out[name] = arr
    return out
