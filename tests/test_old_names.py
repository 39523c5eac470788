"""Fields renamed when "group" stopped meaning three things (a Raft group, a job, an SSP group):
a log entry, a snapshot or a client of before (over a real socket, to a real node) applies,
restores and is answered as today.

``data/old_names_snapshot.bin`` is the snapshot that the code of before the renaming (main at
c91e5e0) wrote after applying ``entries(old=True)``: made with that checkout's raftps first on
``sys.path`` by this file's ``main(OUT)``, which printed its digest, ``OLD_DIGEST``.
"""
import pathlib
import sys

import numpy as np
import pytest

from raftps import codec
from raftps.store.machine import TensorStore

F32 = np.float32
SNAPSHOT = pathlib.Path(__file__).parent / "data" / "old_names_snapshot.bin"
BASE_PORT = 18400        # one node: raft 18401, client 18501, data plane 18601
OLD_DIGEST = "347ca2977042ff88e0f7cfb520f4864e993b9016d21a39fa9a0c078210746dac"


def entries(old: bool) -> list[dict]:
    """A log that names a job, an SSP group and a Raft group in every op that carries one, under
    the old field names (``old``) or today's."""
    job, ssp_group, to = ("group", "group", "group") if old else ("job", "ssp_group", "to")
    seq: dict[str, int] = {}

    def w(op: str, client: str, **fields) -> dict:
        seq[client] = seq.get(client, 0) + 1
        return {"op": op, "client": client, "seq": seq[client], "ack": seq[client], **fields}
    one = np.ones(4, F32)
    return [
        w("create", "admin", tensors={"w": np.zeros(4, F32), "s": np.zeros(4, F32)},
          optimizer={"w": {"name": "sgd", "lr": 0.5}, "s": {"name": "momentum", "lr": 0.25, "momentum": 0.9}}),
        w("push_sync", "a", tensors={"w": one}, step=0, workers=2, rank=0, **{job: "jobA"}),
        w("push_sync", "b", tensors={"w": 3 * one}, step=0, workers=2, rank=1, **{job: "jobA"}),
        w("push_sync", "a", tensors={"w": one}, step=1, workers=2, rank=0, **{job: "jobA"}),
        w("close_step", "a", step=1, **{job: "jobA"}),
        w("push_sync", "a", tensors={"w": one}, step=0, workers=3, **{job: "jobB"}),   # left open
        {"op": "step", job: "jobC", "step": 0, "workers": 2, "count": 2, "tensors": {"w": 4 * one},
         "contributors": [["c", 1, 1, True], ["d", 1, 1, True]]},
        w("ssp_join", "e", worker="e", staleness=1, **{ssp_group: "sspA"}),
        w("ssp_join", "f", worker="f", staleness=1, **{ssp_group: "sspA"}),
        w("push", "e", tensors={"s": one}, ssp={ssp_group: "sspA", "worker": "e"}),
        w("push", "e", tensors={"s": one}, ssp={ssp_group: "sspA", "worker": "e"}),
        w("push", "e", tensors={"s": one}, ssp={ssp_group: "sspA", "worker": "e"}),   # refused: 2 ahead, bound 1
        w("ssp_drop", "e", worker="f", clock=0, **{ssp_group: "sspA"}),
        w("ssp_join", "g", worker="g", staleness=None, **{ssp_group: "sspB"}),
        w("ssp_leave", "g", worker="g", **{ssp_group: "sspB"}),
        w("place", "admin", name="elsewhere", **{to: 3}),
        # refused: their error messages are kept in the sessions, so in the snapshot, as they were
        w("push_sync", "a", tensors={"w": one}, step=0, workers=2, **{job: "no spaces!"}),
        w("ssp_join", "h", worker="", staleness=None, **{ssp_group: "sspB"}),
        w("push", "h", tensors={"s": one}, ssp={ssp_group: "sspB", "worker": 7}),
        {"op": "step", job: "jobC", "step": 1, "workers": 2, "count": 3, "contributors": [["h", 3, 3, True]]},
        w("place", "admin", name="elsewhere", **{to: -1}),
    ]


