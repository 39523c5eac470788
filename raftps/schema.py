"""One declarative schema per request op, checked at the client port before anything else runs.

A request is a map; its schema says, for every field, its type, range and length, whether it is
required, and (for maps and lists) the specs of keys, values and items, with nested records for
``optimizer``, ``encoding`` and ``ssp``. A field the schema does not name is refused. The first
problem found is raised as ``InvalidRequest`` (``InvalidOptimizer`` inside ``optimizer``) with the
op, the field path and what was expected, e.g.

    push: tensors['w']: expected an array, got a map
    create: optimizer['w'].lr: expected a finite number > 0, got a float 0.0

The schema is about shape, not state: "is this a tensor the store has, of this shape" stays with
the state machine, which keeps every check of its own (it must stay authoritative: a log entry is
applied by code that trusts nothing). Each op's request schema is part of its record in
``ops.py``, which checks a request with ``check_request`` here and its table of records.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from raftps import compress, optim
from raftps.errors import InvalidOptimizer, InvalidRequest, RaftpsError
from raftps.tensor import NAME_RE as NAME_PATTERN     # one rule for names, the store's

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
CLIENT_PATTERN = re.compile(r"[A-Za-z0-9_\-]{1,64}")
MAX_STRING = 200
MAX_TOKEN = 1024


def describe(value: Any) -> str:
    """What a value is, for an error message (short; never the whole value)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a bool {value}"
    if isinstance(value, int):
        return f"an int {value}" if abs(value) < 10 ** 30 else "a huge int"
    if isinstance(value, float):
        return f"a float {value!r}"
    if isinstance(value, str):
        return f"a string {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"bytes ({len(value)})"
    if isinstance(value, np.ndarray):
        return f"an array ({value.dtype}, shape {value.shape})"
    if isinstance(value, dict):
        return "a map"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"


def _key(key: Any) -> str:
    return f"[{key!r}]" if isinstance(key, (str, int)) and not isinstance(key, bool) else "[?]"


class SchemaError(Exception):
    def __init__(self, path: str, expected: str, value: Any, error: type[RaftpsError] = InvalidRequest,
                 got: str | None = None, text: str | None = None):
        super().__init__(path)
        self.path, self.expected, self.got, self.error = path, expected, got or describe(value), error
        self.text = text

    def message(self, op: str) -> str:
        where = f"{op}: {self.path}: " if self.path else f"{op}: "
        return where + (self.text or f"expected {self.expected}, got {self.got}")


class Spec:
    """A field's spec. ``check`` returns nothing and raises SchemaError; ``error`` is the class a
    failure inside this spec (and the specs nested in it, unless they say otherwise) is raised as."""
    error: type[RaftpsError] | None = None
    nullable: bool = False

    def expected(self) -> str:
        raise NotImplementedError

    def check(self, value: Any, path: str) -> None:
        raise NotImplementedError

    def fail(self, path: str, value: Any, expected: str | None = None) -> SchemaError:
        return SchemaError(path, expected or self.expected(), value, self.error or InvalidRequest)

    def validate(self, value: Any, path: str) -> None:
        if value is None and self.nullable:
            return
        try:
            self.check(value, path)
        except SchemaError as exc:
            if self.error is not None and exc.error is InvalidRequest:
                exc.error = self.error
            raise


@dataclass
class Int(Spec):
    lo: int = INT64_MIN
    hi: int = INT64_MAX
    nullable: bool = False

    def expected(self) -> str:
        if self.lo == INT64_MIN and self.hi == INT64_MAX:
            return "an int"
        if self.hi == INT64_MAX:
            return f"an int >= {self.lo}"
        return f"an int in [{self.lo}, {self.hi}]"

    def check(self, value: Any, path: str) -> None:
        if type(value) is not int or not self.lo <= value <= self.hi:
            raise self.fail(path, value)


@dataclass
class Number(Spec):
    """A finite int or float (never a bool), optionally with a range check (description, test)."""
    range: tuple[str, Callable[[float], bool]] | None = None
    nullable: bool = False
    error: type[RaftpsError] | None = None

    def expected(self) -> str:
        return "a finite number" + (f" {self.range[0]}" if self.range else "")

    def check(self, value: Any, path: str) -> None:
        if type(value) is int:
            if not INT64_MIN <= value <= INT64_MAX:
                raise self.fail(path, value)
        elif type(value) is not float or not math.isfinite(value):
            raise self.fail(path, value)
        if self.range and not self.range[1](value):
            raise self.fail(path, value)


