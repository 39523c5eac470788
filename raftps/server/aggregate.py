"""Aggregation before replication for synchronous steps (Li et al., OSDI'14, section 4.3).

``push_sync`` replicates every contribution: K workers' gradients are K log entries and K
payloads sent to every follower before the step applies. ``push_step`` instead holds each
contribution in the leader's memory, adds it to its step's sum, and replicates one entry per
step (the sum, its count and every contributor's client id and seq: machine.py's ``step`` op)
once the K-th contribution is in, or once the step's timeout has passed since the latest (a
worker died). So a step costs one entry and one payload, whatever K.

Every contributor's request is answered when that entry is applied: an acknowledged
contribution is in the log. A contribution the leader holds when it loses leadership or dies is
never acknowledged: its request is answered Retry (or its connection breaks), and its worker
sends it again, same client id and seq, to the new leader, which aggregates the step afresh. The
entry records each contributor's answer in its session, so a contribution sent again after its
entry committed finds that answer instead of counting twice; one that arrives after its step was
applied without it is answered ``late`` through a small entry of its own.

The sum is taken on the leader and replicated as bits, so every replica applies the same mean.
It is added up in rank order (unranked steps: in the order of their contributors' client ids
and seqs) once the step is complete, never in arrival order: float addition is not
associative, and a sum in arrival order made the same job end at different bits run to run
(char GPT, 1,200 batches: validation loss 1.3514 in one run, 1.3321 in another). So the leader
holds every contribution of an open step until it proposes it: K times the model's bytes per
open step, where a running sum held one (at K = 4 and a 5.1 MB model, 20 MB per step; a
leader has at most ``max_open_steps`` open).

A contribution may cover two ranks (``ranks``: a pair's sum, client/pair_steps.py): it counts as
its ranks, sums at its lowest rank's place, and one that covers a rank already counted changes
nothing (answered ``duplicate_rank``, as a rank's second contribution is).

A step's ``timeout`` counts from its latest contribution, not its first: a contribution is
counted once its last byte has arrived, and on a slow link K contributions share the leader's
link for K times one's transfer time, so counting from the first dropped live ranks whose
bytes were still arriving. A rank is left out only once ``timeout`` s pass with no contribution
arriving: a rank whose bytes take longer than that alone on the link must be given a larger
timeout.

A rank left out of a step that way is then known absent for its job (absent_ranks.py; every
chunk job of a chunked step shares its job's set): the job's later ranked steps go out as soon
as every rank not known absent is in, and a step already waiting re-checks this each poll, so
once one chunk's timeout leaves a rank out the job's other chunks stop waiting for it too. Any
contribution from that rank, to any step, marks it present again, and the next step waits for
it. Only the wait changes: what is counted is still what the entry records (its contributors),
so exactly-once is untouched; an absent rank's contribution to a step already applied is
answered ``late``, as any late one is, and the rank rejoins at the next step. The set is this
leader's alone, not replicated, and dropped when its term changes: a new leader knows nobody
absent and waits one timeout. Without it every step of a job, and every chunk of each (in
series when there are more chunks than lanes), waited out the timeout for as long as a rank
was dead. Unranked steps keep the timeout alone: there is no rank to remember.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from raftps import compress, optim
from raftps.errors import ERRORS, InvalidRequest, LimitExceeded, RaftpsError, UnknownTensor
from raftps.jobs import MAX_STEP_TIMEOUT, is_skip_flag
from raftps.store.sync_jobs import sum_in_order
from raftps.tensor import check_fits
from raftps.raft import NotApplied
from raftps.server.absent_ranks import AbsentRanks, missing_ranks

if TYPE_CHECKING:
    from raftps.server.node import RaftNode

log = logging.getLogger("raftps.server.aggregate")
POLL = 0.1                    # how often a waiting contributor checks leadership and the deadline


@dataclass
class _Step:
    job: str
    step: int
    workers: int
    names: list[str]
    ranked: bool
    hyper: dict | None                                     # the step's hyperparameters, the same from every rank
    clip_norm: float | None                                # clip the mean gradient to this norm (all ranks agree)
    deadline: float                                        # time.monotonic() at which a missing worker is given up
    parts: dict[tuple, dict[str, np.ndarray]] = field(default_factory=dict)   # summing order -> contribution
    sums: dict[str, np.ndarray] = field(default_factory=dict)   # their sum, once the step is proposed
    contributors: list[list] = field(default_factory=list)  # [client, seq, ack, counted], arrival order
    pullers: set[int] = field(default_factory=set)            # contributors that want the new values back
    ranks: set[int] = field(default_factory=set)
    count: int = 0
    proposed: bool = False             # its entry is on its way (or it was given up): nothing joins it
    done: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None
    failure: Exception | None = None
    grad_norm: float | None = None     # the mean gradient's norm, when the step clips
    proposed_at: float | None = None   # time.monotonic() when its proposer began
    skipped: bool = False              # a contribution's skip flag (jobs.skip_flag) is set: no gradient applies

    def add(self, grads: dict[str, np.ndarray], ranks: list[int] | None, client: str = "", seq: int = 0) -> bool:
        """Hold a contribution for the sum (False: one of the ``ranks`` it covers had been counted,
        so it changes nothing). A pair's sum covers two ranks and counts two; it is summed at its
        lowest rank's place, so the bits do not depend on arrival order."""
        if ranks is not None and not self.ranks.isdisjoint(ranks):
            return False
        self.parts[(0, ranks[0], "", 0) if ranks is not None else (1, 0, client, seq)] = grads
        self.count += len(ranks) if ranks is not None else 1
        # A rank that skips the step (its GradScaler found an inf) says so in its skip flag: then
        # the step applies no gradient on any rank, as DDP's all-reduced inf skips it on all.
        self.skipped = self.skipped or any(is_skip_flag(name) and bool(np.any(grad != 0)) for name, grad in grads.items())
        if ranks is not None:
            self.ranks.update(ranks)
        return True

    def total(self) -> dict[str, np.ndarray]:
        """The contributions' sum, added in rank order: the same bits whatever order they arrived in."""
        return sum_in_order(self.parts)


