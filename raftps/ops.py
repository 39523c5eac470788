"""Every client op, declared once: its request schema, the role it needs, whether it is a write
through Raft, the client server's handler and the state machine's handler.

``REQUESTS`` (request checks, with schema.py's specs), ``rbac.NEEDS`` (roles), ``server.WRITES`` and the server's
handler table, and ``TensorStore._OPS`` (the state machine's handlers) are all made from
``OPS`` below. Adding a write op is: its record here, its state-machine handler, its ``Client``
method, its tests. ``tests/test_ops.py`` checks that every record is complete.

Handlers are named, not imported: the server and the state machine import this module, and the
state machine must not import the server (machine.py stays free of sockets and threads).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from raftps import schema
from raftps.errors import InvalidRequest
from raftps.store.hosts import ACTIONS as HOSTS_ACTIONS
from raftps.schema import (ENCODING, HELD, HYPER, JOB, MOVE_ID, MOVE_RECORD, MOVE_PART, NAME, NAME_PATTERN, OPTIMIZER,
                           RAFT_GROUP, SSP, SSP_GROUP, STALE_READ, STATE_PART, STATE_RECORD, TENSORS, VERSION,
                           WORKER, WRITE, Array, Bool, Enum, Int, ListOf, MapOf, Number, Seconds, Str, request_record)


@dataclass(frozen=True)
class Op:
    name: str
    request: schema.Record        # every field of the request (check_request)
    role: str | None              # the role it needs on every name it carries; None: a valid token
    names: tuple[str, ...]        # the request's fields whose names the role is checked on (rbac.py)
    serve: str | None             # the handlers.Handlers method that answers it; None: the connection (hello)
    node_wide: bool = False       # answered by the node as a whole, not by one Raft group's replica
    apply: str | None = None      # a write through Raft: the TensorStore method that applies its entry
    entry: str | None = None      # the log entry's op, where it is not the request's (push_step: step)
    renamed: tuple[tuple[str, str], ...] = ()   # (old field, its name now): accepted in requests and log entries

    @property
    def write(self) -> bool:
        return self.apply is not None


_PREFIX = Str("a name prefix (0-200 characters from [A-Za-z0-9_.:/-])", re.compile(r"[A-Za-z0-9_.:/\-]{0,200}"),
              nullable=True)
_ADDRESS = Str("a Raft address HOST:PORT", max_len=255, nullable=True)

# The fields renamed when "group" stopped meaning three things (a Raft group, a sync job, an SSP
# group): a client or a log entry of before may still carry the old name (current_names).
_JOB = (("group", "job"),)
_SSP_GROUP = (("group", "ssp_group"),)

_RECORDS = [
    # ---- the connection and the node ----
    Op("hello", request_record({"token": (Str("a token string", max_len=schema.MAX_TOKEN, nullable=True), False)}),
       None, (), serve=None, node_wide=True),
    Op("status", request_record({"digest": (Bool(), False)}), None, (), "_status", node_wide=True),
    Op("layout", request_record({}), None, (), "_layout", node_wide=True),
    Op("stats", request_record({}), None, (), "_stats"),
    # ---- reads ----
    Op("tensors", request_record({"prefix": (_PREFIX, False)}), "read", (), "_tensors"),   # its reply is filtered
    Op("pull", request_record({"names": (ListOf(NAME, nullable=True), False), **STALE_READ}), "read", ("names",), "_pull"),
    Op("pull_rows", request_record({"name": (NAME, True), "rows": (Array(ndim=1), True), **STALE_READ}),
       "read", ("name",), "_pull_rows"),
    Op("wait_step", request_record({"step": (Int(), True), "timeout": (Seconds(), False), "job": (JOB, False)}),
       "read", ("job",), "_wait_step", renamed=_JOB),
    Op("sync_applied", request_record({"job": (JOB, False)}), "read", ("job",), "_sync_applied", renamed=_JOB),
    Op("ssp_wait", request_record({"ssp_group": (SSP_GROUP, True), "worker": (WORKER, True),
                                   "timeout": (Seconds(), False)}),
       "read", ("ssp_group",), "_ssp_wait", renamed=_SSP_GROUP),
    Op("export", request_record({"prefix": (Str("a non-empty name prefix (1-200 characters from [A-Za-z0-9_.:/-])",
                                         NAME_PATTERN), True), "state": (Bool(), False)}),
       "read", ("prefix",), "_export"),                     # every tensor under the prefix
    # ---- writes through Raft ----
    # create, assign and assign_state need `write`: a job creates and seeds its own tensors (rbac.py)
    # tensors or, sent again, held (schema.HELD): the node's copy of the payload the first send carried
    Op("create", request_record({**WRITE, "tensors": (TENSORS, False), **HELD,
                                 "optimizer": (MapOf(NAME, OPTIMIZER), False)}),
       "write", ("tensors", "held_names", "optimizer"), "_write", apply="_create"),
    Op("push", request_record({**WRITE, "tensors": (TENSORS, False), **HELD, "base_version": (VERSION, False),
                        "encoding": (ENCODING, False), "ssp": (SSP, False), "hyper": (HYPER, False)}),
       "write", ("tensors", "held_names", "ssp"), "_write", apply="_push", renamed=(("ssp.group", "ssp.ssp_group"),)),
    Op("push_sync", request_record({**WRITE, "tensors": (TENSORS, False), **HELD, "step": (Int(0), True),
                                    "workers": (Int(1), True), "rank": (Int(0, nullable=True), False), "job": (JOB, False)}),
       "write", ("tensors", "held_names", "job"), "_write", apply="_push_sync", renamed=_JOB),
    # aggregated at the leader (aggregate.py): one "step" entry per sync step
    Op("push_step", request_record({**WRITE, "tensors": (TENSORS, True), "step": (Int(0), True), "workers": (Int(1), True),
                             "rank": (Int(0, nullable=True), False), "job": (JOB, False),
                             # a pair's sum (pair_steps.py): the ranks it covers, lowest first
                             "ranks": (ListOf(Int(0), min_len=1, max_len=2), False),
                             "timeout": (Seconds(), False), "pull": (Bool(), False), "hyper": (HYPER, False),
                             "clip_norm": (Number(("> 0", lambda x: x > 0), nullable=True), False),
                             "encoding": (ENCODING, False)}),
       "write", ("tensors", "job"), "_push_step", apply="_step", entry="step", renamed=_JOB),
    Op("assign", request_record({**WRITE, "tensors": (TENSORS, False), **HELD}), "write", ("tensors", "held_names"),
       "_write", apply="_assign"),
    # optimizer state: as an assign of the tensors; its arrays are named by part ("0", "0.m", ...)
    Op("assign_state", request_record({**WRITE, "records": (ListOf(STATE_RECORD, min_len=1, max_len=4096), True),
                                "tensors": (MapOf(STATE_PART, Array(), min_len=1), True)}),
       "write", ("records",), "_parts_write", apply="_assign_state"),
    Op("delete", request_record({**WRITE, "names": (ListOf(NAME, min_len=1), True)}), "admin", ("names",), "_write",
       apply="_delete"),
    Op("close_step", request_record({**WRITE, "step": (Int(0), True), "job": (JOB, False)}),
       "write", ("job",), "_write", apply="_close_step", renamed=_JOB),
    Op("ssp_join", request_record({**WRITE, "ssp_group": (SSP_GROUP, True), "worker": (WORKER, True),
                                   "staleness": (Int(0, nullable=True), False)}),
       "write", ("ssp_group",), "_write", apply="_ssp_join", renamed=_SSP_GROUP),
    Op("ssp_leave", request_record({**WRITE, "ssp_group": (SSP_GROUP, True), "worker": (WORKER, True)}),
       "write", ("ssp_group",), "_write", apply="_ssp_leave", renamed=_SSP_GROUP),
    Op("ssp_drop", request_record({**WRITE, "ssp_group": (SSP_GROUP, True), "worker": (WORKER, True),
                                   "clock": (Int(), True)}),
       "write", ("ssp_group",), "_write", apply="_ssp_drop", renamed=_SSP_GROUP),
    # ---- the whole cluster ----
    Op("snapshot", request_record({}), "admin", ("everything",), "_snapshot"),
    Op("member", request_record({"action": (Enum(("list", "add", "remove", "replace")), True),
                          "node": (_ADDRESS, False), "old": (_ADDRESS, False)}),
       "admin", ("everything",), "_member"),
    # ---- moving a tensor to another Raft group (moves.py; Client.move sends the steps) ----
    Op("move_freeze", request_record({**WRITE, "name": (NAME, True), "to": (RAFT_GROUP, True)}),
       "admin", ("name",), "_move_write", apply="_move_freeze"),
    Op("move_install", request_record({**WRITE, "name": (NAME, True), "move": (MOVE_ID, True), "from": (RAFT_GROUP, True),
                                "records": (ListOf(MOVE_RECORD, min_len=1, max_len=2), True),
                                "tensors": (MapOf(MOVE_PART, Array(), min_len=1), True)}),
       "admin", ("name",), "_move_write", apply="_move_install"),
    Op("move_done", request_record({**WRITE, "name": (NAME, True), "to": (RAFT_GROUP, True), "move": (MOVE_ID, True)}),
       "admin", ("name",), "_move_write", apply="_move_done"),
    Op("place", request_record({**WRITE, "name": (NAME, True), "to": (RAFT_GROUP, True)}),
       "admin", ("name",), "_move_write", apply="_place", renamed=(("group", "to"),)),
    Op("move_state", request_record({"name": (NAME, True), "full": (Bool(), False)}), "admin", ("name",), "_move_state"),
    Op("placement", request_record({}), "read", (), "_placement"),      # routing needs it; filtered like tensors
    # ---- which nodes serve which Raft group (hosts.py; raftps cluster add-host / move-replica) ----
    Op("hosts", request_record({}), None, (), "_hosts"),                 # group 0's record; nodes follow it
    Op("hosts_change", request_record({
        **WRITE, "action": (Enum(HOSTS_ACTIONS), True),
        "address": (_ADDRESS, False), "new": (_ADDRESS, False), "move_group": (RAFT_GROUP, False),
        "source": (Int(1, 64), False), "target": (Int(1, 64), False),
        # move_start: begin with a learner (stage "learn"); move_stage: the stage to reach
        "learn": (Bool(), False), "stage": (Enum(("add", "catch_up")), False),
        # the formula's record, which the first change starts from (the state machine has no
        # layout): group 0's leader puts its own in the entry, whatever a client sent
        "base_nodes": (ListOf(Str("a Raft address HOST:PORT", max_len=255), min_len=1, max_len=64), False),
        "base_placed": (ListOf(ListOf(Int(1, 64), min_len=1, max_len=64), min_len=1, max_len=64), False)}),
       "admin", ("everything",), "_hosts_write", apply="_hosts_change"),
]

OPS: dict[str, Op] = {op.name: op for op in _RECORDS}
if len(OPS) != len(_RECORDS):
    raise RuntimeError("raftps/ops.py declares an op twice")
REQUESTS: dict[str, schema.Record] = {name: op.request for name, op in OPS.items()}


def check_request(request: Any) -> dict:
    """``request`` if it follows its op's request schema (schema.check_request), else
    InvalidRequest naming the op, the field and what was expected."""
    return schema.check_request(request, REQUESTS)


# A message's op (a request's, or a log entry's: push_step's entry is "step") -> its renamed fields
_RENAMED = {**{op.name: op.renamed for op in OPS.values() if op.renamed},
            **{op.entry: op.renamed for op in OPS.values() if op.renamed and op.entry}}


def current_names(message: Any) -> Any:
    """``message`` (a request, or a log entry) with every field it carries under an old name
    (``Op.renamed``) under its name now: the one place old names are read, by the client port
    before the schema and by the state machine before it applies an entry, so that an entry
    logged by an older server applies exactly as the same entry with the names of today. A
    message that carries a field under both names with different values is refused
    (InvalidRequest); anything else that is not a known op's map is returned as it is."""
    if not isinstance(message, dict):
        return message
    op = message.get("op")
    renamed = _RENAMED.get(op) if isinstance(op, str) else None
    if not renamed:
        return message
    out = message
    for old, new in renamed:
        *inner, old_key = old.split(".")
        new_key = new.split(".")[-1]
        holder = out.get(inner[0]) if inner else out
        if not isinstance(holder, dict) or old_key not in holder:
            continue
        if new_key in holder and not _same(holder[new_key], holder[old_key]):
            raise InvalidRequest(f"{op}: {old!r} is the old name of {new!r}, and this {op} carries both, with "
                                 f"different values ({schema.describe(holder[old_key])} and "
                                 f"{schema.describe(holder[new_key])}): send only {new!r}")
        moved = {k: v for k, v in holder.items() if k != old_key}
        moved[new_key] = holder[old_key]
        out = {**out, inner[0]: moved} if inner else moved
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal values of one type (an array, or anything whose == is not a bool, is never the same)."""
    try:
        return type(a) is type(b) and (a == b) is True
    except Exception:
        return False


def served_by_replica() -> dict[str, str]:
    """op -> the Handlers method that answers it at the request's Raft group's replica."""
    return {op.name: op.serve for op in OPS.values() if op.serve and not op.node_wide}


def served_by_node() -> dict[str, str]:
    """op -> the Handlers method that answers it for the node as a whole."""
    return {op.name: op.serve for op in OPS.values() if op.serve and op.node_wide}


def entry_handlers() -> dict[str, str]:
    """A log entry's op -> the TensorStore method that applies it."""
    return {op.entry or op.name: op.apply for op in OPS.values() if op.apply}


def moving_writes() -> tuple[str, ...]:
    """The writes that move a tensor between Raft groups (moves.py)."""
    return tuple(op.name for op in OPS.values() if op.serve == "_move_write")