@dataclass
class Seconds(Number):
    """A duration: a finite number of seconds >= 0 (NaN would make a wait never end)."""
    range: tuple[str, Callable[[float], bool]] | None = (">= 0 (seconds)", lambda x: x >= 0)


@dataclass
class Bool(Spec):
    nullable: bool = False

    def expected(self) -> str:
        return "true or false"

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, bool):
            raise self.fail(path, value)


@dataclass
class Str(Spec):
    what: str = "a string"
    pattern: re.Pattern | None = None
    min_len: int = 0
    max_len: int = MAX_STRING
    nullable: bool = False

    def expected(self) -> str:
        return self.what

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, str) or not self.min_len <= len(value) <= self.max_len \
                or (self.pattern is not None and not self.pattern.fullmatch(value)):
            raise self.fail(path, value)


@dataclass
class Enum(Spec):
    values: tuple = ()
    nullable: bool = False

    def expected(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values)

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, str) or value not in self.values:
            raise self.fail(path, value)


@dataclass
class Array(Spec):
    """A numpy array (the codec already checked its dtype is one of codec.DTYPES, its shape and
    its bytes); optionally only some dtypes and a number of dimensions."""
    dtypes: tuple[str, ...] | None = None
    ndim: int | None = None
    nullable: bool = False

    def expected(self) -> str:
        kind = "an array" if self.dtypes is None else f"a {' or '.join(self.dtypes)} array"
        return kind if self.ndim is None else f"a {self.ndim}-D {kind[2:] if kind.startswith('a ') else kind[3:]}"

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, np.ndarray):
            raise self.fail(path, value)
        if self.dtypes is not None and str(value.dtype) not in self.dtypes:
            raise self.fail(path, value)
        if self.ndim is not None and value.ndim != self.ndim:
            raise self.fail(path, value)


@dataclass
class ListOf(Spec):
    item: Spec
    min_len: int = 0
    max_len: int | None = None
    nullable: bool = False

    def expected(self) -> str:
        n = f" of {self.min_len}+" if self.min_len else ""
        return f"a list{n} of {self.item.expected()}"

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, list) or len(value) < self.min_len \
                or (self.max_len is not None and len(value) > self.max_len):
            raise self.fail(path, value)
        for i, item in enumerate(value):
            self.item.validate(item, f"{path}[{i}]")


@dataclass
class MapOf(Spec):
    key: Spec
    value: Spec
    min_len: int = 0
    max_len: int | None = None
    nullable: bool = False
    what: str | None = None

    def expected(self) -> str:
        return self.what or f"a {'non-empty ' if self.min_len else ''}map of {self.key.expected()} -> " \
                            f"{self.value.expected()}"

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, dict) or len(value) < self.min_len \
                or (self.max_len is not None and len(value) > self.max_len):
            raise self.fail(path, value)
        for k, v in value.items():
            try:
                self.key.validate(k, path)
            except SchemaError as exc:
                exc.path = f"{path} key" + (f" {k[:40]!r}" if isinstance(k, str) else "")
                raise
            self.value.validate(v, f"{path}{_key(k)}")


@dataclass
class Record(Spec):
    """A map with named fields: ``fields`` maps each to (spec, required). Unknown fields are refused."""
    fields: dict[str, tuple[Spec, bool]] = field(default_factory=dict)
    what: str = "a map"
    nullable: bool = False
    error: type[RaftpsError] | None = None

    def expected(self) -> str:
        return self.what

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise self.fail(path, value)
        dot = f"{path}." if path else ""
        for k in value:
            if k not in self.fields:
                raise SchemaError(f"{dot}{k[:40]}" if isinstance(k, str) else f"{dot}key {describe(k)}", "", None,
                                  self.error or InvalidRequest,
                                  text=f"unknown field (this map takes {', '.join(sorted(self.fields))})")
        for name, (spec, required) in self.fields.items():
            if name not in value:
                if required:
                    raise SchemaError(f"{dot}{name}", spec.expected(), None, self.error or InvalidRequest,
                                      got="nothing (the field is required)")
                continue
            spec.validate(value[name], f"{dot}{name}")