class StepAggregator:
    """One Raft group replica's open sync steps, while it leads; see the module docstring."""

    def __init__(self, node: "RaftNode", max_open_steps: int = 64):
        self.node = node
        self.max_open_steps = max_open_steps     # each holds one copy of its step's gradients
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int], _Step] = {}
        self._absent = AbsentRanks()             # leader-local: ranks a job's steps no longer wait for

    def contribute(self, request: dict, grads: dict[str, np.ndarray]) -> dict:
        """Add one worker's contribution (a checked push_step request) and return its answer once
        its step's entry is applied. Raises RaftpsError (refused: nothing was proposed) or
        NotApplied (retry, same seq)."""
        job, step, workers = request.get("job") or "", request["step"], request["workers"]
        client, seq, ack = request["client"], request["seq"], request.get("ack", 1)
        timeout = min(float(request.get("timeout", 10.0)), MAX_STEP_TIMEOUT)
        self._drop_moved_steps()
        ranks = covered_ranks(request)
        if ranks is not None:        # heard from, even late: the job's next step waits for it again
            with self._lock:
                self._absent.observe_term(self._term())
                back = self._absent.mark_present(job, ranks)
            if back:
                log.info("sync job %r: ranks %s contribute again (step %d)", job, sorted(back), step)
        # references only: the checks below run outside the apply lock
        applied, tensors, misplaced = self.node.read_locked(lambda machine: (
            machine.sync_step_applied(job), {name: machine.tensors.get(name) for name in grads},
            machine.moves.placement_refusal(grads)))     # a tensor frozen or moved away (moves.py)
        if step <= applied:
            return self._late(job, step, workers, [client, seq, ack, False])
        if misplaced is not None:        # Moving / Moved: the client sends it again, by the new placement
            raise _refusal_error(misplaced)
        grads = _decoded(grads, request.get("encoding"), tensors)
        for name, grad in grads.items():
            check_fits(name, grad, tensors[name], "gradient")
        _check_hyper(request.get("hyper"), tensors)
        with self._lock:
            s = self._open.get((job, step))
            # applied meanwhile: its entry has left, and a new step would only wait out its timeout
            applied_meanwhile = s is None and step <= self.node.read_locked(lambda m: m.sync_step_applied(job))
            if not applied_meanwhile:
                s, mine, propose = self._join(s, request, grads, time.monotonic() + timeout)
        if applied_meanwhile:
            return self._late(job, step, workers, [client, seq, ack, False])
        if propose:
            self._propose(s)
        else:
            self._wait(s)
        if mine is None:          # the step's entry left without this contribution
            if s.failure is None:
                return self._late(job, step, workers, [client, seq, ack, False])
            raise NotApplied(f"sync step {step}: its entry did not commit; send again", applied=False)
        return self._answer(s, mine)

    def _join(self, s: _Step | None, request: dict, grads: dict[str, np.ndarray],
              deadline: float) -> tuple[_Step, int | None, bool]:
        """(caller holds the lock) Add a contribution to its step, opening it if needed: (the step,
        the contribution's place in it or None if the step's entry already left, propose now)."""
        job, step, workers = request.get("job") or "", request["step"], request["workers"]
        ranks = covered_ranks(request)
        client, seq, ack = request["client"], request["seq"], request.get("ack", 1)
        if s is None:
            if len(self._open) >= self.max_open_steps:
                raise LimitExceeded(f"{len(self._open)} sync steps are open on this leader (the limit); "
                                    "finish or close some first")
            s = self._open[(job, step)] = _Step(job, step, workers, sorted(grads), ranks is not None,
                                                  request.get("hyper"), request.get("clip_norm"), deadline)
        else:
            _check_matches(s, grads, workers, ranks, request)
            if not s.proposed:
                s.deadline = max(s.deadline, deadline)    # the timeout counts from the latest arrival
        mine = next((i for i, c in enumerate(s.contributors) if c[0] == client and c[1] == seq), None)
        if mine is None and not s.proposed:
            s.contributors.append([client, seq, ack, s.add(grads, ranks, client, seq)])
            mine = len(s.contributors) - 1
        if mine is not None and request.get("pull"):
            s.pullers.add(mine)
        propose = not s.proposed and (s.count >= s.workers or self._absent_complete(s))
        s.proposed = s.proposed or propose
        return s, mine, propose

    def _wait(self, s: _Step) -> None:
        """Until ``s`` is settled: its entry applied or failed, or this node no longer leads (then
        its contributions are given back to be sent again), or its deadline passed or every rank
        it misses is known absent (then the contributions that arrived go out as the step)."""
        while not s.done.wait(POLL):
            now = time.monotonic()
            # A proposer replicating the step on a slow link takes as long as the bytes need.
            give_up = (s.proposed_at + MAX_STEP_TIMEOUT if s.proposed_at is not None
                       else s.deadline + 2 * self.node.config.request_timeout + 5.0)
            if now > give_up:        # its proposer is stuck: the contributor may retry, outcome unknown
                raise NotApplied(f"sync step {s.step}: its entry was not settled in time", applied=None)
            self._drop_moved_steps()
            if s.done.is_set():
                break
            if not self.node.is_leader():
                self._abandon(s, "this node stopped leading while the step was open")
            else:
                self._propose_if_due(s, now)

    def _propose_if_due(self, s: _Step, now: float) -> None:
        """Propose an open step whose deadline passed (its missing ranks are then known absent)
        or whose missing ranks are all known absent already (another chunk's timeout, say)."""
        with self._lock:
            timed_out = now >= s.deadline
            go = not s.proposed and (timed_out or self._absent_complete(s))
            s.proposed = s.proposed or go
            missing = missing_ranks(s.workers, s.ranks) if go and s.ranked else set()
            if go and timed_out:
                self._absent.mark_absent(s.job, missing)
        if not go:
            return
        if timed_out:
            log.info("sync step %d of %r: %d of %d contributions after its timeout; applying those%s",
                     s.step, s.job, s.count, s.workers, f" (ranks {sorted(missing)} now absent)" if missing else "")
        self._propose(s)

    def _absent_complete(self, s: _Step) -> bool:
        """(caller holds the lock) A ranked step whose missing ranks are all known absent."""
        if not s.ranked:
            return False
        self._absent.observe_term(self._term())
        return self._absent.complete(s.job, s.workers, s.ranks)

    def _term(self) -> object:
        return getattr(self.node.log, "term", None)

    def _propose(self, s: _Step) -> None:
        s.proposed_at = time.monotonic()
        s.sums, s.parts = s.total(), {}
        command = {"op": "step", "job": s.job, "step": s.step, "workers": s.workers, "count": s.count,
                   "contributors": s.contributors}
        if s.hyper is not None and not s.skipped:
            command["hyper"] = s.hyper
        if s.skipped:       # only the elastic tensors (running statistics' drift, the skip flags) apply
            elastic = self._elastic(s)
            s.sums, command["skipped"] = {name: total for name, total in s.sums.items() if name in elastic}, True
        else:
            s.sums = {name: total for name, total in s.sums.items() if not is_skip_flag(name)}
        if s.clip_norm is not None and s.count and not s.skipped:
            self._clip(s)
        try:
            s.result = self.node.submit(command, s.sums, payload_name=f"step_{secrets.token_hex(8)}-{s.step}",
                                        on_applied=self._reader(s.names) if s.pullers else None)
        except (NotApplied, RaftpsError) as exc:
            s.failure = exc
        except Exception as exc:     # a bug must cost this step's contributors a retry, not hang them
            log.exception("sync step %d of %r failed", s.step, s.job)
            s.failure = NotApplied(f"sync step {s.step}: {exc!r}", applied=None)
        finally:
            with self._lock:
                if self._open.get((s.job, s.step)) is s:
                    del self._open[(s.job, s.step)]
                # Older open steps of the job can no longer apply (a step applies every earlier one).
                older = [o for (j, n), o in self._open.items() if j == s.job and n < s.step] \
                    if s.failure is None else []
            for o in older:
                self._abandon(o, f"a later step ({s.step}) was applied first")
            s.done.set()

    def _clip(self, s: _Step) -> None:
        """Clip the step's mean gradient as torch.nn.utils.clip_grad_norm_ clips the parameters'
        gradients: the norm over the gradients only, and the factor applied to them alone. The
        ``elastic`` tensors a step carries (a model's running statistics: their drift, averaged
        and added) are no gradients: never in the norm, never scaled. The leader scales the sums
        itself, so the entry carries the clipped sums as bits and every replica (of any version)
        applies them alike."""
        elastic = self._elastic(s)
        gradients = {name: total for name, total in s.sums.items() if name not in elastic}
        scale, s.grad_norm = clip_scale(gradients, s.count, s.clip_norm)
        if scale < 1.0:
            for name, total in gradients.items():
                s.sums[name] = np.asarray(total * total.dtype.type(scale))   # a 0-d product is a numpy scalar

    def _elastic(self, s: _Step) -> set[str]:
        """The step's tensors under the ``elastic`` rule: added, never a gradient."""
        return self.node.read_locked(lambda machine: {name for name in s.names if name in machine.tensors
                                                      and machine.tensors[name].optimizer["name"] == "elastic"})

    def _reader(self, names: list[str]) -> Any:
        """Called in the log's thread right after the step's entry applied: the step's tensors as
        that entry left them (frozen arrays, so the reply can be encoded after later applies)."""
        def read(result: Any) -> Any:
            if not isinstance(result, dict) or "error" in result or result.get("late"):
                return result
            tensors, _ = self.node.read_in_log_thread(lambda machine: machine.read([n for n in names
                                                                                   if n in machine.tensors]))
            return {**result, "tensors": {n: t.data for n, t in tensors.items()},
                    "tensor_versions": {n: t.version for n, t in tensors.items()}}
        return read

    def _abandon(self, s: _Step, why: str, failure: Exception | None = None) -> None:
        """Give an open step's contributions back to be sent again (a proposed step's proposer
        settles it instead)."""
        with self._lock:
            if s.proposed:
                return
            s.proposed = True
            if self._open.get((s.job, s.step)) is s:
                del self._open[(s.job, s.step)]
        s.failure = failure or NotApplied(f"sync step {s.step}: {why}; send the contribution again", applied=False)
        s.done.set()

    def _drop_moved_steps(self) -> None:
        """Give back the open steps that name a tensor frozen or moved away since they opened
        (moves.py): their contributors are told Moving (or Moved) and send their parts again by
        the new placement, so no step mixes the old placement with the new."""
        if not self.node.read_locked(lambda m: m.moves.anything_moved()):   # nothing was ever moved here
            return
        with self._lock:
            steps = [s for s in self._open.values() if not s.proposed]
        for s in steps:
            refusal = self.node.read_locked(lambda m: m.moves.placement_refusal(dict.fromkeys(s.names)))
            if refusal is not None:
                self._abandon(s, refusal["message"], _refusal_error(refusal))

    def _answer(self, s: _Step, mine: int) -> dict:
        if s.failure is not None:
            if isinstance(s.failure, RaftpsError) and not isinstance(s.failure, NotApplied):
                s.failure.submitted = True
            raise s.failure
        result = s.result
        each = result.get("each") if isinstance(result, dict) else None
        if isinstance(each, list) and mine < len(each):
            answer = each[mine]
            if s.grad_norm is not None and "error" not in answer:
                answer = {**answer, "grad_norm": s.grad_norm}
            if mine in s.pullers and "tensors" in result and "error" not in answer:
                return {**answer, "tensors": result["tensors"], "tensor_versions": result["tensor_versions"]}
            return answer
        return {k: v for k, v in result.items() if k not in ("each", "tensors", "tensor_versions")}   # an error

    def _late(self, job: str, step: int, workers: int, contributor: list) -> dict:
        """The answer to a contribution to a step already applied: its session's record if its
        entry had it, else ``late``; through a small entry, so the answer is in the log."""
        command = {"op": "step", "job": job, "step": step, "workers": workers, "count": 0,
                   "contributors": [contributor]}
        result = self.node.submit(command)
        each = result.get("each") if isinstance(result, dict) else None
        return each[0] if isinstance(each, list) and each else result

    def open_steps(self) -> int:
        with self._lock:
            return len(self._open)


