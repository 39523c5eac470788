"""The back-off fix's two rules on their own (the live reproduction is test_livelock.py)."""
from raftps.raft.pysyncobj_fixes import commit_guard, follower_hint, leader_filter


def reply(idx: int, reset: bool = True, success: bool = False) -> dict:
    return {"type": "next_node_idx", "next_node_idx": idx, "reset": reset, "success": success}


def test_later_past_the_end_replies_cannot_undo_the_back_off() -> None:
    floors: dict = {}
    seq = [618, 617, 618, 618, 616, 618]            # the unpatched leader would end at 618
    got = [leader_filter(floors, "f", reply(i), term=5)["next_node_idx"] for i in seq]
    assert got == [618, 617, 617, 617, 616, 616]


def test_success_or_new_term_clears_the_floor() -> None:
    floors: dict = {}
    leader_filter(floors, "f", reply(610), term=5)
    assert leader_filter(floors, "f", reply(700, reset=False, success=True), term=5)["next_node_idx"] == 700
    assert leader_filter(floors, "f", reply(720), term=5)["next_node_idx"] == 720
    assert leader_filter(floors, "f", reply(730), term=6)["next_node_idx"] == 730
    assert leader_filter(floors, "f", reply(5, reset=False), term=6)["next_node_idx"] == 5   # transmission acks


def test_follower_asks_for_at_most_commit_plus_one() -> None:
    assert follower_hint(reply(618), commit_index=609)["next_node_idx"] == 610
    assert follower_hint(reply(605), commit_index=609)["next_node_idx"] == 605
    assert follower_hint(reply(700, reset=False, success=True), 609)["next_node_idx"] == 700


def test_a_follower_whose_snapshot_is_past_its_commit_index_asks_after_the_snapshot() -> None:
    # a replica started on a snapshot at 1136 with its journal's commit index still 1: the caller
    # passes max(commit, applied), so the follower asks for 1137 (its log holds 1135..1136), not 2
    assert follower_hint(reply(1137), commit_index=max(1, 1136))["next_node_idx"] == 1137


def test_snapshot_placeholder_cannot_raise_the_commit_index() -> None:
    empty = {"type": "append_entries", "term": 5, "commit_index": 900, "serialized": None}
    assert commit_guard(empty, 609)["commit_index"] == 609
    checked = {"type": "append_entries", "term": 5, "commit_index": 900, "prevLogIdx": 899,
               "prevLogTerm": 5, "entries": []}
    assert commit_guard(checked, 609)["commit_index"] == 900
    chunk = {"type": "append_entries", "term": 5, "commit_index": 900, "serialized": (b"x", True, False)}
    assert commit_guard(chunk, 609)["commit_index"] == 900