def applied(old: bool) -> tuple[TensorStore, list[dict]]:
    store = TensorStore()
    results = [store.apply(i, entry) for i, entry in enumerate(entries(old), 1)]
    return store, results


def test_an_entry_under_old_names_applies_exactly_as_under_new_ones():
    old, old_results = applied(old=True)
    new, new_results = applied(old=False)
    assert codec.encode_bytes(old_results) == codec.encode_bytes(new_results)
    assert old.digest() == new.digest()
    assert codec.encode_bytes(old.snapshot()) == codec.encode_bytes(new.snapshot())
    # what the log did, so that the comparison is of something
    assert new.sync_step_applied("jobA") == 1 and new.sync_count("jobB", 0) == 1 and new.sync_step_applied("jobC") == 0
    assert new_results[11]["error"] == "StalenessBound" and new_results[12]["dropped"] is True
    assert new.ssp_state("sspA") == {"staleness": 1, "clocks": {"e": 2}} and new.ssp_state("sspB")["clocks"] == {}
    assert new.placement_table() == {"elsewhere": 3}
    assert [r["error"] for r in new_results[-5:]] == ["InvalidRequest"] * 5


def test_the_code_of_before_wrote_the_same_state_and_its_snapshot_restores():
    """The snapshot the code of before wrote from the old-named log: today's code, applying the
    same log (under either names), reaches the same bits, and restores that snapshot exactly."""
    snap = codec.decode(bytearray(SNAPSHOT.read_bytes()))
    restored = TensorStore()
    restored.restore(snap)
    new, _ = applied(old=False)
    assert restored.digest() == new.digest() == applied(old=True)[0].digest() == OLD_DIGEST
    assert codec.encode_bytes(restored.snapshot()) == codec.encode_bytes(new.snapshot())
    # and the restored store goes on as the applied one does
    more = {"op": "push_sync", "client": "b", "seq": 9, "ack": 9, "tensors": {"w": np.ones(4, F32)},
            "step": 0, "workers": 3, "group": "jobB"}
    assert restored.apply(99, dict(more)) == new.apply(99, {**{k: v for k, v in more.items() if k != "group"},
                                                            "job": "jobB"})
    assert restored.digest() == new.digest()


@pytest.mark.parametrize("entry, words", [
    ({"op": "push_sync", "tensors": {"w": np.ones(4, F32)}, "step": 0, "workers": 1, "group": "a", "job": "b"},
     "push_sync: 'group' is the old name of 'job', and this push_sync carries both, with different values"),
    ({"op": "ssp_join", "worker": "w", "group": "a", "ssp_group": "b"}, "'group' is the old name of 'ssp_group'"),
    ({"op": "push", "tensors": {"w": np.ones(4, F32)}, "ssp": {"group": "a", "ssp_group": "b", "worker": "w"}},
     "'ssp.group' is the old name of 'ssp.ssp_group'"),
    ({"op": "place", "name": "x", "group": 1, "to": 2}, "'group' is the old name of 'to'"),
])
def test_an_entry_with_both_names_and_two_values_is_refused_and_changes_nothing(entry, words):
    store, _ = applied(old=False)
    before = store.snapshot()
    result = store.apply(1000, {"client": "z", "seq": 1, "ack": 1, **entry})
    assert result["error"] == "InvalidRequest" and words in result["message"]
    after = store.snapshot()
    # the refusal is counted (stats) and nothing else changed
    assert before["tensors"] == after["tensors"] and before["sync"] == after["sync"] \
        and before["ssp"] == after["ssp"] and before["moves"] == after["moves"]


