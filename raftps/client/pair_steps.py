"""Synchronous steps in pairs of ranks (push_step's ``pairs``): the links of the workers carry
the bytes of a ring all-reduce, and the store's links less (docs/design/write-path.md).

Ranks 2i and 2i + 1 are partners (peers.py connects them). A step's chunks (job_steps.chunk_plan,
the same on every rank) are split into two halves of equal bytes, one owned by each partner.
For each chunk of the partner's half, a rank sends its gradients to the partner; for each chunk
of its own half, it adds the partner's gradients to its own (the lower rank's first) and sends
that pair sum to the store as one contribution naming both ranks (``ranks``), then forwards the
store's answer (the chunk's new values) to the partner. So a rank sends M/2 to its partner, M/2
to the store and M/2 of answers to its partner, and receives as much: 1.5 M each way, a ring's
2 (K - 1) / K x M at K = 4. The three flows overlap: chunks go to the partner from one thread
while the rank's own chunks go to the store on the client's lanes as each partner chunk arrives.

Failures keep the store's guarantees (the store counts a contribution by the ranks it covers and
refuses one that covers a rank already counted, aggregate.py): a partner chunk that does not
arrive within the step's ``timeout`` (or a broken link) makes the rank send its own gradients
for that chunk alone, and stop pairing (the link is closed, so the partner stops too); a chunk
it could not hand to the partner goes to the store alone; an answer the partner does not relay
is read from the store once the step is applied. What a partner's death costs: the chunks this
rank had handed it are missing from that step (that step applies them with the contributions
that came, after its timeout), as a rank dying between groups costs today. Nothing is counted
twice and nothing acknowledged is lost. A rank whose partner died stays unpaired for the rest of
the job, and a rank that comes back (its first step > 0) looks for its partner only briefly
(RESUMED_PAIR_WAIT): so a partner's loss costs one step timeout, at the step it happened in, not
one at every return. The store leaves out a rank only after a step's timeout and then stops
waiting for it (aggregate.py): the chunks a rank had handed its dying partner make that step wait
once, and may leave the live rank known absent until its next contribution, which that leader
may find late for a chunk the other ranks completed first.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future, wait
from typing import Any, Callable

import numpy as np

from raftps.client import peers
from raftps.client.job_steps import JobSteps, chunk_job, chunk_plan
from raftps.client.router import Router, merge, merge_same_group
from raftps.jobs import is_skip_flag

log = logging.getLogger("raftps.client.pair_steps")
# How long a rank that joins a job already under way (its first step > 0: it came back) looks for
# its partner. The partner that stayed unpaired itself when the link broke and never pairs again,
# so waiting the step's timeout for it was a timeout lost at every return; two partners that
# restart together still find each other within this.
RESUMED_PAIR_WAIT = 2.0


def halves(items: list[tuple[int, dict[str, np.ndarray]]], lower: int) -> list[int]:
    """The owner (``lower`` or ``lower + 1``) of each chunk: each to the half with fewer bytes so
    far, the lower rank on a tie; the same on both partners."""
    owned = {lower: 0, lower + 1: 0}
    owners = []
    for _, part in items:
        owner = min(owned, key=lambda r: (owned[r], r))
        owned[owner] += sum(a.nbytes for a in part.values())
        owners.append(owner)
    return owners


def pair_sum(mine: dict[str, np.ndarray], theirs: dict[str, np.ndarray], i_am_lower: bool) -> dict[str, np.ndarray]:
    """The pair's sum of each tensor, the lower rank's gradient first."""
    first, second = (mine, theirs) if i_am_lower else (theirs, mine)
    return {name: np.add(first[name], second[name]) for name in mine}


class PairSteps:
    """A client's paired steps: per job, its link to the partner (made at the job's first paired
    step; None once unpaired: an odd world's last rank, no partner found, or the link lost)."""

    def __init__(self, client: Any, steps: JobSteps, router: Router, lock: threading.RLock,
                 submit: Callable[[Callable[[Any], dict]], Any]):
        self._client, self._steps, self._router, self._submit = client, steps, router, submit
        self._lock = lock                  # the client's: held for a request on its own connections
        self._links: dict[str, peers.PeerLink | None] = {}

    def link(self, job: str | None, rank: int, workers: int, timeout: float, step: int = 0) -> peers.PeerLink | None:
        if (job or "") not in self._links:
            timeout = timeout if step == 0 else min(timeout, RESUMED_PAIR_WAIT)
            pair = peers.pair_of(rank, workers)
            link = None
            if pair is not None:
                key = peers.pair_key(self._client.token, job, pair[0])
                make = peers.listen if rank == pair[0] else peers.connect
                link = make(self._client, job, pair[0], key, timeout)
                if link is None:
                    log.warning("rank %d of job %r: no partner within %g s; its steps go unpaired", rank, job, timeout)
            self._links[job or ""] = link
        link = self._links[job or ""]
        if link is not None and link.broken:
            self._links[job or ""] = link = None
        return link

    def close(self) -> None:
        for link in self._links.values():
            if link is not None:
                link.close()

    def contribute(self, grads: dict[str, np.ndarray], step: int, workers: int, job: str | None, rank: int,
                   timeout: float, chunk_bytes: int, hyper: dict | None = None) -> dict:
        extra = {"hyper": hyper} if hyper else {}
        link = self.link(job, rank, workers, timeout, step)
        if link is None:
            return self._steps.contribute("push_step", grads, step, workers, job, rank, waits=timeout,
                                          chunk_bytes=chunk_bytes, timeout=timeout, pull=True, **extra)
        grads = {k: np.asarray(v) for k, v in grads.items()}
        parts = self._router.split(grads) if self._router.groups() > 1 else {0: grads}
        chunk_of, items = chunk_plan(parts, chunk_bytes)
        self._steps.expect_chunks(job, {n: (a.shape, a.dtype.str) for n, a in grads.items()}, chunk_bytes)
        lower = rank - rank % 2
        owners = halves(items, lower)
        step_ = _PairStep(self, link, items, chunk_of, step, workers, job, rank, lower, timeout, hyper)
        return step_.run([i for i, o in enumerate(owners) if o == rank], [i for i, o in enumerate(owners) if o != rank])


