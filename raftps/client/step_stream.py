"""A synchronous step sent chunk by chunk while its gradients are still being made (raftps.torch's
sync ``overlap=True``: raftps/torch/overlap.py makes the chunks ready from backward's hooks).

The chunks are planned once per job (``plan_chunks``): per Raft group, runs of names (the
gradients in the order backward makes them, then the buffers) packed in chunks of whole tensors
of up to ``chunk_bytes``, a run starting a chunk of its own, the group's skip flags in every
chunk. Chunk ``c`` of a group is sent as push_step's chunked steps send theirs: its own
aggregation unit under job ``job_steps.chunk_job(job, c)``, with the step's number and the
rank, so the store and its exactly-once are those of ``Client.push_step(..., chunk_bytes=...)``;
a tensor's sum is the K ranks' in rank order whatever chunk holds it, so the bits are the same.
Only the chunking order differs (backward's, where push_step's is name order), and every rank of
a job must plan the same.

``StepStream.ready(c, tensors)`` puts a chunk on the client's lanes at once; a chunk goes after
the one before it in its group (it is submitted after it, and its bytes wait until that one's
last byte left, as push_step's chunks do), so ready chunks wait for an earlier one that is not
(a parameter without a gradient holds its chunk, and those after it, until ``finish``).
``finish()`` waits for every chunk's answer and gives push_step's reply.

With ``pairs`` (push_step's, pair_steps.py): ranks 2i and 2i + 1 split the plan's chunks in two
halves of equal bytes; a ready chunk of the partner's half goes to the partner (a thread of its
own sends it), one of this rank's half goes on a lane, where it waits for the partner's, and
their sum goes to the store; the answers are relayed as pair_steps.py relays them.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from raftps.client.job_steps import chunk_job, send_in_chunk_order
from raftps.client.pair_steps import _PairStep, halves
from raftps.client.router import merge, merge_same_group
from raftps.jobs import is_skip_flag


@dataclass(frozen=True)
class Chunk:
    group: int            # its Raft group
    index: int            # its chunk in that group: job chunk_job(job, index)
    names: tuple[str, ...]  # its tensors (not the skip flags)
    flags: tuple[str, ...]  # the group's skip flags, in every chunk


def plan_chunks(client: Any, sizes: dict[str, tuple[tuple[int, ...], str]], runs: list[list[str]],
                chunk_bytes: int) -> list[Chunk]:
    """The chunks of a job's steps, in the order ``runs`` (lists of names of ``sizes``: {name:
    (shape, dtype)}; skip flags among ``sizes`` go in every chunk of their group) name them:
    chunk 0 of each group holds the first names of the first run it has names of."""
    if chunk_bytes <= 0:
        raise ValueError(f"a streamed step needs chunk_bytes > 0, got {chunk_bytes}")
    shaped = {name: np.broadcast_to(np.zeros((), dtype), shape) for name, (shape, dtype) in sizes.items()}
    group_of = {n: client.group_of(n) if client.groups() > 1 else 0 for n in sizes}
    flags: dict[int, tuple[str, ...]] = {}
    for name in sorted(n for n in sizes if is_skip_flag(n)):
        flags[group_of[name]] = flags.get(group_of[name], ()) + (name,)
    listed = [n for run in runs for n in run]
    missing = sorted(set(sizes) - set(listed) - {n for f in flags.values() for n in f})
    if missing or len(set(listed)) != len(listed) or not set(listed) <= set(sizes):
        raise ValueError(f"plan_chunks: the runs must name every tensor once (missing {missing[:3]})")
    out: list[Chunk] = []
    count: dict[int, int] = {}
    for run in runs:
        open_chunk: dict[int, tuple[list[str], int]] = {}    # group -> (names, bytes) of the chunk being filled
        for name in run:
            g = group_of[name]
            names, size = open_chunk.get(g, ([], 0))
            nbytes = shaped[name].dtype.itemsize * int(np.prod(shaped[name].shape, dtype=np.int64))
            if names and size + nbytes > chunk_bytes:
                out.append(Chunk(g, count.get(g, 0), tuple(names), flags.get(g, ())))
                count[g] = count.get(g, 0) + 1
                names, size = [], 0
            open_chunk[g] = (names + [name], size + nbytes)
        for g, (names, _) in open_chunk.items():        # the run's last chunk of each group
            out.append(Chunk(g, count.get(g, 0), tuple(names), flags.get(g, ())))
            count[g] = count.get(g, 0) + 1
    return out


class StepStream:
    """Job ``job``'s steps of rank ``rank`` of ``workers``, in the chunks ``plan``, on ``client``'s
    lanes. One step at a time: ``begin``, ``ready`` for each chunk (any order), ``finish``."""

    def __init__(self, router: Any, submit: Any, steps: Any, pair_steps: Any, job: str | None, workers: int,
                 rank: int, timeout: float, plan: list[Chunk], sizes: dict[str, tuple[tuple[int, ...], str]] | None = None):
        self._router, self._submit, self._steps = router, submit, steps
        self._pairs = pair_steps           # push_step's pairs (pair_steps.py), chunk by chunk; None: unpaired
        pairs = pair_steps is not None
        self.job, self.workers, self.rank, self.timeout, self.plan = job, workers, rank, timeout, plan
        self._steps.expect_chunk_counts(job, {c.group: c.index + 1 for c in plan})
        self._chunk_of = {n: c.index for c in plan for n in c.names}
        # a pair's items: each chunk's (group, tensors), shaped zeros until the chunk is ready
        self._shapes = [(c.group, {**{n: np.broadcast_to(np.zeros((), sizes[n][1]), sizes[n][0]) for n in c.names},
                                   **{f: np.zeros(1, np.float32) for f in c.flags}}) for c in plan] if pairs else []
        self._lock = threading.Lock()
        self.step: int | None = None          # the step on its way, None between steps
        self._pair: Any = None                # this step's pair_steps._PairStep, when paired

    def begin(self, step: int, hyper: dict[str, dict] | None) -> None:
        with self._lock:
            if self.step is not None:
                raise RuntimeError(f"sync step {step}: step {self.step}'s chunks are still on their way "
                                   "(its optimizer.step() did not run)")
            self.step, self.hyper = int(step), dict(hyper or {})
            self._futures: list[Future] = []
            self._held: dict[int, dict[str, np.ndarray]] = {}      # ready, waiting for an earlier chunk of its group
            self._next = {c.group: 0 for c in self.plan}           # per group: the next chunk to submit
            self._sent_events = {(c.group, c.index): threading.Event() for c in self.plan}
            self._submitted: set[int] = set()
            self._pair = self._pair_step() if self._pairs is not None else None

    def _pair_step(self) -> Any:
        """This step's half of a pair (None: unpaired, an odd world's last rank or a partner lost)."""
        link = self._pairs.link(self.job, self.rank, self.workers, self.timeout)
        if link is None:
            return None
        lower = self.rank - self.rank % 2
        chunk_of = {**{f: 0 for c in self.plan for f in c.flags}, **self._chunk_of}
        pair = _PairStep(self._pairs, link, list(self._shapes), chunk_of, self.step, self.workers, self.job, self.rank,
                         lower, self.timeout, self.hyper or None)
        pair.owners = halves(self._shapes, lower)
        pair.start()
        return pair

    def ready(self, i: int, tensors: dict[str, np.ndarray]) -> None:
        """Chunk ``plan[i]``'s tensors (its names; the skip flags are added, as 0: not skipped) are final."""
        chunk = self.plan[i]
        with self._lock:
            if self.step is None:
                raise RuntimeError("StepStream.ready before begin")
            if i in self._submitted or i in self._held:
                raise RuntimeError(f"sync step {self.step}: chunk {chunk.index} of Raft group {chunk.group} made ready twice")
            part = {n: np.asarray(tensors[n]) for n in chunk.names}
            part.update({flag: np.zeros(1, np.float32) for flag in chunk.flags})
            if self._pair is not None:         # paired: this rank's half to the store, the other to the partner
                self._pair.items[i] = (chunk.group, part)
                self._submitted.add(i)
                if self._pair.owners[i] == self.rank:
                    self._futures.append(self._pair.own(i))
                else:
                    self._pair.hand(i)
                return
            self._held[i] = part
            self._submit_in_order(chunk.group)

    def _submit_in_order(self, g: int) -> None:
        by_index = {c.index: i for i, c in enumerate(self.plan) if c.group == g}
        while self._next[g] in by_index and by_index[self._next[g]] in self._held:
            i = by_index[self._next[g]]
            part = self._held.pop(i)
            self._futures.append(self._router.submit_part(self._write, g, part, self._submit))
            self._submitted.add(i)
            self._next[g] += 1

    def _write(self, g: int, part: dict[str, np.ndarray], call: Any) -> dict:
        c = max(self._chunk_of[n] for n in part if not is_skip_flag(n))
        fields: dict[str, Any] = {"step": self.step, "workers": int(self.workers), "rank": int(self.rank),
                                  "timeout": float(self.timeout), "pull": True}
        name = chunk_job(self.job, c)
        if name is not None:
            fields["job"] = name
        hyper = {k: v for k, v in self.hyper.items() if k in part}
        if hyper:
            fields["hyper"] = hyper
        return send_in_chunk_order(self._sent_events, g, c, self.timeout + self._router.timeout, lambda: self._router.write(
            "push_step", g, waits=self.timeout, call=call, tensors=part, **fields))

    def finish(self) -> dict:
        """Every chunk's answer (all must have been made ready), merged as push_step's reply."""
        with self._lock:
            if self.step is None:
                raise RuntimeError("StepStream.finish before begin")
            left = [i for i in range(len(self.plan)) if i not in self._submitted]
            futures, pair = list(self._futures), self._pair
        try:
            if left:
                raise RuntimeError(f"sync step {self.step}: chunks {left[:5]} of the plan were never made ready")
            if pair is not None:
                result = pair.finish(futures, [i for i, o in enumerate(pair.owners) if o != self.rank])
                groups = set(result["version"]) if isinstance(result["version"], dict) else {0}
                self._steps.note_replies(self.job, {c.group for c in self.plan}, groups)
                return result
            wait(futures)                # every chunk's outcome, before any error is raised
            replies: dict[int, dict] = {}
            for future in futures:
                for g, reply in future.result().items():
                    replies[g] = merge_same_group(replies[g], reply) if g in replies else reply
        finally:
            with self._lock:
                self.step, self._pair = None, None
        sent = {c.group for c in self.plan}
        self._steps.note_replies(self.job, sent, set(replies))
        result = merge(dict(sorted(replies.items())))
        if self._router.groups() == 1:       # one group's reply, as an unchunked step's: no {0: value} maps
            return {k: v[0] if isinstance(v, dict) and list(v) == [0] else v for k, v in result.items()}
        return result
