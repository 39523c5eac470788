"""A linear-time checker for the one-hot push workload (see history.py).

No search is needed because every push is identifiable in the final tensor (element k counts the
applications of push k) and every read reports the version it saw. After the cluster is healed,
``check(history, final, statuses)`` verifies:

pushes  every acknowledged push applied exactly once; none applied twice; a push that failed
        definitely applied zero times; unknown outcomes at most once; no element set that no push
        owns; no two acknowledged pushes share a version.
reads   real time: a linearizable read that starts after an operation completed reports a version
        at least that operation's; per client, versions never go backwards (a push lands above
        everything the client saw before); contents match the version: every acknowledged push with
        version <= v is set, none with version > v is, no failed or finally-unapplied push is set,
        no element is neither 0 nor 1, and each applied unknown push fits one version boundary
        (every read that shows it has a higher version than every read that does not).
replicas every node reports the same applied index and the same digest at it.

Cost: one sort of the operations plus O(N) vector work per read (the size of the read itself).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from raftps.chaos.history import FAILED, OK, PULL, PUSH, UNKNOWN, History, Op

MAX_PROBLEMS = 20


@dataclass
class Result:
    ops: int = 0
    ok: int = 0
    failed: int = 0
    ambiguous: int = 0
    ambiguous_applied: int = 0
    acked_lost: int = 0
    duplicated: int = 0
    failed_applied: int = 0
    phantom: int = 0
    version_conflicts: int = 0
    stale_reads: int = 0
    backwards: int = 0
    bad_contents: int = 0
    reads: int = 0
    replicas: int = 0
    replicas_agreeing: int = 0
    replicas_identical: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def linearizable(self) -> bool:
        return not (self.stale_reads or self.backwards or self.bad_contents or self.version_conflicts)

    @property
    def valid(self) -> bool:
        """Everything the issue promises held."""
        return (self.linearizable and self.replicas_identical and not
                (self.acked_lost or self.duplicated or self.failed_applied or self.phantom))

    def problem(self, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)

    def line(self, case: str, **extra: Any) -> str:
        """The one-line report: case=... ops=... ok=... ... replicas_identical=..."""
        f = {"case": case, "ops": self.ops, "ok": self.ok, "failed": self.failed,
             "ambiguous": self.ambiguous, "ambiguous_applied": self.ambiguous_applied,
             "reads": self.reads, "acked_lost": self.acked_lost, "duplicated": self.duplicated,
             "failed_applied": self.failed_applied, "linearizable": self.linearizable}
        f.update(extra)
        f["replicas_identical"] = self.replicas_identical
        return " ".join(f"{k}={_fmt(v)}" for k, v in f.items())

    def sentence(self) -> str:
        return (f"{self.ops} ops ({self.ok} ok, {self.ambiguous} unknown, {self.failed} failed "
                f"cleanly), {self.acked_lost} lost, {self.duplicated} duplicated, "
                f"{self.replicas_agreeing}/{self.replicas} replicas identical, reads "
                f"{'linearizable' if self.linearizable else 'NOT linearizable'}")


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.2f}"
    return "none" if v is None else str(v)


def check(history: History | Sequence[Op], final: np.ndarray,
          statuses: Sequence[dict] | None = None, nodes: int | None = None) -> Result:
    """Check a finished history against the final tensor (read after healing) and node statuses."""
    ops = history.completed() if isinstance(history, History) else [o for o in history if o.outcome]
    final = np.asarray(final, np.float64).ravel()
    r = Result(ops=len(ops), ok=sum(o.outcome == OK for o in ops),
               failed=sum(o.outcome == FAILED for o in ops),
               ambiguous=sum(o.outcome == UNKNOWN for o in ops))
    pushes = [o for o in ops if o.kind == PUSH]
    _check_pushes(pushes, final, r)
    _check_realtime(ops, r)
    _check_clients(ops, r)
    _check_contents(pushes, [o for o in ops if o.kind == PULL and o.outcome == OK], final, r)
    _check_replicas(statuses or [], nodes, r)
    return r


def _check_pushes(pushes: list[Op], final: np.ndarray, r: Result) -> None:
    owned = np.zeros(final.size, bool)
    by_version: dict[int, Op] = {}
    for p in pushes:
        if p.k is None or not 0 <= p.k < final.size or owned[p.k]:
            r.problem(f"push {p.client}/{p.seq}: index {p.k} missing, out of range or reused")
            r.phantom += 1
            continue
        owned[p.k] = True
        n = final[p.k]
        if n != np.round(n) or n > 1:
            r.duplicated += 1
            r.problem(f"push {p.client}/{p.seq} k={p.k} ({p.outcome}) applied {n:g} times")
        if p.outcome == OK:
            if n == 0:
                r.acked_lost += 1
                r.problem(f"push {p.client}/{p.seq} k={p.k} acknowledged at version {p.version} "
                          f"but not applied")
            other = by_version.setdefault(p.version, p)
            if other is not p:
                r.version_conflicts += 1
                r.problem(f"pushes k={other.k} and k={p.k} both acknowledged at version {p.version}")
        elif p.outcome == FAILED and n != 0:
            r.failed_applied += 1
            r.problem(f"push {p.client}/{p.seq} k={p.k} failed definitely ({p.error}) but applied")
        elif p.outcome == UNKNOWN and n == 1:
            r.ambiguous_applied += 1
    stray = np.flatnonzero((final != 0) & ~owned)
    if stray.size:
        r.phantom += int(stray.size)
        r.problem(f"elements set that no push owns: {stray[:10].tolist()}")


def _check_realtime(ops: list[Op], r: Result) -> None:
    """A linearizable read's version >= every op (push, or linearizable read) completed before it."""
    done = sorted((o for o in ops if o.outcome == OK and (o.kind == PUSH or o.linearizable)),
                  key=lambda o: o.end)
    reads = sorted((o for o in ops if o.kind == PULL and o.outcome == OK and o.linearizable),
                   key=lambda o: o.start)
    i, floor, floor_op = 0, -1, None
    for rd in reads:
        while i < len(done) and done[i].end < rd.start:
            if done[i].version > floor:
                floor, floor_op = done[i].version, done[i]
            i += 1
        if rd.version < floor:
            r.stale_reads += 1
            r.problem(f"stale read: client {rd.client} seq {rd.seq} saw version {rd.version} after "
                      f"{floor_op.kind} {floor_op.client}/{floor_op.seq} completed at version {floor}")