def _refusal_error(refusal: dict) -> RaftpsError:
    """The Moving or Moved exception of a placement refusal (moves.py)."""
    return ERRORS[refusal["error"]](refusal["message"], refusal.get("tensor"), refusal.get("group"))


def clip_scale(sums: dict[str, np.ndarray], count: int, max_norm: float) -> tuple[float, float]:
    """(the factor that clips the step's mean gradient to ``max_norm``, the mean's L2 norm over
    the gradients in ``sums``), as torch.nn.utils.clip_grad_norm_ computes them. Taken on the leader
    only, so replicas never compute a norm (a reduction's order is not the same on every machine)."""
    squares = 0.0
    for name in sorted(sums):
        flat = sums[name].reshape(-1).astype(np.float64)
        squares += float(np.dot(flat, flat))
    norm = (squares ** 0.5) / count
    return min(1.0, max_norm / (norm + 1e-6)), norm


def _check_hyper(hyper: Any, tensors: dict) -> None:
    """Refuse a contribution whose hyperparameters its tensors' optimizers would refuse."""
    if hyper is None:
        return
    stray = sorted(set(hyper) - set(tensors))
    if stray:
        raise InvalidRequest(f"'hyper' names {stray[:5]}, which this contribution does not carry")
    for name in sorted(hyper):
        optim.with_hyperparameters(tensors[name].optimizer, hyper[name], name)