@dataclass
class Tagged(Spec):
    """A map whose ``tag`` field (a string) picks the record its other fields follow."""
    tag: str
    variants: dict[str, Record]
    nullable: bool = False
    error: type[RaftpsError] | None = None

    def expected(self) -> str:
        return f"a map with {self.tag!r} one of {', '.join(repr(v) for v in sorted(self.variants))}"

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise self.fail(path, value)
        Enum(tuple(sorted(self.variants))).validate(value.get(self.tag), f"{path}.{self.tag}")
        self.variants[value[self.tag]].validate(value, path)


# ---- the request vocabulary -------------------------------------------------------------------------

NAME = Str("a tensor name (1-200 characters from [A-Za-z0-9_.:/-])", NAME_PATTERN)
# a sync job: the name of a sequence of synchronous steps (sync_jobs.py)
JOB = Str("a job name (1-200 characters from [A-Za-z0-9_.:/-], or \"\" for the store-wide default job)",
          re.compile(r"|[A-Za-z0-9_.:/\-]{1,200}"), nullable=True)
SSP_GROUP = Str("an SSP group name (1-200 characters from [A-Za-z0-9_.:/-])", NAME_PATTERN)
WORKER = Str("a worker name (a string of 1-200 characters)", min_len=1)
TENSORS = MapOf(NAME, Array(), min_len=1)
# A write sent again without its arrays: the content hash of the payload its first send carried
# (payloads.content_hash), which the node may hold already, and the names in it (for the roles).
HELD = {"held": (Str("a payload's content hash (8 hex digits)", re.compile(r"[0-9a-f]{8}")), False),
        "held_names": (ListOf(NAME, min_len=1), False)}
VERSION = Int(0, nullable=True)


def _optimizer_variant(params: dict[str, tuple]) -> Record:
    fields: dict[str, tuple[Spec, bool]] = {"name": (Str(), True)}
    for key, (default, check) in params.items():
        if check is None:
            spec: Spec = Bool()
        elif type(default) is int:
            spec = Int(1)
        else:
            spec = Number(check)
        fields[key] = (spec, default is None)
    return Record(fields, "an optimizer spec")


OPTIMIZER = Tagged("name", {name: _optimizer_variant(params) for name, params in optim.SPECS.items()},
                   error=InvalidOptimizer)
ENCODING = MapOf(NAME, Tagged("kind", {
    "fp16": Record({"kind": (Str(), True), "scale": (Number(("> 0", lambda x: x > 0)), True)}),
    "int8": Record({"kind": (Str(), True), "block": (Int(1, compress.INT8_MAX_BLOCK), True),
                    "scales": (ListOf(Number(("> 0", lambda x: x > 0))), True)}),    # their count: compress.py
    "topk": Record({"kind": (Str(), True)}),
    "rows": Record({"kind": (Str(), True)}),
}), min_len=1, nullable=True)
SSP = Record({"ssp_group": (SSP_GROUP, True), "worker": (WORKER, True)}, "a map {ssp_group, worker}", nullable=True)


RAFT_GROUP = Int(0, 63)
MOVE_ID = Str("a move id (1-64 characters from [A-Za-z0-9_.-])", re.compile(r"[A-Za-z0-9_.\-]{1,64}"))
# move_install's arrays: record i's data is "i", its optimizer state array KEY is "i.KEY"
MOVE_PART = Str("a part name ('0', '0.m', ...)", re.compile(r"[01](\.[a-z_0-9]{1,32})?"))
MOVE_RECORD = Record({"name": (NAME, True), "version": (Int(0), True), "optimizer": (OPTIMIZER, True),
                      "scalars": (MapOf(Str("a state name", re.compile(r"[a-z_0-9]{1,32}")), Number()), True)},
                     "a tensor record {name, version, optimizer, scalars}")


# A push's per-tensor hyperparameters for this step (a torch param group's current lr, betas, ...)
HYPER = MapOf(NAME, Record({k: (Number(), False) for k in optim.STEP_HYPERPARAMETERS},
                           "a map of step hyperparameters (" + ", ".join(optim.STEP_HYPERPARAMETERS) + ")"),
              nullable=True)
