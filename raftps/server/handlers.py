"""What a node answers to each client op (ops.py names the method), once the client server has
checked the request's schema and role: writes through the leader's log, reads (linearizable at
the leader, or from any replica at a min_version), sync steps, SSP waits, moves, membership and
status. A handler gets the replica of the request's Raft group and never touches its internals:
``RaftNode``'s methods are the door."""
from __future__ import annotations

import logging
from typing import Any, Callable

from raftps import codec
from raftps.server.aggregate import StepAggregator
from raftps.errors import InvalidRequest, RaftpsError
from raftps.groups import Layout
from raftps.store.store_snapshot import snapshot_digest
from raftps.server.node import RaftNode, offset_address
from raftps.raft import NotApplied
from raftps.rbac import Identity
from raftps.store.sync_jobs import check_job
from raftps.tensor import check_finite, check_tensors

log = logging.getLogger("raftps.server.server")


def retry(message: str, **extra: Any) -> dict:
    return {"error": "Retry", "retry": True, "message": message, **extra}


def _submit(node: RaftNode, command: dict, tensors: dict | None) -> dict:
    """Replicate a checked write: the state machine's answer, or Retry if it did not commit."""
    try:
        return node.submit(command, tensors)
    except NotApplied as outcome:
        return retry(str(outcome), unknown=outcome.applied is None)
    except RaftpsError as exc:
        exc.submitted = True          # proposed: the client must not reuse its seq
        raise


