"""bench/elastic.py's pure parts: its arguments, the rate windows, the issue's refill bound and the
report's verdicts, each against figures worked by hand (the cluster run itself is the bench)."""
from __future__ import annotations

import pytest

from bench import elastic
from raftps.groups import group_of


def test_a_tensor_name_for_every_group():
    names = elastic.tensor_per_group("big")
    assert sorted(names) == list(range(6)) and all(group_of(n, 6) == g for g, n in names.items())


def test_rates_count_the_stamps_inside_each_window():
    stamps = [0.1, 0.5, 0.9, 1.2, 2.5, 2.7, 3.9]
    assert elastic.rate(stamps, 0.0, 2.0) == pytest.approx(4 / 2.0)    # 0.1 0.5 0.9 1.2
    assert elastic.rate(stamps, 2.0, 4.0) == pytest.approx(3 / 2.0)
    assert elastic.per_second(stamps, 0.0, 3.5) == [3, 1, 2]          # the partial fourth second left out


def test_the_refill_bound_is_timeout_plus_copy_plus_ten_seconds():
    # 10 s timeout, 300 MB at 150 MB/s = 2 s of copy, 10 s of margin
    assert elastic.refill_target(10.0, 300_000_000, 150.0) == pytest.approx(22.0)


def report_input(ratio_during: float, refill_s: float) -> dict:
    return {"groups": 6, "nodes": 5, "mib": 12, "dead_host_timeout_s": 5.0, "baseline_s": 8.0, "push_bytes": 4096,
            "machine": "m", "date": "d", "loadavg_1m_start": 1.0, "loadavg_1m_end": 2.0,
            "bytes_total": 12 * 2**20, "data_plane_mb_s_before": 200.0, "data_plane_mb_s_after": 400.0,
            "data_plane_mb_s": 400.0, "rebalance_s": 20.0, "groups_moved_to_new": 3, "bytes_moved": 6 * 2**20,
            "push_rate_before": 100.0, "push_rate_during": ratio_during * 100.0, "push_ratio": ratio_during,
            "push_rate_per_s": [100, 90], "pushes_acked": 1000, "pushes_unanswered": 0, "push_errors": [],
            "dead_node": 6, "dead_groups": [1, 2, 3], "bytes_to_copy": 4_000_000, "refill_s": refill_s,
            "refill_target_s": 5.0 + 4.0 / 400.0 + 10.0, "after_add": {"serving": {}, "leading": {}},
            "after_kill": [], "rebalance_timeline": [[0.4, "epoch 1: no move"]], "refill_timeline": []}


def test_the_report_says_which_targets_were_met():
    both = elastic.report(report_input(0.8, 12.0))
    assert "**0.80x** | >= 0.7x: met" in both and "= 15.0 s: met" in both and "NOT" not in both
    neither = elastic.report(report_input(0.5, 15.5))
    assert ">= 0.7x: NOT met" in neither and "= 15.0 s: NOT met" in neither


def test_bad_arguments_get_one_clear_error(capsys):
    for args, message in ((["--mib", "2"], "--mib 2: at least 6"),
                          (["--dead-host-timeout", "0"], "--dead-host-timeout 0: must be more than 0"),
                          (["--baseline", "-1"], "--baseline -1: must be more than 0")):
        with pytest.raises(SystemExit):
            elastic.parse_args(args)
        assert message in capsys.readouterr().err
    assert elastic.parse_args(["--mib", "128"]).mib == 128


def test_the_report_says_whether_the_refilled_replicas_agree():
    assert "hold the same version and digest 21.5 s after" in elastic.report(
        {**report_input(0.8, 12.0), "replicas_agree_s": 21.5})
    said = elastic.report({**report_input(0.8, 12.0), "replicas_agree_s": None, "replicas_disagree": "not within 60 s"})
    assert "did NOT agree: not within 60 s" in said


def test_the_report_gives_the_loops_learner_and_voting_window_figures():
    scrape = dict.fromkeys(elastic.LOOP_METRICS, 0.0)
    later = {**scrape, "raftps_catch_up_seconds_sum": 6.0, "raftps_catch_up_seconds_count": 3.0,
             "raftps_catch_up_bytes_total": 3 * 2**20, "raftps_voting_window_seconds_sum": 1.5,
             "raftps_voting_window_seconds_count": 3.0}
    moves = elastic.loop_delta(scrape, later)
    assert moves == {"moves_learned": 3, "learner_mean_s": 2.0, "learner_mib": 3.0, "moves_voted": 3,
                     "voting_window_mean_s": 0.5}
    said = elastic.report({**report_input(0.8, 12.0), "rebalance_moves": moves,
                           "refill_moves": elastic.loop_delta(scrape, scrape)})
    assert "Moves of the rebalance (the placement loop's /metrics): 3 learner catch-up(s), 3.0 MiB, mean 2.00 s; " \
        "3 voting window(s)" in said and "mean 0.50 s." in said
    assert "Moves of the refill (the placement loop's /metrics): 0 learner catch-up(s), 0.0 MiB, mean -" in said
