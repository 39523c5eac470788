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

    def contribute(self, op: str, grads: dict[str, np.ndarray], step: int, workers: int, job: str | None,
                   rank: int | None, waits: float = 0.0, **extra: Any) -> dict:
        """One worker's part of a sync step (``op`` push_sync or push_step), split by Raft group
        (with it the per-tensor fields, ``hyper`` and ``encoding``: each part takes its tensors')."""
        per_tensor = {key: extra.pop(key) for key in ("hyper", "encoding") if extra.get(key)}
        if extra.pop("spread_answers", False) and extra.pop("pull", False):
            reply = self.contribute(op, grads, step, workers, job, rank, waits, **extra, **per_tensor)
            return {**reply, **self._read_answer(grads, reply, rank or 0)}
        fields: dict[str, Any] = {"step": int(step), "workers": int(workers), **extra}
        if job is not None:
            fields["job"] = job
        if rank is not None:
            fields["rank"] = int(rank)
        grads = {k: np.asarray(v) for k, v in grads.items()}
        if self._router.groups() == 1:
            return self._router.write(op, 0, waits=waits, tensors=grads, **fields, **per_tensor)

        def write(g: int, part: dict, call: Any) -> dict:
            mine = {key: {k: v for k, v in by_name.items() if k in part} for key, by_name in per_tensor.items()}
            return self._router.write(op, g, waits=waits, call=call, tensors=part, **fields,
                               **{k: v for k, v in mine.items() if v})
        parts = self._router.split(grads)
        sent = self._raft_groups.setdefault(job or "", set())
        sent.update(parts)
        result = self._router.each_group_at_once(write, parts, self._submit)
        sent.difference_update(set(parts) - set(result["version"]))   # parts re-routed by a move
        sent.update(result["version"])
        return result

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

    def close(self, step: int, job: str | None) -> Any:
        fields: dict[str, Any] = {"step": int(step), **({"job": job} if job is not None else {})}
        if self._router.groups() == 1:
            return self._router.write("close_step", 0, **fields)["version"]
        parts = {g: None for g in self.raft_groups(job)}
        return self._router.each_group(lambda g, _: self._router.write("close_step", g, **fields), parts)["version"]

    def wait(self, step: int, timeout: float, job: str | None) -> Any:
        deadline = time.monotonic() + timeout
        versions = {}
        one = self._router.groups() == 1
        for g in ([0] if one else self.raft_groups(job)):
            while True:               # in waits of at most 5 s, so that a dead leader costs one of them
                left = deadline - time.monotonic()
                request: dict[str, Any] = {"op": "wait_step", "step": int(step), "timeout": max(0.0, min(left, 5.0)),
                                           **({"job": job} if job is not None else {})}
                try:
                    with self._lock:
                        versions[g] = self._router.request(request, attempt_timeout=min(left, 5.0) + 5.0,
                                                    raft_group=g)["version"]
                    break
                except StepTimeout:
                    if deadline - time.monotonic() <= 0:
                        raise
        return versions[0] if one else versions

    def applied(self, job: str | None) -> int:
        request: dict[str, Any] = {"op": "sync_applied", **({"job": job} if job is not None else {})}
        with self._lock:
            if self._router.groups() == 1:
                return self._router.request(request)["applied"]
            applied = [self._router.request(request, raft_group=g)["applied"] for g in self.raft_groups(job)]
        started = [a for a in applied if a >= 0]
        return min(started) if started else -1


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
