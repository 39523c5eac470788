"""A synchronous step with pairs' contributions (push_step's ``ranks``, pair_steps.py): the
leader counts a contribution by the ranks it covers and sums in the order of their lowest rank,
so the step's sum is the pairwise sum (g0 + g1) + (g2 + g3), whatever the arrival order; a
contribution that covers a rank already counted changes nothing; a bad ``ranks`` is refused by
name before anything is held."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from raftps.errors import InvalidRequest
from raftps.ops import check_request
from raftps.server.aggregate import _Step


def gradients(k: int = 4, n: int = 4096, seed: int = 11) -> list[np.ndarray]:
    """float32 values of magnitudes 1e-4..1e4, mixed signs: sums in different orders differ in bits."""
    rng = np.random.default_rng(seed)
    return [(rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-4, 4, n)).astype(np.float32) for _ in range(k)]


def test_pair_contributions_sum_pairwise_in_rank_order_whatever_the_arrival() -> None:
    g = gradients()
    # the independent reference: numpy, by hand, in the pairs' rank order
    pairwise = np.add(np.add(g[0], g[1]), np.add(g[2], g[3]))
    in_series = np.add(np.add(np.add(g[0], g[1]), g[2]), g[3])
    assert pairwise.tobytes() != in_series.tobytes(), "the two orders must differ, or this test cannot fail"
    contributions = [([0, 1], g[0] + g[1]), ([2, 3], g[2] + g[3])]
    for order in itertools.permutations(contributions):
        s = _Step("job", 0, 4, ["w"], True, None, None, deadline=0.0)
        for ranks, grad in order:
            assert s.add({"w": grad}, ranks)
        assert s.count == 4
        assert s.total()["w"].tobytes() == pairwise.tobytes()


def test_a_fallback_rank_beside_a_pair_sums_at_its_own_rank() -> None:
    g = gradients()
    want = np.add(np.add(g[0], g[1]), g[2] + g[3])      # by lowest rank: 0, 1, then the pair [2, 3]
    for order in itertools.permutations([([0], g[0]), ([1], g[1]), ([2, 3], g[2] + g[3])]):
        s = _Step("job", 0, 4, ["w"], True, None, None, deadline=0.0)
        for ranks, grad in order:
            assert s.add({"w": grad}, ranks)
        assert s.count == 4 and s.total()["w"].tobytes() == want.tobytes()


def test_a_contribution_overlapping_counted_ranks_changes_nothing() -> None:
    g = gradients()
    s = _Step("job", 0, 4, ["w"], True, None, None, deadline=0.0)
    assert s.add({"w": g[1]}, [1])                       # rank 1 fell back to its own contribution
    before = s.total()["w"].tobytes()
    assert not s.add({"w": g[0] + g[1]}, [0, 1]), "rank 1 would count twice"
    assert not s.add({"w": g[1]}, [1])
    assert s.count == 1 and s.ranks == {1}
    assert s.total()["w"].tobytes() == before


def request(**fields) -> dict:
    return {"op": "push_step", "client": "c1", "seq": 1, "step": 0, "workers": 4,
            "tensors": {"w": np.zeros(2, np.float32)}, **fields}


@pytest.mark.parametrize("ranks, says", [
    ("01", "ranks"), ([0, 0], "distinct"), ([1, 0], "increasing"), ([2, 4], "workers=4"),
    ([0, 1, 2], "ranks"), ([], "ranks"), ([0.5, 1], "ranks[0]")])
def test_a_bad_ranks_field_is_refused_by_name(ranks, says: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_request(request(ranks=ranks))
    assert "ranks" in str(err.value) and says in str(err.value), str(err.value)


def test_rank_beside_ranks_must_be_their_lowest() -> None:
    with pytest.raises(InvalidRequest, match="the lowest of ranks"):
        check_request(request(ranks=[2, 3], rank=3))
    assert check_request(request(ranks=[2, 3], rank=2))["ranks"] == [2, 3]


def test_pairs_without_what_they_need_are_refused_before_any_io() -> None:
    from raftps.client.client import Client
    with Client("127.0.0.1:1", token="t") as client:     # nothing listens there: nothing is sent
        for kwargs in ({"pull": True, "rank": 0}, {"pull": False, "rank": 0, "chunk_bytes": 100},
                       {"pull": True, "chunk_bytes": 100}):
            with pytest.raises(ValueError, match="pairs=True needs pull=True, a rank and chunk_bytes > 0"):
                client.push_step({"w": np.zeros(2, np.float32)}, 0, 4, pairs=True, **kwargs)