def _decoded(grads: dict[str, np.ndarray], encoding: Any, tensors: dict) -> dict[str, np.ndarray]:
    """A contribution's gradients as arrays of their tensors' dtypes: fp16 and int8 are decoded
    here, per contribution, so the step's sum and its one entry are plain arrays (the state machine
    never sees the encoding). Only those two: top-k and rows carry index arrays that a step's dense
    sum and its entry do not take."""
    if encoding is None:
        return grads
    for name in sorted(grads):
        if tensors.get(name) is None:
            raise UnknownTensor(f"unknown tensor {name!r}")
    if isinstance(encoding, dict):          # any other shape: decode_push refuses it by name
        kinds = [(n, enc.get("kind")) for n, enc in encoding.items() if isinstance(enc, dict)]
        other = [(n, kind) for n, kind in kinds if kind in compress.KINDS and kind not in compress.DENSE_KINDS]
        if other:
            raise InvalidRequest(f"push_step: tensor {other[0][0]!r} is encoded as {other[0][1]}: "
                                 "a sync step takes fp16 or no encoding (or int8)")
    like = {name: t.data for name, t in tensors.items() if t is not None}
    return compress.decode_push(grads, encoding, like)


def covered_ranks(request: dict) -> list[int] | None:
    """The ranks a (checked) push_step request covers: its ``ranks`` (a pair's sum), else its
    ``rank`` alone; None when unranked."""
    if request.get("ranks"):
        return list(request["ranks"])
    return None if request.get("rank") is None else [request["rank"]]


