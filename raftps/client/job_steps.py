"""A Client's synchronous steps, sent across Raft groups: a job's steps (push_sync, push_step,
close_step, wait_step, sync_applied) each split into one part per Raft group that holds some of
its tensors, and the Raft groups each job's steps live in, remembered from the parts this client
sent (a wait or a read asks those; a client that sent none asks every group). With one Raft
group every call is one request. ``Client`` (client.py) keeps the public methods.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from raftps.errors import StepTimeout
from raftps.client.router import Router
from raftps.client.transport import when_sent
from raftps.jobs import is_skip_flag


class JobSteps:
    """Sends through ``router``: its ``write`` (one exactly-once write) and its ``request`` (one
    read until a definite reply, sent holding ``lock``); ``submit(send)``: runs ``send(call)`` on a thread
    with connections of its own (Client's push_async lanes), so that a step's parts in several
    Raft groups are on their way at once: with the groups' leaders on different hosts, a step's
    contributions (and its answers) cross G leaders' links together instead of one after another."""

    def __init__(self, router: Router, lock: threading.RLock,
                 submit: Callable[[Callable[[Any], dict]], "Future[dict]"]):
        self._router, self._lock = router, lock
        self._submit = submit
        self._raft_groups: dict[str, set[int]] = {}     # job -> Raft groups this client contributed to
        self._chunks: dict[str, dict[int, int]] = {}    # chunked job -> {Raft group: its chunks}

    def contribute(self, op: str, grads: dict[str, np.ndarray], step: int, workers: int, job: str | None,
                   rank: int | None, waits: float = 0.0, chunk_bytes: int = 0, **extra: Any) -> dict:
        """One worker's part of a sync step (``op`` push_sync or push_step), split by Raft group
        (with it the per-tensor fields, ``hyper`` and ``encoding``: each part takes its tensors').
        ``chunk_bytes`` (push_step): each group's part in chunks (``chunks``), streamed."""
        per_tensor = {key: extra.pop(key) for key in ("hyper", "encoding") if extra.get(key)}
        if extra.pop("spread_answers", False) and extra.pop("pull", False):
            reply = self.contribute(op, grads, step, workers, job, rank, waits, chunk_bytes, **extra, **per_tensor)
            return {**reply, **self._read_answer(grads, reply, rank or 0)}
        fields: dict[str, Any] = {"step": int(step), "workers": int(workers), **extra}
        if job is not None:
            fields["job"] = job
        if rank is not None:
            fields["rank"] = int(rank)
        grads = {k: np.asarray(v) for k, v in grads.items()}
        chunked = chunk_bytes > 0 and op == "push_step" and "clip_norm" not in extra
        if self._router.groups() == 1 and not chunked:
            return self._router.write(op, 0, waits=waits, tensors=grads, **fields, **per_tensor)
        parts = self._router.split(grads) if self._router.groups() > 1 else {0: grads}
        chunk_of, items = chunk_plan(parts, chunk_bytes) if chunked else ({}, list(parts.items()))
        sent_events = {(g, max(chunk_of[n] for n in part)): threading.Event() for g, part in items} if chunked else {}

        def write(g: int, part: dict, call: Any) -> dict:
            mine = {key: {k: v for k, v in by_name.items() if k in part} for key, by_name in per_tensor.items()}
            more = {k: v for k, v in mine.items() if v}
            if not chunked:
                return self._router.write(op, g, waits=waits, call=call, tensors=part, **fields, **more)
            c = max(chunk_of[n] for n in part)
            return send_in_chunk_order(sent_events, g, c, waits + self._router.timeout, lambda: self._router.write(
                op, g, waits=waits, call=call, tensors=part, **{**fields, "job": chunk_job(job, c)}, **more))
        sent = self._raft_groups.setdefault(job or "", set())
        sent.update(parts)
        if chunked:
            self._remember_chunks(job, parts, chunk_of)
        result = self._router.each_group_at_once(write, items, self._submit)
        if self._router.groups() == 1:       # one group's reply, as an unchunked step's: no {0: value} maps
            return {k: v[0] if isinstance(v, dict) and list(v) == [0] else v for k, v in result.items()}
        sent.difference_update(set(parts) - set(result["version"]))   # parts re-routed by a move
        sent.update(result["version"])
        return result

    def expect_chunks(self, job: str | None, sizes: dict[str, tuple[tuple[int, ...], str]], chunk_bytes: int) -> None:
        """Before this client sent any step of ``job``: its steps go in chunks of ``chunk_bytes``
        over tensors ``sizes`` ({name: (shape, dtype)}), so that wait/close/applied cover every
        chunk job (a resuming rank reads the lowest step its chunks applied, not chunk 0's)."""
        shaped = {name: np.broadcast_to(np.zeros((), dtype), shape) for name, (shape, dtype) in sizes.items()}
        parts = self._router.split(shaped) if self._router.groups() > 1 else {0: shaped}
        self._raft_groups.setdefault(job or "", set()).update(parts)
        self._remember_chunks(job, parts, chunk_plan(parts, chunk_bytes)[0])

    def _remember_chunks(self, job: str | None, parts: dict[int, dict], chunk_of: dict[str, int]) -> None:
        self.expect_chunk_counts(job, {g: 1 + max(chunk_of[n] for n in part) for g, part in parts.items()})

    def expect_chunk_counts(self, job: str | None, counts: dict[int, int]) -> None:
        """As expect_chunks, for a plan of its own (step_stream.py): ``counts`` {Raft group: its chunks}."""
        self._raft_groups.setdefault(job or "", set()).update(counts)
        known = self._chunks.setdefault(job or "", {})
        for g, n in counts.items():
            known[g] = max(known.get(g, 1), n)

    def note_replies(self, job: str | None, sent: set[int], replied: set[int]) -> None:
        """The Raft groups a step's parts went to (``sent``) and answered from (``replied``: a
        part re-routed by a move answers from its new group), as contribute keeps them."""
        groups = self._raft_groups.setdefault(job or "", set())
        groups.update(sent)
        groups.difference_update(sent - replied)
        groups.update(replied)

    def _read_answer(self, grads: dict[str, Any], reply: dict, rank: int) -> dict:
        """A step's tensors (``grads``' names) read at its version from the member ``rank`` mod
        the members of each group (the leader or a follower, which waits until it has applied
        that version), each group's at once: K ranks' answers leave every member's link, not
        only the leader's. tensors, tensor_versions and the versions they were read at."""
        versions = reply["version"] if isinstance(reply["version"], dict) else {0: reply["version"]}
        parts = {g: list(part) for g, part in self._router.split(dict(grads)).items()} \
            if self._router.groups() > 1 else {0: list(grads)}

        def read(g: int, names: list[str], call: Any) -> dict:
            request = {"op": "pull", "names": names, "linearizable": False, "min_version": int(versions.get(g, 0))}
            return self._router.request(request, to_leader=False, raft_group=g, call=call, first=rank)
        result = self._router.each_group_at_once(read, parts, self._submit)
        read_at = result["version"] if self._router.groups() > 1 else result["version"][0]
        return {"tensors": result["tensors"], "tensor_versions": result["tensor_versions"], "read_version": read_at}

    def raft_groups(self, job: str | None) -> list[int]:
        """The Raft groups a job's steps live in: those this client contributed to, else all."""
        return sorted(self._raft_groups.get(job or "") or range(self._router.groups()))

    def _units(self, job: str | None) -> list[tuple[int, str | None]]:
        """(Raft group, job name) of each unit a step of ``job`` applies in: one per group, or
        for a job this client sent in chunks, one per chunk (its chunk jobs, ``chunk_job``)."""
        counts = self._chunks.get(job or "", {})
        return [(g, chunk_job(job, c)) for g in self.raft_groups(job) for c in range(counts.get(g, 1))]

    def close(self, step: int, job: str | None) -> Any:
        def fields(name: str | None) -> dict[str, Any]:
            return {"step": int(step), **({"job": name} if name is not None else {})}
        units = self._units(job)
        if self._router.groups() == 1 and len(units) == 1:
            return self._router.write("close_step", 0, **fields(job))["version"]
        versions: dict[int, Any] = {}
        for g, name in units:
            version = self._router.write("close_step", g, **fields(name))["version"]
            versions[g] = max(versions.get(g, version), version)
        return versions[0] if self._router.groups() == 1 else versions

    def wait(self, step: int, timeout: float, job: str | None) -> Any:
        deadline = time.monotonic() + timeout
        versions: dict[int, Any] = {}
        one = self._router.groups() == 1
        for g, name in self._units(job):
            while True:               # in waits of at most 5 s, so that a dead leader costs one of them
                left = deadline - time.monotonic()
                request: dict[str, Any] = {"op": "wait_step", "step": int(step), "timeout": max(0.0, min(left, 5.0)),
                                           **({"job": name} if name is not None else {})}
                try:
                    with self._lock:
                        version = self._router.request(request, attempt_timeout=min(left, 5.0) + 5.0,
                                                       raft_group=g)["version"]
                    versions[g] = max(versions.get(g, version), version)
                    break
                except StepTimeout:
                    if deadline - time.monotonic() <= 0:
                        raise
        return versions[0] if one else versions

    def applied(self, job: str | None) -> int:
        def request(name: str | None) -> dict[str, Any]:
            return {"op": "sync_applied", **({"job": name} if name is not None else {})}
        with self._lock:
            applied = [self._router.request(request(name), raft_group=g)["applied"] for g, name in self._units(job)]
        started = [a for a in applied if a >= 0]
        return min(started) if started else -1


def chunks(part: dict[str, np.ndarray], chunk_bytes: int) -> list[list[str]]:
    """A group's part of a step as chunks of whole tensors, in name order (the same on every
    rank), each up to ``chunk_bytes`` (a larger tensor alone); one chunk if ``chunk_bytes`` <= 0.
    The part's skip flags (jobs.skip_flag) go in every chunk: a rank that skips the step skips
    every chunk of it."""
    flags = sorted(name for name in part if is_skip_flag(name))
    out: list[list[str]] = [[]]
    size = 0
    for name in sorted(set(part) - set(flags)):
        nbytes = part[name].nbytes
        if out[-1] and chunk_bytes > 0 and size + nbytes > chunk_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return [names + flags for names in out]


def chunk_plan(parts: dict[int, dict[str, np.ndarray]], chunk_bytes: int) -> tuple[dict[str, int], list]:
    """({name: its chunk}, [(group, chunk's tensors)] in sending order: every group's chunk 0,
    then every group's chunk 1, ...). A skip flag is in every chunk of its group: it maps to 0,
    so a chunk is known by the highest chunk of its names."""
    chunk_of: dict[str, int] = {}
    items = []
    for g, part in parts.items():
        for c, names in enumerate(chunks(part, chunk_bytes)):
            chunk_of.update({name: c for name in names if name not in chunk_of})
            items.append((c, g, {n: part[n] for n in names}))
    return chunk_of, [(g, chunk) for _, g, chunk in sorted(items, key=lambda item: item[:2])]


def send_in_chunk_order(sent_events: dict[tuple[int, int], threading.Event], g: int, c: int, wait_s: float,
                        send: Callable[[], dict]) -> dict:
    """``send()`` chunk ``c`` of Raft group ``g`` once chunk c - 1's last byte has left (bounded
    by ``wait_s``: order only costs time), and mark chunk c sent once its own last byte has (or
    it failed). A part with no event of its own (re-routed by a move) marks nothing."""
    before = sent_events.get((g, c - 1))
    if before is not None:
        before.wait(wait_s)
    sent = sent_events.get((g, c)) or threading.Event()
    try:
        with when_sent(sent.set):
            return send()
    finally:
        sent.set()


def chunk_job(job: str | None, chunk: int) -> str | None:
    """The job name chunk ``chunk`` of a chunked step applies under: the job's own for the first,
    ``JOB:chunkN`` for the others. Each chunk is an aggregation unit of its own (its own entry,
    its contributors' exactly-once answers, its own step sequence), so a chunk's answer leaves
    while the next chunk is still arriving; a step is done when every chunk is."""
    return job if chunk == 0 else f"{job or ''}:chunk{chunk}"


def wait_for_tensors(client: Any, names: list[str], timeout: float, job: str) -> None:
    """Until every tensor in ``names`` exists (a job's creator, its rank 0, made them), asking the
    store's tensor list (names and shapes, no bytes) every 0.2-1 s; TimeoutError naming ``job``
    and what is missing after ``timeout`` s. The other ranks wait instead of each sending the whole
    model in a create of its own: on a slow link K creates of one model took K times its bytes."""
    wanted = set(names)
    prefix = os.path.commonprefix(sorted(wanted))
    deadline = time.monotonic() + timeout
    pause = 0.2
    while True:
        missing = sorted(wanted - {row["name"] for row in client.tensors(prefix)})
        if not missing:
            return
        if time.monotonic() + pause > deadline:
            raise TimeoutError(f"job {job!r}: its tensors {missing[:3]}{' ...' if len(missing) > 3 else ''} "
                               f"do not exist after {timeout:g} s of waiting: rank 0 creates them; is it running?")
        time.sleep(pause)
        pause = min(1.0, pause * 1.5)


# How long the ranks other than a job's creator wait for its tensors: rank 0 may start later
# (imports, its data) and its create crosses a slow link at the link's pace.
CREATOR_WAIT = 300.0
CREATE_CHUNK_BYTES = 64 << 20          # creates are split so that no frame carries more


def create_chunked(client: Any, todo: dict[str, tuple[np.ndarray, dict]]) -> list[str]:
    """Create ``todo`` ({name: (initial value, optimizer spec)}) in writes of at most
    CREATE_CHUNK_BYTES (a tensor larger than that goes alone); existing tensors are left as they
    are. Returns the names created."""
    created: list[str] = []
    chunk: dict[str, tuple[np.ndarray, dict]] = {}
    for name, (arr, spec) in todo.items():
        if chunk and sum(a.nbytes for a, _ in chunk.values()) + arr.nbytes > CREATE_CHUNK_BYTES:
            created += _create(client, chunk)
            chunk = {}
        chunk[name] = (arr, spec)
    return created + (_create(client, chunk) if chunk else [])


def _create(client: Any, chunk: dict[str, tuple[np.ndarray, dict]]) -> list[str]:
    result = client.create_result({k: a for k, (a, _) in chunk.items()}, {k: s for k, (_, s) in chunk.items()})
    return list(result.get("created", []))
