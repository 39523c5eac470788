"""The ranks a leader knows to be absent from a synchronous job (aggregate.py's StepAggregator).

A rank left out of a step once its ``timeout`` passed (it died, or was preempted) is remembered
as absent for its job, so the job's later steps, every chunk of them, go out as soon as every
other rank is in instead of each waiting out the timeout again. Its next contribution, to any
step, marks it present, and the step after waits for it again. The set is the leader's alone
(never replicated, no part of any entry) and is dropped when the leader's term changes: a new
leader, or this one elected again, starts knowing nobody absent and waits one timeout.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

_CHUNK_SUFFIX = re.compile(r":chunk[0-9]+$")      # client/job_steps.py's chunk_job


def base_job(job: str) -> str:
    """The job a chunk job (``JOB:chunkN``, client/job_steps.py's ``chunk_job``) belongs to: all
    chunks of a job share its absent ranks, since a rank that sends none of one chunk sends none
    of the others."""
    return _CHUNK_SUFFIX.sub("", job)


def step_complete(workers: int, counted: Iterable[int], absent: Iterable[int]) -> bool:
    """Whether a ranked step of ``workers`` ranks need wait no longer: every rank is counted or
    known absent, and at least one is counted (a step carries a contribution)."""
    counted, absent = set(counted), set(absent)
    return bool(counted) and all(r in counted or r in absent for r in range(workers))


def missing_ranks(workers: int, counted: Iterable[int]) -> set[int]:
    """The ranks of a ``workers``-rank step that it goes out without."""
    return set(range(workers)) - set(counted)


class AbsentRanks:
    """Per base job, the ranks known absent, within one leader term. Not thread-safe: the
    aggregator calls it holding its lock."""

    def __init__(self) -> None:
        self._term: object = None
        self._by_job: dict[str, set[int]] = {}

    def observe_term(self, term: object) -> None:
        """Forget every absence when the term moves on (``None``: a log without terms, kept)."""
        if term is not None and term != self._term:
            self._term = term
            self._by_job.clear()

    def mark_absent(self, job: str, ranks: Iterable[int]) -> None:
        ranks = set(ranks)
        if ranks:
            self._by_job.setdefault(base_job(job), set()).update(ranks)

    def mark_present(self, job: str, ranks: Iterable[int]) -> set[int]:
        """Ranks heard from again: the next step waits for them. Returns those that were absent."""
        known = self._by_job.get(base_job(job))
        if not known:
            return set()
        back = known & set(ranks)
        known -= back
        if not known:
            del self._by_job[base_job(job)]
        return back

    def absent(self, job: str) -> frozenset[int]:
        return frozenset(self._by_job.get(base_job(job), ()))

    def complete(self, job: str, workers: int, counted: Iterable[int]) -> bool:
        return step_complete(workers, counted, self._by_job.get(base_job(job), ()))