def test_both_names_with_one_value_are_taken_as_one():
    store, _ = applied(old=False)
    twin, _ = applied(old=False)
    fields = {"op": "close_step", "client": "z", "seq": 1, "ack": 1, "step": 0}
    assert store.apply(1000, {**fields, "job": "jobB", "group": "jobB"}) == twin.apply(1000, {**fields, "job": "jobB"})
    assert store.digest() == twin.digest()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One real node: a client of before speaks to it over a TCP socket, as it did."""
    from tests.conftest import start_cluster
    cl = start_cluster(tmp_path_factory.mktemp("old-names") / "run", BASE_PORT, nodes=1)
    yield cl
    cl.wipe()


@pytest.fixture
def client(cluster):
    """A Client over a real socket; each test names its own tensor, jobs and SSP groups."""
    with cluster.client(timeout=10.0) as c:
        for name in ("w", "w2"):
            c.create(name, np.zeros(4, F32), {"name": "sgd", "lr": 1.0})
        yield c


def test_a_client_of_before_is_served_and_two_values_under_two_names_are_refused(client):
    from raftps.errors import InvalidRequest

    def write(op, **fields):
        seq = client._session.next_seq(0)[0]
        try:
            return client._router.request({"op": op, "client": client.client_id, "seq": seq, "ack": seq, **fields})
        finally:
            client._session.answered(0, seq, refused=False)
    one = np.ones(4, F32)
    assert write("push_sync", tensors={"w": one}, step=0, workers=1, group="jobA")["applied"]
    assert client._router.request({"op": "sync_applied", "group": "jobA"})["applied"] == 0 == client.sync_applied(job="jobA")
    assert client._router.request({"op": "wait_step", "step": 0, "timeout": 1.0, "group": "jobA"})["version"] > 0
    assert write("ssp_join", group="sspA", worker="a", staleness=None)["clock"] == 0
    assert write("push", tensors={"w": one}, ssp={"group": "sspA", "worker": "a"})["clock"] == 1
    assert client._router.request({"op": "ssp_wait", "group": "sspA", "worker": "a", "timeout": 0.0})["clock"] == 1
    with pytest.raises(InvalidRequest, match="push_sync: 'group' is the old name of 'job', and this push_sync "
                                             "carries both, with different values"):
        write("push_sync", tensors={"w": one}, step=1, workers=1, group="jobA", job="jobB")
    with pytest.raises(InvalidRequest, match="'ssp.group' is the old name of 'ssp.ssp_group'"):
        write("push", tensors={"w": one}, ssp={"group": "sspA", "ssp_group": "sspB", "worker": "a"})
    assert client.sync_applied("jobA") == 0 and client.sync_applied("jobB") == -1
    assert client.pull(["w"])[0]["w"][0] == -2.0      # the two refused writes changed nothing


def test_a_public_keyword_of_before_works_with_a_deprecation_warning(client):
    with pytest.warns(DeprecationWarning, match=r"push_sync_result\(group=...\) is deprecated: pass job=..."):
        assert client.push_sync_result({"w2": np.ones(4, F32)}, 0, 1, group="jobD")["applied"]
    with pytest.warns(DeprecationWarning, match="pass ssp_group="):
        assert client.ssp_join(group="sspD", worker="a", staleness=None) == 0
    with pytest.warns(DeprecationWarning):
        assert client.sync_applied(group="jobD") == 0
    with pytest.raises(TypeError, match="got both group= .* and job="):
        client.close_step(1, group="jobD", job="jobD")


def main(out: str) -> None:
    """Write the snapshot of ``entries(old=True)`` applied by the raftps this runs with."""
    store, _ = applied(old=True)
    pathlib.Path(out).write_bytes(codec.encode_bytes(store.snapshot()))
    print(store.digest())


if __name__ == "__main__":
    main(sys.argv[1])


def test_the_documented_module_paths_still_import_the_same_objects():
    """Issue 38 moved the modules into rooms (store/, server/, client/, tools/); the paths the
    README, docs and examples name stay valid and hand out the very same objects."""
    import raftps
    import raftps.tools.cli
    import raftps.tools.launch
    import raftps.tools.localcluster
    from raftps.cli import OneLineParser, main
    from raftps.client import Client
    from raftps.launch import PerRankJob
    from raftps.localcluster import LocalCluster
    assert (OneLineParser, main) == (raftps.tools.cli.OneLineParser, raftps.tools.cli.main)
    assert PerRankJob is raftps.tools.launch.PerRankJob
    assert LocalCluster is raftps.tools.localcluster.LocalCluster
    assert Client is raftps.Client
