"""Synchronous steps, one rank's side: each rank sends the mean gradient of its shard of the
step's batch with its rank; the store applies the mean of the ranks' contributions once, in the
job's own step sequence (K equal shards: the full batch's mean gradient, the step one process
would take). The leader sums a step's contributions and replicates the step once
(``Client.push_step``); a step whose last rank has not arrived ``step_timeout`` seconds after
its latest contribution (a dead worker) applies with those that did. A rank's second
contribution to a step (a restarted worker) is ignored; a contribution that comes after its step applied (``late``)
rejoins at the job's next step. A step that any rank skips (``skip``: its GradScaler found an
inf) applies no gradient, only the running statistics' drift; every rank's result says
``skipped`` (aggregate.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from raftps.client.step_stream import StepStream, plan_chunks
from raftps.modes.link import StoreLink


@dataclass
class StepResult:
    """What one synchronous step gave back."""
    tensors: dict[str, np.ndarray]      # the step's values of the names asked for
    version: Any
    count: int                          # contributions in the applied step (< world size: some were late)
    grad_norm: float | None             # with clip_norm: the mean gradient's norm
    next_step: int                      # the step to contribute to next (past the job's, if this one was late)
    skipped: bool = False               # a rank skipped the step: no gradient was applied


class SyncSteps:
    """Job ``job``'s steps (None: the store-wide default job) for rank ``rank`` of ``world_size``."""

    def __init__(self, link: StoreLink, job: str | None, world_size: int, rank: int, step_timeout: float,
                 skip_flags: Iterable[str] = (), chunk_bytes: int = 0, pairs: bool = False,
                 stream_runs: list[list[str]] | None = None):
        self.link, self.job = link, job
        self.world_size, self.rank, self.step_timeout = world_size, rank, step_timeout
        self.skip_flags = list(skip_flags)    # jobs.skip_flag per Raft group: every contribution carries them
        self.chunk_bytes = chunk_bytes        # push_step's: each part streamed in chunks (every rank the same)
        self.pairs = pairs                    # push_step's: partners add up half the chunks each (needs chunk_bytes)
        self.stream_runs = stream_runs        # overlap: the step streamed in chunks planned over these runs of names
        self.stream: StepStream | None = None  # made by resume (the plan needs the tensors' shapes)

    def applied(self) -> int:
        """The job's last applied step (-1 if none), read linearizably."""
        return self.link.client.sync_applied(self.job)

    def resume(self, names: list[str]) -> tuple[dict[str, np.ndarray], int]:
        """The newest values of ``names`` and the step to contribute to first: the job's next.
        The applied step is read before the values, so they are never older than the steps it
        counts (a step applied in between answers this rank's contribution late: it rejoins)."""
        if self.chunk_bytes:           # the job's steps in chunks: the lowest step every chunk applied
            prefix = os.path.commonprefix(sorted(names + self.skip_flags))
            rows = {row["name"]: row for row in self.link.client.tensors(prefix)}
            sizes = {n: (tuple(rows[n]["shape"]), rows[n]["dtype"]) for n in names if n in rows}
            if self.stream_runs is not None:
                sizes.update({f: ((1,), "float32") for f in self.skip_flags})
                plan = plan_chunks(self.link.client, sizes, self.stream_runs, self.chunk_bytes)
                self.stream = self.link.client.step_stream(self.job, self.world_size, self.rank, self.step_timeout, plan,
                                                           sizes, pairs=self.pairs)
            else:
                self.link.client.expect_chunks(self.job, sizes, self.chunk_bytes)
        first = self.applied() + 1
        tensors, _ = self.link.resume(names)
        return tensors, first

    def step(self, grads: dict[str, np.ndarray], step: int, names: list[str], hyper: dict | None = None,
             clip_norm: float | None = None, skip: bool = False) -> StepResult:
        """Contribute ``grads`` to step ``step`` (``skip``: this rank skips it; its gradients are not
        read); answered once the step is applied, with the step's values of ``names`` (in the
        answer, or pulled from a node that has the step)."""
        client = self.link.client
        grads = {**grads, **{flag: np.array([1.0 if skip else 0.0], np.float32) for flag in self.skip_flags}}
        with self.link.timing("push"):
            answer = client.push_step(grads, step, self.world_size, job=self.job, rank=self.rank,
                                      timeout=self.step_timeout, pull=True, hyper=hyper or None, clip_norm=clip_norm,
                                      chunk_bytes=self.chunk_bytes, pairs=self.pairs)
        return self.answered(answer, step, names)

    def answered(self, answer: dict, step: int, names: list[str]) -> StepResult:
        """The StepResult of step ``step`` from push_step's reply (or a StepStream's, overlap)."""
        next_step = step + 1
        if answer.get("late"):     # applied without us (we were away): rejoin at the job's next step
            next_step = max(step, self.applied()) + 1
        tensors, version = answer.get("tensors") or {}, answer["version"]
        self.link.version = self.link.pushed = version
        if not set(names) <= set(tensors):       # e.g. the answer to a contribution sent again
            with self.link.timing("pull"):
                tensors = self.link.pull(names)
        return StepResult(tensors, self.link.version, int(answer.get("count", 0)), answer.get("grad_norm"), next_step,
                          bool(answer.get("skipped")))