class Handlers:
    def __init__(self, replicas: dict[int, RaftNode], layout: Layout | None, client_offset: int,
                 limits: codec.Limits, open_connections: Callable[[], int]):
        self.replicas = replicas
        self.layout, self.client_offset = layout, client_offset   # every node's client port: Raft port + offset
        self.limits = limits
        self.open_connections = open_connections
        # each replica's open sync steps while it leads (aggregate.py); a replica started later
        # (a node following the hosts record, hosting.py) gets its own on first use
        self._aggregators: dict[int, StepAggregator] = {}

    def _aggregator(self, group: int, node: RaftNode) -> StepAggregator:
        if group not in self._aggregators or self._aggregators[group].node is not node:
            self._aggregators[group] = StepAggregator(node)
        return self._aggregators[group]

    def _status(self, req: dict, identity: Identity) -> dict:
        """This node's row for its first group; with several groups, ``groups`` has a row per
        hosted group (each with its ``group``)."""
        digest = req.get("digest", True) is not False
        rows = [{**node.status(digest=digest), "group": g, "open_steps": self._aggregator(g, node).open_steps()}
                for g, node in sorted(self.replicas.items())]
        learners = self._learner_rows(digest)
        # a joining node whose only Raft group is still a learner's answers with that row
        first = rows[0] if rows else {**learners[0], "role": "down"} if learners else {"role": "down"}
        return {**first, "connections": self.open_connections(), **({"groups": rows} if len(rows) > 1 else {}),
                **({"learners": learners} if learners else {})}

    def _learner_rows(self, digest: bool) -> list[dict]:
        """A row per learner this node runs (hosting.py), role "learner"; one handing over to its
        voter meanwhile is left out (stopped, it has no status to give)."""
        rows = []
        for g, node in sorted(dict(getattr(self.layout, "learners", {})).items()):
            try:
                rows.append({**node.status(digest=digest), "group": g})
            except (RuntimeError, OSError, ValueError, AttributeError):
                continue
        return rows

    def _layout(self, req: dict, identity: Identity) -> dict:
        """How many Raft groups, which nodes are members of each, and every node's client address."""
        offset = self.client_offset
        if self.layout is None:
            return {"groups": 1, "nodes": [], "members": [[]]}
        return {"groups": self.layout.groups,
                "nodes": [offset_address(a, offset) for a in self.layout.nodes],
                "members": [self.layout.members(g) for g in range(self.layout.groups)]}

    def _not_leader(self, node: RaftNode) -> dict | None:
        if node.is_leader():
            return None
        leader = node.leader_client_address()
        return retry(f"not the leader; leader is {leader or 'unknown'}", not_leader=True, leader=leader)

    def _write(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        # The schema checked client, seq, ack and every other field (schema.py).
        command = {k: v for k, v in req.items() if k not in ("tensors", "held", "held_names")}
        tensors = req.get("tensors")
        if "held" in req:        # sent again without its arrays: this node's copy, if it has one
            tensors = node.held_payload(f"{req['client']}-{req['seq']}-{req['held']}")
            if tensors is None:
                return retry("this node does not hold that payload: send it", need_payload=True)
            if sorted(tensors) != sorted(req["held_names"]):
                raise InvalidRequest(f"{req['op']}: held_names {sorted(req['held_names'])[:5]} are not the names "
                                     f"of the held payload")
        if tensors is not None:
            for name, arr in check_tensors(tensors).items():
                # Refused here so a NaN gradient costs no replication; the state machine checks again.
                check_finite(name, arr, "initial value" if req["op"] == "create" else
                             "value" if req["op"] == "assign" else "gradient")
        return _submit(node, command, tensors)

    def _push_step(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """A sync step contribution, summed on the leader with the step's others and answered
        when the step's one entry is applied (aggregate.py)."""
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        grads = check_tensors(req["tensors"])     # each checked against its tensor by the aggregator
        try:
            return self._aggregator(req.get("raft_group", 0), node).contribute(req, grads)
        except NotApplied as outcome:
            return retry(str(outcome), unknown=outcome.applied is None)

    def _check_move(self, req: dict) -> None:
        """What the state machine cannot know: the cluster's groups, and which one this is."""
        groups = self.layout.groups if self.layout is not None else 1
        if groups == 1:
            raise InvalidRequest(f"{req['op']}: this cluster has one Raft group: there is no other group to move "
                                 "tensors to (serve --groups G, G > 1)")
        here = req.get("raft_group", 0)
        if req["op"] == "place" and here != 0:
            raise InvalidRequest(f"place: the placement table lives in Raft group 0, not {here}")
        target = req.get("to", 0)
        if target >= groups:
            raise InvalidRequest(f"{req['op']}: Raft group {target} is out of range: this cluster has groups "
                                 f"0..{groups - 1}")
        if req["op"] in ("move_freeze", "move_done") and target == here:
            raise InvalidRequest(f"{req['op']}: tensor {req['name']!r} cannot move to the group it is in ({here})")

    def _move_write(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """A step of a move: like _write, but move_install's arrays are a tensor's data and
        optimizer state, named by part ("0", "0.m", ...), not tensors (the state machine checks them)."""
        self._check_move(req)
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        return _submit(node, {k: v for k, v in req.items() if k != "tensors"}, req.get("tensors"))

    def _parts_write(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """assign_state: like _write, but its arrays are named by part ("0", "0.m", ...), not
        tensors (the state machine checks each against its tensor)."""
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        return _submit(node, {k: v for k, v in req.items() if k != "tensors"}, req.get("tensors"))

    def _move_state(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """Where a tensor stands in this group (linearizable); ``full``: its frozen state to install."""
        self._check_move(req)
        reply = self._linearizable(node, lambda m: m.move_state(req["name"], req.get("full", False)))
        return {**reply, "max_frame_bytes": self.limits.max_blob_bytes}    # what this node accepts in a frame

    def _placement(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """Group 0's table of tensors placed elsewhere than their hash: the names the identity may read."""
        if req.get("raft_group", 0) != 0:
            raise InvalidRequest("placement: the placement table lives in Raft group 0")
        readable = None if identity.unrestricted else (lambda n: identity.allows("read", n))
        return self._linearizable(node, lambda m: {"version": m.version, "placement": {
            n: g for n, g in m.placement_table().items() if readable is None or readable(n)}})

    def _hosts(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """Group 0's hosts record as this replica has applied it (None: the formula holds); the
        nodes follow the newest epoch they are shown (hosting.py)."""
        _group_0("hosts", req)
        return {"hosts": node.read_locked(lambda m: m.hosts.snapshot())}

    def _hosts_write(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """A hosts change, with the formula's record this node started from as the base of the first."""
        _group_0("hosts_change", req)
        if self.layout is None or self.layout.groups == 1:
            raise InvalidRequest("hosts_change: hosts are placed per Raft group only with several groups "
                                 "(serve --groups G, G > 1); a one-group cluster changes members with raftps member")
        return self._write(node, {**req, **self.layout.base_fields()}, identity)

    def _pull(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        names = req.get("names")
        readable = None if identity.unrestricted else (lambda n: identity.allows("read", n))
        if req.get("linearizable", True):
            read = self._linearizable(node, lambda m: m.read(names if names is not None or readable is None
                                                         else [n for n in sorted(m.tensors) if readable(n)]))
            if isinstance(read, dict):
                return read
            tensors, version = read
        else:
            behind = self._behind(node, req)
            if behind:
                return behind
            tensors, version = node.read(names)
            if names is None and readable is not None:        # all the identity may read
                tensors = {n: t for n, t in tensors.items() if readable(n)}
        return {"version": version,
                "tensors": {name: t.data for name, t in tensors.items()},
                "tensor_versions": {name: t.version for name, t in tensors.items()}}

    def _pull_rows(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """Some rows of one tensor, copied under the apply lock (or in the tick thread): O(rows)."""
        name, rows = req.get("name"), req.get("rows")

        def read(m: Any) -> dict:
            values, tensor_version, version = m.read_rows(name, rows)
            return {"version": version, "rows": values, "tensor_version": tensor_version}
        if req.get("linearizable", True):
            return self._linearizable(node, read)
        behind = self._behind(node, req)
        if behind:
            return behind
        return node.read_locked(read)

    def _behind(self, node: RaftNode, req: dict) -> dict | None:
        """A read from any node: None once this node has applied the request's min_version
        (waiting up to its ``wait``, at most 10 s), else the reply that sends the client on."""
        min_version = req.get("min_version") or 0
        if type(min_version) is not int:
            raise InvalidRequest("min_version must be an int")
        if node.wait_version(min_version, timeout=min(_seconds(req.get("wait", 2.0), "wait"), 10.0)):
            return None
        return retry(f"this node has applied only up to {node.version} < {min_version}", behind=True)

    def _linearizable(self, node: RaftNode, fn: Callable[[Any], Any]) -> Any:
        """``fn(machine)``'s reply, run through the leader's log (see RaftNode.linearizable), or
        the reply that sends the client on."""
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        try:
            return node.linearizable(fn)
        except NotApplied as outcome:
            return retry(str(outcome))

    def _tensors(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        # Metadata only, taken in the tick thread: no array leaves the state machine. Only the
        # tensors under ``prefix`` that the identity may read.
        prefix = req.get("prefix") or ""
        return self._linearizable(node, lambda m: {"version": m.version, "tensors": [
            {"name": n, "dtype": str(t.data.dtype), "shape": list(t.data.shape), "version": t.version,
             "optimizer": t.optimizer} for n, t in sorted(m.tensors.items())
            if n.startswith(prefix) and (identity.unrestricted or identity.allows("read", n))]})

    def _export(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """Every tensor whose name starts with ``prefix``, with the store's version and digest,
        all from one state read through the leader's log (``raftps export``)."""
        prefix = req.get("prefix")
        if not isinstance(prefix, str) or not prefix:
            raise InvalidRequest("export needs a non-empty 'prefix' string")

        def take(m: Any) -> dict:        # tick thread: no copy, no hashing
            return {"version": m.version, "snap": m.snapshot(),
                    "chosen": [(n, t) for n, t in sorted(m.tensors.items()) if n.startswith(prefix)]}
        out = self._linearizable(node, take)
        if "snap" not in out:
            return out                   # a redirect or a retry
        chosen = out["chosen"]
        return {"version": out["version"], "digest": snapshot_digest(out["snap"]),
                "tensors": {n: t.data for n, t in chosen}, "tensor_versions": {n: t.version for n, t in chosen},
                "optimizers": {n: t.optimizer for n, t in chosen},
                **({"states": {n: t.state for n, t in chosen}} if req.get("state") else {})}

    def _snapshot(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """The whole state machine at one version with its digest (``raftps snapshot save``):
        taken between two applies in the tick thread, hashed and encoded outside it."""
        out = self._linearizable(node, lambda m: {"version": m.version, "snap": m.snapshot()})
        if "snap" not in out:
            return out
        return {"version": out["version"], "digest": snapshot_digest(out["snap"]), "snapshot": out["snap"]}

    def _member(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        """raftps member list|add|remove|replace: one Raft single-server change at a time, on
        the leader. Each step is idempotent, so a retried replace goes on where it stopped."""
        action = req.get("action")
        if action not in ("list", "add", "remove", "replace"):
            raise InvalidRequest("member needs action: list, add, remove or replace")
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        if action == "list":
            return {"members": node.members, "leader": node.config.raft_address}
        new = _raft_address(req.get("node"))
        old = _raft_address(req.get("old")) if action == "replace" else None
        if old == new:
            raise InvalidRequest(f"replace {old} with itself")
        if self.layout is not None and self.layout.groups > 1:    # only the hosts record's move (hosting.py)
            refusal = self.layout.member_change_refusal(req.get("raft_group", 0), action, new)
            if refusal:
                raise InvalidRequest(refusal)
        try:
            if action != "replace":
                return node.change_members(action, new)
            # A live old member stays until the new one is in (a 3-node cluster keeps its majority
            # with one node down either way); a dead one goes first, so that the new member's
            # entry commits with the live ones before the new node is even up.
            steps = [("add", new), ("remove", old)] if node.is_connected(old) or \
                old == node.config.raft_address else [("remove", old), ("add", new)]
            changed = False
            for step, address in steps:
                changed = node.change_members(step, address)["changed"] or changed
            return {"changed": changed, "members": node.members}
        except NotApplied as outcome:
            return retry(str(outcome), not_leader=not node.is_leader(), leader=None,
                          unknown=outcome.applied is None)

    def _stats(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        return self._not_leader(node) or node.stats()

    def _wait_step(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        step = req.get("step")
        if type(step) is not int:
            raise InvalidRequest("wait_step needs step (int) and timeout (seconds)")
        job = check_job(req.get("job"))
        return {"version": node.wait_step(step, min(_seconds(req.get("timeout", 10.0), "timeout"), 300.0), job)}

    def _sync_applied(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        job = check_job(req.get("job"))
        return self._linearizable(node, lambda m: {"version": m.version, "applied": m.sync_step_applied(job)})

    def _ssp_wait(self, node: RaftNode, req: dict, identity: Identity) -> dict:
        redirect = self._not_leader(node)
        if redirect:
            return redirect
        ssp_group, worker = req.get("ssp_group"), req.get("worker")
        if not isinstance(ssp_group, str) or not isinstance(worker, str):
            raise InvalidRequest("ssp_wait needs ssp_group (str), worker (str) and timeout (seconds)")
        return node.wait_ssp(ssp_group, worker, min(_seconds(req.get("timeout", 10.0), "timeout"), 300.0))


def _group_0(op: str, req: dict) -> None:
    if req.get("raft_group", 0) != 0:
        raise InvalidRequest(f"{op}: the hosts record lives in Raft group 0")


def _raft_address(value: Any) -> str:
    """A member's Raft address, host:port (the --peers form)."""
    if isinstance(value, str) and ":" in value and 0 < len(value) <= 255:
        host, port = value.rsplit(":", 1)
        if host and port.isdigit() and 0 < int(port) < 65536 - 300:
            return value
    raise InvalidRequest(f"a member is its Raft address HOST:PORT (as in --peers), not {value!r}")


def _seconds(value: Any, field: str) -> float:
    """A duration from a request: a finite number >= 0 (NaN would make a wait never end)."""
    if type(value) not in (int, float) or not 0 <= value < float("inf"):
        raise InvalidRequest(f"{field!r} must be a finite number of seconds >= 0, not {value!r}")
    return float(value)