class _PairStep:
    """One paired step of one rank (PairSteps.contribute)."""

    def __init__(self, pairs: PairSteps, link: peers.PeerLink, items: list, chunk_of: dict[str, int], step: int,
                 workers: int, job: str | None, rank: int, lower: int, timeout: float, hyper: dict | None):
        self.pairs, self.link, self.items, self.chunk_of = pairs, link, items, chunk_of
        self.step, self.workers, self.job, self.rank, self.lower = step, workers, job, rank, lower
        self.timeout, self.hyper = timeout, hyper
        self.item_of = {n: i for i, (_, part) in enumerate(items) for n in part if not is_skip_flag(n)}
        self.theirs: dict[int, dict[str, np.ndarray]] = {}     # the partner's gradients, by chunk
        self.replies: list[tuple[int, dict]] = []                # (group, answer) of every chunk
        self.handed: set[int] = set()

    def run(self, mine: list[int], theirs: list[int]) -> dict:
        self.start()
        for i in theirs:
            self.hand(i)
        return self.finish([self.own(i) for i in mine], theirs)

    # A step in pieces (run, or step_stream.py's overlap: each chunk as backward makes it):
    # start; hand(i) for each of the partner's chunks and own(i) for each of this rank's, in
    # any order, once ``items[i]`` holds its gradients; finish.

    def start(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._hand, daemon=True)
        self._sender.start()

    def hand(self, i: int) -> None:
        """The partner's chunk ``i``: to the partner, from the sender thread (a slow link must
        not hold the caller: backward's hooks, under overlap)."""
        self._queue.put(i)

    def own(self, i: int) -> Future:
        """This rank's chunk ``i``: on a lane, the pair's sum to the store once the partner's half is here."""
        g, part = self.items[i]
        return self.pairs._router.submit_part(self._write_own, g, part, self.pairs._submit)

    def finish(self, futures: list[Future], theirs: list[int]) -> dict:
        router = self.pairs._router
        self._queue.put(None)
        wait(futures)                   # every chunk's outcome, before any error is raised
        for future in futures:
            future.result()
        self._sender.join(self.timeout + router.timeout)
        # chunks not handed to the partner: this rank's gradients go alone
        alone = [(self.items[i][0], self.items[i][1]) for i in theirs if i not in self.handed]
        if alone:
            router.each_group_at_once(self._write_alone, alone, self.pairs._submit)
        missing = [i for i in theirs if i in self.handed and not self._relayed(i)]
        if missing:
            self._read_from_store(missing)
        replies: dict[int, dict] = {}
        for g, reply in self.replies:
            replies[g] = merge_same_group(replies[g], reply) if g in replies else reply
        result = merge(dict(sorted(replies.items())))
        if router.groups() == 1:
            return {k: v[0] if isinstance(v, dict) and list(v) == [0] else v for k, v in result.items()}
        return result

    def _hand(self) -> None:
        failed = False
        for _ in range(len(self.items) + 1):       # bounded: each chunk is handed at most once, then None
            i = self._queue.get()
            if i is None:
                return
            # after a failed send the rest go alone (finish)
            failed = failed or not self.link.send({"kind": "grads", "step": self.step, "item": i,
                                                   "tensors": self.items[i][1]})
            if not failed:
                self.handed.add(i)

    def _fields(self, part: dict, ranks: list[int]) -> dict:
        c = max(self.chunk_of[n] for n in part)
        fields: dict[str, Any] = {"step": int(self.step), "workers": int(self.workers), "timeout": float(self.timeout),
                                  "pull": True, "rank": ranks[0], **({"ranks": ranks} if len(ranks) > 1 else {})}
        name = chunk_job(self.job, c)
        if name is not None:
            fields["job"] = name
        if self.hyper:
            mine = {k: v for k, v in self.hyper.items() if k in part}
            if mine:
                fields["hyper"] = mine
        return fields

    def _send(self, g: int, part: dict, call: Any, tensors: dict, ranks: list[int]) -> dict:
        reply = self.pairs._router.write("push_step", g, waits=self.timeout, call=call, tensors=tensors,
                                         **self._fields(part, ranks))
        self.replies.append((g, reply))
        return reply

    def _write_own(self, g: int, part: dict, call: Any) -> dict:
        """A chunk of this rank's half: the pair's sum once the partner's gradients are here, else
        this rank's own (and pairing stops); the store's answer relayed to the partner."""
        i = self.item_of[next(n for n in part if not is_skip_flag(n))]
        if i not in self.theirs and not self.link.broken:
            got = self.link.take("grads", self.step, i, self.timeout)
            if got is not None and isinstance(got.get("tensors"), dict) and set(got["tensors"]) == set(self.items[i][1]):
                self.theirs[i] = got["tensors"]
            elif not self.link.broken:
                log.warning("rank %d: the partner's chunk %d of step %d did not come in %g s; unpaired from now on",
                            self.rank, i, self.step, self.timeout)
                self.link.close()
        theirs = self.theirs.get(i)
        try:
            if theirs is None:
                return self._send(g, part, call, part, [self.rank])
            reply = self._send(g, part, call, pair_sum(part, {n: theirs[n] for n in part}, self.rank == self.lower),
                               [self.lower, self.lower + 1])
        except Exception as exc:
            self.link.send({"kind": "answer", "step": self.step, "item": i, "failed": f"{type(exc).__name__}: {exc}"})
            raise
        self.link.send({"kind": "answer", "step": self.step, "item": i, "reply": reply})
        return reply

    def _write_alone(self, g: int, part: dict, call: Any) -> dict:
        return self._send(g, part, call, part, [self.rank])

    def _relayed(self, i: int) -> bool:
        """Whether the partner relayed chunk ``i``'s answer, of this very step (kept if so)."""
        router = self.pairs._router
        msg = self.link.take("answer", self.step, i, 2 * self.timeout + router.timeout)
        if msg is None and not self.link.broken:      # a partner that stopped answering: unpaired from now on
            self.link.close()
        reply = msg.get("reply") if msg else None
        if not isinstance(reply, dict) or reply.get("step") != self.step or not isinstance(reply.get("tensors"), dict) \
                or set(reply["tensors"]) < {n for n in self.items[i][1] if not is_skip_flag(n)}:
            return False
        self.replies.append((self.items[i][0], reply))
        return True

    def _read_from_store(self, missing: list[int]) -> None:
        """The new values of chunks whose answers the partner did not relay: once the step is
        applied (every chunk), read at its version from the leader of each chunk's group."""
        router = self.pairs._router
        versions = self.pairs._steps.wait(self.step, 2 * self.timeout + router.timeout, self.job)
        versions = versions if isinstance(versions, dict) else {0: versions}
        names: dict[int, set[str]] = {}
        for i in missing:                  # one read per group
            names.setdefault(self.items[i][0], set()).update(self.items[i][1])
        for g, wanted in sorted(names.items()):
            request = {"op": "pull", "names": sorted(wanted), "linearizable": False, "min_version": int(versions[g])}
            with self.pairs._lock:
                read = router.request(request, to_leader=False, raft_group=g)
            self.replies.append((g, {"version": read["version"], "step": self.step, "applied": True,
                                     "tensors": read["tensors"], "tensor_versions": read["tensor_versions"]}))