def _check_matches(s: _Step, grads: dict[str, np.ndarray], workers: int, ranks: list[int] | None,
                   request: dict) -> None:
    who = f"ranks {ranks}" if ranks is not None else "this contribution"
    if request.get("hyper") != s.hyper:
        theirs, mine = s.hyper or {}, request.get("hyper") or {}
        name = next((n for n in sorted(set(theirs) | set(mine)) if theirs.get(n) != mine.get(n)), "?")
        raise InvalidRequest(f"sync step {s.step}: {who} carries hyperparameters {mine.get(name)} for {name!r}, "
                             f"the step's other contributions carry {theirs.get(name)}: every rank must step "
                             "with the same values (the same LR scheduler on every rank)")
    if request.get("clip_norm") != s.clip_norm:
        raise InvalidRequest(f"sync step {s.step}: {who} clips at {request.get('clip_norm')}, the step's other "
                             f"contributions at {s.clip_norm}")
    if sorted(grads) != s.names or workers != s.workers:
        raise InvalidRequest(f"sync step {s.step}: contribution for {sorted(grads)} with workers={workers} does "
                             f"not match {s.names} with workers={s.workers}")
    if s.ranked != (ranks is not None):
        raise InvalidRequest(f"sync step {s.step}: contributions with and without rank cannot be mixed")
    first = next(iter(s.parts.values()), {})
    for name, grad in grads.items():
        total = first.get(name)
        if total is not None and (grad.shape != total.shape or grad.dtype != total.dtype):
            raise InvalidRequest(f"sync step {s.step}: {name!r} is {grad.dtype}{list(grad.shape)}, the step's "
                                 f"other contributions are {total.dtype}{list(total.shape)}")
