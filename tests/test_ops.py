"""Every client op has one complete record (raftps/ops.py), and every table that dispatches on ops
is made from those records: the request schemas, the roles, the server's handlers and the state
machine's handlers."""
import inspect

from raftps import ops, rbac, schema
from raftps.store.machine import TensorStore
from raftps.store.moves import MOVE_OPS
from raftps.server.handlers import Handlers
from raftps.server.server import WRITES


def test_every_op_has_one_complete_record() -> None:
    for name, op in ops.OPS.items():
        assert op.name == name
        assert isinstance(op.request, schema.Record) and {"op", "raft_group"} <= set(op.request.fields), name
        assert op.role in (None, *rbac.ROLES), name
        # every field the role is checked on is a field of the request (or the whole cluster)
        assert all(f in op.request.fields or f == "everything" for f in op.names), name
        if op.serve is None:
            assert name == "hello", "only the hello is answered by the connection itself"
        else:
            handler = getattr(Handlers, op.serve, None)
            assert callable(handler), f"{name}: Handlers has no {op.serve}"
            params = list(inspect.signature(handler).parameters)
            assert params == (["self", "req", "identity"] if op.node_wide else ["self", "node", "req", "identity"]), name
        if op.write:
            assert callable(getattr(TensorStore, op.apply, None)), f"{name}: TensorStore has no {op.apply}"
            # a write carries its client's session: it is applied exactly once
            assert {"client", "seq", "ack"} <= set(op.request.fields), name
        else:
            assert op.entry is None, name


def test_the_tables_are_made_from_the_records() -> None:
    assert ops.REQUESTS == {name: op.request for name, op in ops.OPS.items()}
    assert rbac.NEEDS == {name: (op.role, op.names) for name, op in ops.OPS.items()}
    assert set(WRITES) == {name for name, op in ops.OPS.items() if op.serve == "_write"}
    assert set(WRITES) <= {name for name, op in ops.OPS.items() if op.write}
    entries = {op.entry or op.name: op.apply for op in ops.OPS.values() if op.write}
    assert {k: v for k, v in TensorStore._OPS.items() if k != "barrier"} == \
        {entry: getattr(TensorStore, method) for entry, method in entries.items()}
    assert TensorStore._OPS["barrier"] is None
    assert set(MOVE_OPS) == {"move_freeze", "move_install", "move_done", "place"}
    assert set(ops.served_by_node()) == {"status", "layout"}
    assert set(ops.served_by_node()) | set(ops.served_by_replica()) == set(ops.OPS) - {"hello"}


def test_a_renamed_field_is_a_field_now_and_its_old_name_is_not() -> None:
    """``Op.renamed``: each old name leads to a field the request takes, and is not one itself (so
    the schema would refuse it, were it not renamed first), and "group" alone names no field."""
    renamed = {name: op.renamed for name, op in ops.OPS.items() if op.renamed}
    assert set(renamed) == {"push", "push_sync", "push_step", "close_step", "wait_step", "sync_applied",
                            "ssp_join", "ssp_leave", "ssp_drop", "ssp_wait", "place"}
    for name, pairs in renamed.items():
        for old, new in pairs:
            record = ops.OPS[name].request
            *inner, old_key = old.split(".")
            assert new.split(".")[:-1] == inner, name
            if inner:
                record = record.fields[inner[0]][0]
            assert new.split(".")[-1] in record.fields and old_key not in record.fields, name
    for name, op in ops.OPS.items():
        assert "group" not in op.request.fields and "group" not in op.names, name
