"""Moving a tensor to another Raft group, the client's side (``Client.move``; moves.py has the
state machine's): freeze it in its group, read its whole state there, install that state in the
target group, record the placement in group 0, then leave a tombstone. Every step is an
idempotent write, so a move interrupted at any point completes when run again."""
from __future__ import annotations

import threading
from typing import Any

from raftps import codec
from raftps.compress import INDICES_SUFFIX
from raftps.errors import InvalidRequest, LimitExceeded, UnknownTensor
from raftps.client.router import Router
from raftps.schema import NAME_PATTERN


def check_move_request(name: Any, raft_group: Any, count: int) -> None:
    """Bad input to a move of tensor ``name`` to ``raft_group`` of ``count``, refused before anything is sent."""
    if count == 1:
        raise InvalidRequest("move: this cluster has one Raft group: there is no other group to move a tensor to")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidRequest(f"move: bad tensor name {name!r}: 1-200 characters from [A-Za-z0-9_.:/-]")
    if name.endswith(INDICES_SUFFIX):
        raise InvalidRequest(f"move: {name!r} is an index tensor: it moves with {name[:-len(INDICES_SUFFIX)]!r}")
    if type(raft_group) is not int or not 0 <= raft_group < count:
        raise InvalidRequest(f"move: Raft group {raft_group!r} is out of range: this cluster has groups 0..{count - 1}")


class Mover:
    """Drives a move's steps through a client's router (its ``request``: a request to a group's
    leader; its ``write``: a write in the client's session)."""

    def __init__(self, router: Router, limits: codec.Limits, lock: threading.RLock):
        self._router = router
        self.limits, self._lock = limits, lock

    def move(self, name: str, target: int) -> dict:
        """Move tensor ``name`` (with its index tensor ``name:indices``, if stored) to Raft group
        ``target``, online: freeze it in its Raft group (writes to it wait), read its whole state there,
        install that state in ``target``, record the placement in group 0, then leave a tombstone
        that sends every later request to ``target``. Every step is idempotent: a move interrupted
        at any point (this process killed, a leader killed) completes when run again.
        Returns {tensor, from, to, names}."""
        count = self._router.groups()
        check_move_request(name, target, count)
        with self._lock:
            for _ in range(3):          # at most: finish an interrupted move elsewhere, then this one
                states = {g: self._router.request({"op": "move_state", "name": name}, raft_group=g)
                          for g in range(count)}
                pending = [g for g, st in states.items() if st["moving"]]
                if pending:             # a move that was interrupted: finish it first
                    source, frozen = pending[0], states[pending[0]]["moving"]
                    names = self._finish(name, source, frozen["to"], frozen["move"])
                    if frozen["to"] == target:
                        return {"tensor": name, "from": source, "to": target, "names": names}
                    continue
                holders = [g for g, st in states.items() if st["present"]]
                if not holders:
                    raise UnknownTensor(f"move: unknown tensor {name!r} (no Raft group holds it)")
                source = holders[0]
                if source == target:
                    raise InvalidRequest(f"move: tensor {name!r} is already in Raft group {target}")
                self._check_fits(name, states[source]["bytes"], states[target].get("max_frame_bytes"))
                frozen = self._router.write("move_freeze", source, name=name, to=target)
                names = self._finish(name, source, target, frozen["move"])
                return {"tensor": name, "from": source, "to": target, "names": names}
        raise InvalidRequest(f"move: tensor {name!r} kept being moved by someone else meanwhile; run it again")

    def _check_fits(self, name: str, size: int, node_limit: int | None) -> None:
        """The state a move carries must fit one reply to us and one write to the destination:
        refused before the freeze (a frozen tensor can only be finished, not given back)."""
        limit = min(self.limits.max_blob_bytes, node_limit or self.limits.max_blob_bytes)
        if size > limit:
            raise LimitExceeded(f"move: tensor {name!r} carries {size} bytes (data and optimizer state), more than "
                                f"one frame may hold ({limit} bytes: the nodes' --max-frame-mb and this client's "
                                "limits); nothing was changed")

    def _finish(self, name: str, source: int, target: int, move: str) -> list[str]:
        """Steps 2-4 of a move whose freeze (move id ``move`` in ``source``) is applied."""
        state = self._router.request({"op": "move_state", "name": name, "full": True}, raft_group=source)
        records, arrays = [], {}
        for i, record in enumerate(state["records"]):
            arrays[str(i)] = record["data"]
            arrays.update({f"{i}.{key}": arr for key, arr in record["arrays"].items()})
            records.append({k: record[k] for k in ("name", "version", "optimizer", "scalars")})
        # the move's id names its source and its freeze's version there: unique in the cluster
        self._router.write("move_install", target, name=name, move=f"g{source}.{move}", records=records,
                    tensors=arrays, **{"from": source})
        self._router.write("place", 0, name=name, to=target)
        self._router.write("move_done", source, name=name, to=target, move=move)
        self._router.placement[name] = target
        return [r["name"] for r in records]

