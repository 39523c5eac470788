"""Who may do what: named client identities, each with roles over tensor-name prefixes (after
etcd's RBAC, with prefixes for key ranges).

Roles, each including the ones before it:

    read    pull, pull_rows, tensors, sync_applied, wait_step, ssp_wait (placement: any token, filtered)
    write   push, push_sync, push_step, close_step, ssp_join, ssp_leave, ssp_drop, and create,
            assign, assign_state: a training job creates its tensors and seeds them (a torch
            state_dict) under its own prefix. A push can already drive a tensor it may write to
            any value, so setting values adds no power; create never changes a tensor that exists.
    admin   delete, a move's steps (moves.py), and any op without an entry in NEEDS (fail closed);
            with admin on every name: snapshot, member

An identity holds grants ``(prefix, role)``; its role on a name is the highest role among grants
whose prefix starts the name. An op that names tensors is checked for every name it carries (a
push's ``NAME:indices`` companions are names too). Jobs and SSP groups are names in the same
space: a job (a sync step sequence) or SSP group ``jobA/sync`` needs a role on a prefix of
``jobA/sync``, and the store-wide default job ``""`` (no job given) only the prefix ``""``, i.e. a
grant over every name. ``status``,
``stats`` and ``hello`` need only a valid token.

Identities live in a JSON file (``serve --auth-file``) that every node re-reads when it changes
(checked at most once a second) and on SIGHUP; a token is rotated or revoked by editing it, and a
connection whose token was revoked is refused at its next request. The cluster token
(``--token-file``, re-read the same way) is the identity ``cluster`` with admin on every name.

    {"identities": [
      {"name": "jobA", "token_sha256": "<hex>", "grants": [{"prefix": "jobA/", "role": "write"}]},
      {"name": "eval", "token": "<secret>",     "grants": [{"prefix": "", "role": "read"}]}]}

Tokens are kept as SHA-256 digests and compared in constant time against every identity (no
early exit); they are never logged.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

from raftps import ops, schema
from raftps.errors import PermissionDenied

log = logging.getLogger("raftps.rbac")
ROLES = ("read", "write", "admin")
ADMIN = "admin"
CLUSTER_IDENTITY = "cluster"
RELOAD_CHECK_SECONDS = 1.0
MIN_TOKEN_CHARS = 16

# op -> (role, where the request names tensors, jobs or SSP groups), from each op's record (ops.py).
# A field is "tensors" (the map's keys), "names" (a list, or null for every tensor: then the reply
# is filtered), "name", "job" (null or "": the default job), "ssp_group", "ssp" (a push's
# {ssp_group, worker}).
# An op missing here needs admin on every name.
NEEDS: dict[str, tuple[str | None, tuple[str, ...]]] = {name: (op.role, op.names) for name, op in ops.OPS.items()}


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class Grant:
    prefix: str
    role: str

    def __str__(self) -> str:
        return f"{self.role} on {self.prefix!r}"


@dataclass(frozen=True)
class Identity:
    name: str
    digest: bytes
    grants: tuple[Grant, ...]

    @property
    def unrestricted(self) -> bool:
        return any(g.prefix == "" and g.role == ADMIN for g in self.grants)

    def level(self, name: str) -> int:
        """0 (nothing), 1 (read), 2 (write) or 3 (admin) on ``name``."""
        return max((ROLES.index(g.role) + 1 for g in self.grants if name.startswith(g.prefix)), default=0)

    def allows(self, role: str, name: str) -> bool:
        return self.level(name) >= ROLES.index(role) + 1

    def __repr__(self) -> str:             # never the digest
        return f"Identity({self.name!r}, {', '.join(map(str, self.grants)) or 'no grants'})"


OPEN = Identity(CLUSTER_IDENTITY, b"", (Grant("", ADMIN),))    # a node without any token: all may do all


def _resources(op: str, request: dict, fields: Iterable[str]) -> list[tuple[str, str]]:
    """(kind, name) of everything the request names, for the fields NEEDS lists."""
    out: list[tuple[str, str]] = []
    for f in fields:
        value = request.get(f)
        if f in ("tensors", "optimizer") and isinstance(value, dict):
            out += [("tensor", name) for name in value]      # NAME:indices is checked as a name too
        elif f in ("names", "held_names") and isinstance(value, list):
            out += [("tensor", n) for n in value]
        elif f == "records" and isinstance(value, list):
            out += [("tensor", r["name"]) for r in value]
        elif f in ("name", "prefix"):
            out.append(("tensor", value))
        elif f == "everything":
            out.append(("every name", ""))
        elif f == "job":
            out.append(("job", value or ""))
        elif f == "ssp_group":
            out.append(("SSP group", value))
        elif f == "ssp" and isinstance(value, dict):
            out.append(("SSP group", value["ssp_group"]))
    return out


def authorize(identity: Identity, request: dict) -> None:
    """Raise PermissionDenied unless ``identity`` may send ``request`` (already schema-checked).
    A ``pull`` of every tensor and ``tensors`` are not refused: their replies are filtered."""
    op = request["op"]
    role, fields = NEEDS.get(op, (ADMIN, ()))
    if role is None or identity.unrestricted:
        return
    if op not in NEEDS:
        raise PermissionDenied(f"{op}: identity {identity.name!r} needs admin on every name ('') for this op; "
                               f"it has {_grants(identity)}")
    for kind, name in _resources(op, request, fields):
        if not identity.allows(role, name):
            what = f"the default job (\"\")" if kind == "job" and name == "" else \
                "every name ('')" if kind == "every name" else f"{kind} {name!r}"
            raise PermissionDenied(f"{op}: identity {identity.name!r} has no {role} role on {what}; "
                                   f"it has {_grants(identity)}")


def _grants(identity: Identity) -> str:
    return ", ".join(map(str, identity.grants)) or "no grants"


# ---- the identity file ------------------------------------------------------------------------------

_PREFIX = schema.Str("a name prefix (0-200 characters from [A-Za-z0-9_.:/-])", re.compile(r"[A-Za-z0-9_.:/\-]{0,200}"))
FILE_SCHEMA = schema.Record({"identities": (schema.ListOf(schema.Record({
    "name": (schema.Str("an identity name (1-64 characters from [A-Za-z0-9_.-])",
                        re.compile(r"[A-Za-z0-9_.\-]{1,64}")), True),
    "token": (schema.Str(f"a token of {MIN_TOKEN_CHARS}-1024 characters", min_len=MIN_TOKEN_CHARS,
                         max_len=1024), False),
    "token_sha256": (schema.Str("64 hex digits", re.compile(r"[0-9a-fA-F]{64}"), max_len=64), False),
    "grants": (schema.ListOf(schema.Record({"prefix": (_PREFIX, True), "role": (schema.Enum(ROLES), True)},
                                           "a grant {prefix, role}")), True),
}, "an identity {name, token or token_sha256, grants}")), True)}, "a map {identities: [...]}")


def parse_identities(text: str, where: str) -> list[Identity]:
    """The identities of an identity file's text, or ValueError saying what is wrong (never a token)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from None
    try:
        FILE_SCHEMA.validate(data, "")
    except schema.SchemaError as exc:
        what = exc.text or f"expected {exc.expected}" + ("" if "token" in exc.path else f", got {exc.got}")
        raise ValueError(f"{where}: {exc.path or 'top level'}: {what}") from None
    out: list[Identity] = []
    for i, entry in enumerate(data["identities"]):
        if ("token" in entry) == ("token_sha256" in entry):
            raise ValueError(f"{where}: identities[{i}] ({entry['name']}): give exactly one of token, token_sha256")
        digest = token_digest(entry["token"]) if "token" in entry else bytes.fromhex(entry["token_sha256"])
        out.append(Identity(entry["name"], digest, tuple(Grant(g["prefix"], g["role"]) for g in entry["grants"])))
    names = [ident.name for ident in out]
    if len(set(names)) != len(names) or CLUSTER_IDENTITY in names:
        raise ValueError(f"{where}: identity names must be distinct and not {CLUSTER_IDENTITY!r}")
    if len({ident.digest for ident in out}) != len(out):
        raise ValueError(f"{where}: two identities share a token")
    return out