def _check_clients(ops: list[Op], r: Result) -> None:
    per_client: dict[int, list[Op]] = defaultdict(list)
    for o in ops:
        if o.outcome == OK:
            per_client[o.client].append(o)
    for client, seen in per_client.items():
        high = -1
        for o in sorted(seen, key=lambda o: o.seq):
            if o.version < high or (o.kind == PUSH and o.version == high):
                r.backwards += 1
                r.problem(f"client {client}: {o.kind} seq {o.seq} at version {o.version} after "
                          f"it had seen version {high}")
            high = max(high, o.version)


def _check_contents(pushes: list[Op], reads: list[Op], final: np.ndarray, r: Result) -> None:
    n = final.size
    ok_ver = np.zeros(n, np.int64)                    # version of the acknowledged push at k
    ok_mask, failed_mask, unk_mask, owned = (np.zeros(n, bool) for _ in range(4))
    for p in pushes:
        if p.k is None or not 0 <= p.k < n:
            continue
        owned[p.k] = True
        if p.outcome == OK:
            ok_mask[p.k], ok_ver[p.k] = True, p.version
        elif p.outcome == FAILED:
            failed_mask[p.k] = True
        elif p.outcome == UNKNOWN:
            unk_mask[p.k] = True
    never_applied = owned & (final == 0)
    lo = np.full(n, -1, np.int64)                    # unknown pushes: highest version not showing it
    hi = np.full(n, np.iinfo(np.int64).max)         # ... lowest version showing it
    r.reads = len(reads)
    for rd in reads:
        inread = np.zeros(n, bool)
        idx = np.asarray(rd.nonzero or [], np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            r.bad_contents += 1
            r.problem(f"read {rd.client}/{rd.seq}: index out of range")
            continue
        inread[idx] = True
        v = rd.version
        issues = []
        missing = np.flatnonzero(ok_mask & (ok_ver <= v) & ~inread)
        if missing.size:
            issues.append(f"misses acknowledged pushes at/below its version: k={missing[:5].tolist()}")
        future = np.flatnonzero(ok_mask & (ok_ver > v) & inread)
        if future.size:
            issues.append(f"shows pushes acknowledged above its version: k={future[:5].tolist()}")
        bad = np.flatnonzero(inread & (failed_mask | never_applied | ~owned))
        if bad.size:
            issues.append(f"shows failed, never-applied or unowned elements: k={bad[:5].tolist()}")
        if rd.odd:
            issues.append(f"shows values other than 0/1: {dict(list(rd.odd.items())[:5])}")
        if issues:
            r.bad_contents += 1
            r.problem(f"read {rd.client}/{rd.seq} at version {v}: " + "; ".join(issues))
        np.maximum(lo, np.where(unk_mask & ~inread, v, -1), out=lo)
        np.minimum(hi, np.where(unk_mask & inread, v, hi), out=hi)
    torn = np.flatnonzero(unk_mask & ~never_applied & (lo >= hi))
    if torn.size:
        r.bad_contents += int(torn.size)
        r.problem(f"unknown pushes seen at a version and missing at a higher one: k={torn[:5].tolist()}")


def _check_replicas(statuses: Sequence[dict], nodes: int | None, r: Result) -> None:
    r.replicas = nodes if nodes is not None else len(statuses)
    up = [s for s in statuses if s.get("role") not in (None, "down") and s.get("digest")]
    groups: dict[tuple, list] = defaultdict(list)
    for s in up:
        groups[(s.get("applied"), s.get("digest"))].append(s.get("node"))
    r.replicas_agreeing = max((len(v) for v in groups.values()), default=0)
    r.replicas_identical = len(groups) == 1 and r.replicas_agreeing == r.replicas
    if not r.replicas_identical:
        r.problem("replicas differ: " + ", ".join(f"nodes {v} applied={a} digest={str(d)[:12]}"
                                                   for (a, d), v in groups.items())
                  + f" ({len(up)}/{r.replicas} up); "
                  + "; ".join(f"n{s.get('node')} {s.get('role')} commit={s.get('commit')} log_len={s.get('log_len')} "
                              f"snapshot={s.get('snapshot_index')} missing={s.get('missing_payload')}" for s in up))