# assign_state's arrays: record i's value is "i", its optimizer state array KEY is "i.KEY"
STATE_PART = Str("a part name ('0', '0.m', ...)", re.compile(r"[0-9]{1,5}(\.[a-z_0-9]{1,32})?"))
STATE_RECORD = Record({"name": (NAME, True),
                       "scalars": (MapOf(Str("a state name", re.compile(r"[a-z_0-9]{1,32}")), Number()), True)},
                      "a tensor record {name, scalars}")


def request_record(fields: dict[str, tuple[Spec, bool]]) -> Record:
    # raft_group: which of the node's Raft groups serves the request (groups.py); 0 by default
    return Record({"op": (Str(), True), "raft_group": (Int(0, 63), False), **fields}, "a request map")


WRITE = {"client": (Str("a client id (1-64 characters from [A-Za-z0-9_-])", CLIENT_PATTERN), True),
         "seq": (Int(1), True), "ack": (Int(1), False)}
STALE_READ = {"linearizable": (Bool(), False), "min_version": (VERSION, False), "wait": (Seconds(), False)}

HELD_OPS = ("create", "push", "push_sync", "assign")     # writes that may name a payload held (HELD)


def _cross_checks(op: str, request: dict) -> None:
    """The few constraints between fields that a field's own spec cannot state."""
    if "ack" in request and "seq" in request and request["ack"] > request["seq"]:
        raise SchemaError("ack", f"an int in [1, seq={request['seq']}]", request["ack"])
    if op in ("push_sync", "push_step") and request.get("rank") is not None and request["rank"] >= request["workers"]:
        raise SchemaError("rank", f"an int in [0, workers={request['workers']})", request["rank"])
    if op == "push_step" and "ranks" in request:
        _check_ranks(request)
    if ("tensors" in request) == ("held" in request) and request.get("op") in HELD_OPS:
        raise SchemaError("tensors", "an array map, or held (a payload sent before) instead", None,
                          got="both" if "held" in request else "nothing")
    if ("held" in request) != ("held_names" in request):
        raise SchemaError("held_names", "the names the held payload carries, with held", None, got="nothing")
    if op == "push" and request.get("encoding") and "tensors" in request:
        tensors = request["tensors"]
        for name, enc in request["encoding"].items():
            if name not in tensors:
                raise SchemaError(f"tensors[{name!r}]", "an array (it is named in encoding)", None,
                                  got="nothing")
            if enc["kind"] in ("topk", "rows"):
                idx = name + compress.INDICES_SUFFIX
                if not (isinstance(tensors.get(idx), np.ndarray) and tensors[idx].ndim == 1
                        and tensors[idx].dtype in compress.INDEX_DTYPES):
                    raise SchemaError(f"tensors[{idx!r}]", f"a 1-D int32 or int64 array (the indices of "
                                      f"{enc['kind']} tensor {name!r})", tensors.get(idx),
                                      got=None if idx in tensors else "nothing")


def _check_ranks(request: dict) -> None:
    """A pair's contribution names the ranks it covers: distinct, in [0, workers), in increasing
    order, and ``rank`` (if given) is the lowest of them: the step sums by it."""
    ranks, workers = request["ranks"], request["workers"]
    if ranks != sorted(set(ranks)):
        raise SchemaError("ranks", "distinct ranks in increasing order", ranks)
    if ranks[-1] >= workers:
        raise SchemaError("ranks", f"ranks in [0, workers={workers})", ranks)
    if request.get("rank") is not None and request["rank"] != ranks[0]:
        raise SchemaError("rank", f"the lowest of ranks ({ranks[0]}), or nothing", request["rank"])


def check_request(request: Any, requests: Mapping[str, Record]) -> dict:
    """``request`` if it follows its op's schema in ``requests`` (op -> its request's Record:
    ops.REQUESTS), else InvalidRequest (or InvalidOptimizer) naming the op, the field path and
    what was expected."""
    if not isinstance(request, dict):
        raise InvalidRequest(f"a request is a map with an 'op' string, got {describe(request)}")
    op = request.get("op")
    if not isinstance(op, str):
        raise InvalidRequest(f"a request is a map with an 'op' string, got op {describe(op)}")
    schema = requests.get(op)
    if schema is None:
        raise InvalidRequest(f"unknown op {op[:40]!r} (known: {sorted(requests)})")
    try:
        schema.validate(request, "")
        _cross_checks(op, request)
    except SchemaError as exc:
        raise exc.error(exc.message(op)) from None
    return request