class Authorizer:
    """The node's identities: the cluster token's (``token_file``) and an identity file's, reloaded
    when either file changes (checked at most every RELOAD_CHECK_SECONDS) or on ``reload()``."""

    def __init__(self, token_file: str | None = None, auth_file: str | None = None, token: str | None = None):
        self.token_file, self.auth_file, self._fixed_token = token_file, auth_file, token
        self._lock = threading.Lock()
        self._stamps: tuple = ()
        self._checked = 0.0
        self.identities: tuple[Identity, ...] = ()
        self._by_name: dict[str, Identity] = {}
        self.generation = 0
        self.reload(strict=True)

    @property
    def open(self) -> bool:
        """No token and no identity file: every client is served as the cluster identity."""
        return self.token_file is None and self.auth_file is None and self._fixed_token is None

    def _stamp(self) -> tuple:
        out = []
        for path in (self.token_file, self.auth_file):
            try:
                st = os.stat(path) if path else None
                out.append(None if st is None else (st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append("missing")
        return tuple(out)

    def reload(self, strict: bool = False) -> bool:
        """Re-read both files. A file that cannot be read or parsed keeps the identities as they
        were (and is logged, without its content); ``strict`` (at start) raises instead."""
        with self._lock:
            stamps = self._stamp()
            try:
                identities: list[Identity] = []
                token = self._fixed_token
                if self.token_file:
                    with open(self.token_file) as f:
                        token = f.read().strip()
                    if not token:
                        raise ValueError(f"the token file {self.token_file} is empty")
                if token is not None:
                    identities.append(Identity(CLUSTER_IDENTITY, token_digest(token), (Grant("", ADMIN),)))
                if self.auth_file:
                    with open(self.auth_file) as f:
                        identities += parse_identities(f.read(), self.auth_file)
                if len({i.digest for i in identities}) != len(identities):
                    raise ValueError(f"{self.auth_file}: an identity has the cluster token")
            except (OSError, ValueError) as exc:
                if strict:
                    raise ValueError(str(exc)) from None
                log.error("identities not reloaded, the previous ones stay in force: %s", exc)
                self._stamps = stamps
                return False
            changed = identities != list(self.identities)
            self.identities, self._stamps = tuple(identities), stamps
            self._by_name = {i.name: i for i in identities}
            if changed:
                self.generation += 1
                log.warning("%d client identities loaded (generation %d)", len(identities), self.generation)
            return True

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_SECONDS:
            return
        self._checked = now
        if self._stamp() != self._stamps:
            self.reload()

    def identify(self, presented: Any) -> Identity | None:
        """The identity whose token ``presented`` is, or None. Every identity's digest is compared,
        each in constant time, so the reply's timing says nothing about which one (nearly) matched."""
        if self.open:
            return OPEN
        self._maybe_reload()
        if not isinstance(presented, str):
            return None
        digest = token_digest(presented)
        found = None
        for identity in self.identities:
            if hmac.compare_digest(digest, identity.digest):
                found = identity
        return found

    def current(self, identity: Identity) -> Identity | None:
        """``identity`` as the files say now (its grants may have changed), or None if its token
        was revoked or rotated."""
        if identity is OPEN and self.open:
            return OPEN
        self._maybe_reload()
        now = self._by_name.get(identity.name)
        return now if now is not None and hmac.compare_digest(now.digest, identity.digest) else None
