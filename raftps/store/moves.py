"""Moving a tensor to another Raft group online (``raftps move``): the state machine's part.

A tensor lives in the group its placement says (group 0, the metadata group, keeps the table of
names placed elsewhere than their hash, groups.py), and a move carries it from its source group S
to a destination D in four replicated steps, each idempotent, driven by ``Client.move``:

1. ``move_freeze`` in S: from this entry on, S refuses every write naming the tensor with
   ``Moving`` (retryable; nothing refused is applied). Reads go on: the state no longer changes.
2. ``move_install`` in D: the tensor with exactly the state read from S after the freeze (data,
   optimizer spec and state, its update count), tagged with the move's id so that a retry is a
   no-op even after D applied later pushes.
3. ``place`` in group 0: the placement table says D.
4. ``move_done`` in S: the freeze becomes a tombstone; the data is dropped, and every request
   naming the tensor is answered ``Moved`` with D, so a client with a stale placement re-routes.

An index tensor ``NAME:indices`` stored in its own right goes with NAME (routing strips the
suffix). ``Moves`` keeps one group's move state; ``TensorStore`` (machine.py) holds one, hands it
the tensors a step needs to see, and makes the changes to its tensors that a step returns. It
follows the state machine's rules: no clock, no randomness, sorted iteration, scalars as Python
floats, every bad input a typed error.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from raftps import codec, ops, optim
from raftps.compress import INDICES_SUFFIX
from raftps.errors import InvalidRequest, Moved, Moving, TensorExists, UnknownTensor, exception_result
from raftps.optimizers import OPTIMIZERS
from raftps.tensor import TENSOR_DTYPES, Tensor, check_finite, check_name, freeze, freeze_tensor

# The writes that move tensors: they must reach a frozen or tombstoned name (the others are refused).
MOVE_OPS = ops.moving_writes()
MAX_GROUP = 63
# Optimizers whose state is tied to this group's log (AdaRevision's gradient sums by store
# version): it means nothing in another group's.
UNMOVABLE_OPTIMIZERS = tuple(name for name, optimizer in OPTIMIZERS.items() if optimizer.bound_to_log)
# A training job's step counters (jobs.py) are named to live in one Raft group each: they stay there.
JOB_COUNTERS = "/_raftps/"


def base_name(name: str) -> str:
    """The tensor an index tensor belongs to (routing and moves treat them as one)."""
    return name[:-len(INDICES_SUFFIX)] if name.endswith(INDICES_SUFFIX) else name


def written_names(command: dict) -> list[str]:
    """Every tensor name a write carries (a map's keys, a list, or one name)."""
    tensors, names, name = command.get("tensors"), command.get("names"), command.get("name")
    records = command.get("records")
    if isinstance(records, list):    # assign_state: its tensors are parts ("0", "0.m"), its records name them
        tensors = {r.get("name"): None for r in records if isinstance(r, dict)}
    out = [n for n in tensors if isinstance(n, str)] if isinstance(tensors, dict) else []
    out += [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
    return out + ([name] if isinstance(name, str) else [])


def _group(value: Any, field: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_GROUP:
        raise InvalidRequest(f"{field} must be a Raft group number (an int in [0, {MAX_GROUP}]), got {value!r}")
    return value


def _move_id(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 64:
        raise InvalidRequest(f"move must be the move's id (a string of 1-64 characters), got {value!r}")
    return value


class Moves:
    """One Raft group's move state. ``moving``: name -> {"to": D, "move": id}, frozen here;
    ``moved``: name -> D, tombstones; ``installed``: name -> the id of the move that brought it
    here; ``placement``: name -> Raft group (kept by group 0 only). The tensors are its host's:
    a step is given those it must see (``tensors``, read only) and returns what the host changes."""

    def __init__(self) -> None:
        self.moving: dict[str, dict] = {}
        self.moved: dict[str, int] = {}
        self.installed: dict[str, str] = {}
        self.placement: dict[str, int] = {}

    def anything_moved(self) -> bool:
        """Whether a tensor is frozen or tombstoned here (else no write can be refused for a move)."""
        return bool(self.moving or self.moved)

    # ---- the guard every other write passes ---------------------------------------------------

    def check_placed_here(self, command: dict) -> None:
        """Refuse a write naming a tensor this group is moving away (Moving) or moved (Moved)."""
        if command.get("op") in MOVE_OPS:
            return
        for name in written_names(command):
            for n in (name, base_name(name)):
                self.raise_if_moved(n)
                if n in self.moving:
                    to = self.moving[n]["to"]
                    raise Moving(f"tensor {n!r} is being moved to Raft group {to}: writes to it wait until "
                                 "the move completes (the client retries)", tensor=n, group=to)

    def placement_refusal(self, tensors: dict) -> dict | None:
        """check_placed_here for a sync step's sums (aggregate.py): the error to answer, or None."""
        try:
            self.check_placed_here({"tensors": tensors})
        except (Moving, Moved) as exc:
            return exception_result(exc)
        return None

    def raise_if_moved(self, name: str) -> None:
        if name in self.moved:
            group = self.moved[name]
            raise Moved(f"tensor {name!r} was moved to Raft group {group}", tensor=name, group=group)

    # ---- the ops -------------------------------------------------------------------------------

    def freeze(self, index: int, command: dict, tensors: Mapping[str, Tensor],
               holding: Callable[[str], tuple[str, int] | None]) -> dict:
        """move_freeze; ``holding``: the (job, step) of a sync step not yet applied that holds a tensor."""
        name, to = _move_name(command), _group(command.get("to"), "to")
        current = self.moving.get(name)
        if current is not None:
            if current["to"] != to:
                raise InvalidRequest(f"tensor {name!r} is being moved to Raft group {current['to']}: finish that "
                                     f"move first (raftps move {name} --to {current['to']})")
            return {"version": index, "move": current["move"], "names": self._frozen_with(current["move"])}
        self.raise_if_moved(name)
        if name not in tensors:
            raise UnknownTensor(f"unknown tensor {name!r}")
        names = [n for n in (name, name + INDICES_SUFFIX) if n in tensors]
        for n in names:
            _check_movable(n, tensors[n], holding)
        move = str(index)        # the freeze's store version: unique in this group
        for n in names:
            self.moving[n] = {"to": to, "move": move}
            self.installed.pop(n, None)
        return {"version": index, "move": move, "names": names}

    def install(self, index: int, command: dict, tensors: Mapping[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
        """move_install: (its result, the tensors the host installs: any earlier update indices of
        theirs go, they mean nothing in this group)."""
        name, move = _move_name(command), _move_id(command.get("move"))
        records, arrays = command.get("records"), command.get("tensors")
        if not isinstance(records, list) or not 1 <= len(records) <= 2 or not isinstance(arrays, dict):
            raise InvalidRequest("move_install needs records (a list of 1-2 tensor records) and tensors (a map)")
        # the request was authorized for ``name``: it may carry nothing else
        carried = sorted(str(r.get("name")) if isinstance(r, dict) else "?" for r in records)
        if carried not in ([name], [name, name + INDICES_SUFFIX]):
            raise InvalidRequest(f"move_install of {name!r} carries {carried}: only {name!r} and its index "
                                 f"tensor {name + INDICES_SUFFIX!r} may move with it")
        built = [self._installable(i, record, arrays, move, tensors) for i, record in enumerate(records)]
        unknown = sorted(set(arrays) - {part for _, _, parts in built for part in parts})
        if unknown:
            raise InvalidRequest(f"move_install of {name!r}: parts {unknown} belong to no tensor it installs")
        arrived: dict[str, Tensor] = {}
        for name, tensor, _ in built:
            if tensor is None:
                continue                  # installed by this move before: a retry changes nothing
            arrived[name] = tensor
            self.installed[name] = move
            self.moved.pop(name, None)    # the tensor came back: its old tombstone goes
        return {"version": index, "installed": list(arrived)}, arrived

    def _installable(self, i: int, record: Any, arrays: dict, move: str,
                     tensors: Mapping[str, Tensor]) -> tuple[str, Any, list[str]]:
        """(name, the Tensor to install or None if this move installed it already, the parts used)."""
        if not isinstance(record, dict):
            raise InvalidRequest(f"records[{i}] must be a map")
        name = check_name(record.get("name"))
        spec = optim.normalize(record.get("optimizer"), name)
        version, scalars = record.get("version"), record.get("scalars")
        if type(version) is not int or version < 0 or not isinstance(scalars, dict):
            raise InvalidRequest(f"records[{i}] ({name!r}) needs version (an int >= 0) and scalars (a map)")
        if spec["name"] in UNMOVABLE_OPTIMIZERS:
            raise InvalidRequest(f"tensor {name!r}: optimizer {spec['name']!r} cannot be moved")
        parts = [str(i)]
        data = arrays.get(str(i))
        if not isinstance(data, np.ndarray) or codec.dtype_name(data.dtype) not in TENSOR_DTYPES:
            raise InvalidRequest(f"tensor {name!r}: tensors[{str(i)!r}] must be its data, a {TENSOR_DTYPES} array")
        check_finite(name, data, "value")
        state: dict[str, Any] = {}
        for key, initial in sorted(optim.init_state(spec, data).items()):
            if isinstance(initial, np.ndarray):
                parts.append(f"{i}.{key}")
                arr = arrays.get(parts[-1])
                if not isinstance(arr, np.ndarray) or arr.dtype != data.dtype or arr.shape != data.shape:
                    raise InvalidRequest(f"tensor {name!r}: optimizer state {key!r} must be an array like its data")
                check_finite(name, arr, f"optimizer state {key!r}")
                state[key] = freeze(arr.copy())
            elif type(initial) is int:       # a count (the optimizers' step)
                value = scalars.get(key)
                if value is None:            # a state kept before the count existed
                    continue
                if type(value) is not int or value < 0:
                    raise InvalidRequest(f"tensor {name!r}: optimizer state {key!r} must be an int >= 0")
                state[key] = value
            else:
                value = scalars.get(key)
                if type(value) is not float or not np.isfinite(value):
                    raise InvalidRequest(f"tensor {name!r}: optimizer state {key!r} must be a finite float")
                state[key] = value
        extra = sorted(set(scalars) - set(state))
        if extra:
            raise InvalidRequest(f"tensor {name!r}: optimizer {spec['name']!r} has no state {extra}")
        if name in tensors:
            if self.installed.get(name) == move:
                return name, None, parts
            raise TensorExists(f"tensor {name!r} already exists in this group (not from move {move}): "
                               "delete it there first, or move to another group")
        return name, Tensor(freeze(data.copy()), version, spec, state), parts

    def done(self, index: int, command: dict) -> dict:
        """move_done: the freeze becomes a tombstone, requests naming it get Moved; the host drops
        the tensors its result ``names`` (their data and update indices)."""
        name, to, move = _move_name(command), _group(command.get("to"), "to"), _move_id(command.get("move"))
        if self.moved.get(name) == to and name not in self.moving:
            return {"version": index, "names": []}       # done before: a retry
        current = self.moving.get(name)
        if current is None or current != {"to": to, "move": move}:
            raise InvalidRequest(f"no move {move} of tensor {name!r} to Raft group {to} is under way here")
        names = self._frozen_with(move)
        for n in names:
            del self.moving[n]
            self.moved[n] = to
        return {"version": index, "names": names}

    def place(self, index: int, command: dict) -> dict:
        """place (group 0): the placement table says the tensor lives in Raft group ``to``."""
        # "group": its message names the field as it was called before the renaming (see check_job)
        name, to = _move_name(command), _group(command.get("to"), "group")
        self.placement[name] = to
        return {"version": index}

    def _frozen_with(self, move: str) -> list[str]:
        return [n for n in sorted(self.moving) if self.moving[n]["move"] == move]

    # ---- reads (callers hold the apply lock, or run in the apply thread) -------------------------

    def state(self, name: str, full: bool, tensors: Mapping[str, Tensor], version: int) -> dict:
        """Where ``name`` stands in this group at store version ``version``; ``full`` (frozen
        only): the state to install."""
        out = {"version": version, "present": name in tensors, "moving": self.moving.get(name),
               "moved": self.moved.get(name), "installed": self.installed.get(name),
               # what a move carries: the tensor and its index tensor, data and optimizer state
               "bytes": sum(tensors[n].nbytes for n in (name, name + INDICES_SUFFIX) if n in tensors)}
        if full:
            frozen = self.moving.get(name)
            if frozen is None:
                self.raise_if_moved(name)
                raise InvalidRequest(f"tensor {name!r} is not frozen for a move in this group")
            out["records"] = [_record(n, tensors[n]) for n in self._frozen_with(frozen["move"])]
        return out

    def table(self) -> dict[str, int]:
        """The placement table (group 0's): tensors placed elsewhere than their hash."""
        return dict(sorted(self.placement.items()))

    # ---- snapshot ---------------------------------------------------------------------------------

    def snapshot(self) -> list:
        return [[[n, m["to"], m["move"]] for n, m in sorted(self.moving.items())],
                sorted(self.moved.items()), sorted(self.installed.items()), sorted(self.placement.items())]

    def restore(self, moves: list | None) -> None:
        """Load a ``snapshot()`` into this (new) Moves; None: a snapshot of format 1 or 2, from
        before moves existed, in which nothing was ever moved."""
        if moves is None:
            return
        moving, moved, installed, placement = moves
        self.moving = {n: {"to": to, "move": move} for n, to, move in moving}
        self.moved, self.installed, self.placement = dict(moved), dict(installed), dict(placement)


def _move_name(command: dict) -> str:
    name = check_name(command.get("name"))
    if name.endswith(INDICES_SUFFIX):
        raise InvalidRequest(f"{name!r} is an index tensor: it moves with {base_name(name)!r}; move that")
    return name


def _check_movable(name: str, tensor: Tensor, holding: Callable[[str], tuple[str, int] | None]) -> None:
    if JOB_COUNTERS in name:
        raise InvalidRequest(f"tensor {name!r} is a training job's bookkeeping (jobs.py), named to live in "
                             "this group: it cannot be moved")
    spec = tensor.optimizer
    if spec["name"] in UNMOVABLE_OPTIMIZERS:
        raise InvalidRequest(f"tensor {name!r}: optimizer {spec['name']!r} {OPTIMIZERS[spec['name']].bound_to_log}: "
                             "it cannot be moved")
    held = holding(name)
    if held is not None:
        raise InvalidRequest(f"tensor {name!r} is in sync step {held[1]} of sync job {held[0]!r}, which "
                             "is not applied yet: move it after the step is applied (or close_step it)")


def _record(name: str, tensor: Tensor) -> dict:
    freeze_tensor(tensor)           # the reply is encoded outside the lock: nothing may write these
    return {"name": name, "version": tensor.version, "optimizer": tensor.optimizer, "data": tensor.data,
            "arrays": {k: v for k, v in sorted(tensor.state.items()) if isinstance(v, np.ndarray)},
            "scalars": {k: v for k, v in sorted(tensor.state.items()) if not isinstance(v, np.ndarray)}}
