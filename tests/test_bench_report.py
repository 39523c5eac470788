"""The benchmark report: ratios and target verdicts from records (no network, no timing)."""
from bench import report
from bench.common import MiB


def push(system, size, clients, ops, mbps):
    return {"system": system, "op": "push", "size": size, "clients": clients, "ops_per_s": ops, "MB_per_s": mbps,
            "p50_ms": 10.0, "p99_ms": 20.0, "peak_rss_mb": 100.0, "rss_ratio": 2.0, "model_state_mb": 5.0,
            "rss_target_ok": True, "duration": 3.0}


def verdicts(records):
    return {what: (value, met) for what, _, value, met in report.targets(records)}


def test_etcd_failover_and_training_targets_are_ratios_of_the_same_run():
    records = [push("raftps-3", MiB, 4, 100.0, 104.9), push("etcd", MiB, 4, 20.0, 21.0),
               push("raftps-3", 4 * MiB, 4, 60.0, 251.7), push("etcd", 4 * MiB, 4, 5.0, 21.0),
               {"system": "raftps-3", "op": "failover", "kills": 10, "measured": 10, "median_s": 2.5},
               {"system": "train", "op": "raw_push", "ops_per_s": 50.0},
               {"system": "train", "op": "train", "setting": "local x1", "updates": 26, "upd_per_s": 60.0},
               {"system": "train", "op": "train", "setting": "async x4", "updates": 39, "upd_per_s": 25.0,
                "steady_upd_per_s": 31.0},
               {"system": "train", "op": "train", "setting": "downpour x4", "updates": 41, "upd_per_s": 10.0,
                "steady_upd_per_s": 11.0}]
    v = verdicts(records)
    value, met = v["3-node / etcd 3.4 MB/s, 1 MiB x4"]
    assert abs(value - 104.9 / 21.0) < 1e-9 and met is False
    value, met = v["3-node / etcd 3.4 MB/s, 4 MiB x4"]
    assert abs(value - 251.7 / 21.0) < 1e-9 and met is True
    assert v["failover median, 10/10 leader SIGKILLs (s)"] == (2.5, False)
    assert v["4 async workers (Downpour, push every step) / --local, updates to 0.95"] == (1.5, True)
    value, met = v["4 async workers (Downpour, 4 local steps per push, staleness-aware lr) / --local, updates to 0.95"]
    assert abs(value - 41 / 26) < 1e-9 and met is False
    assert v["4 async workers' steady update rate / raw 4 MB push rate"] == (0.62, True)     # steady, not whole-run
    assert v["4 async workers' steady update rate / 3-node 4 MiB x4 push rate"] == (31.0 / 60.0, False)


def test_missing_systems_give_no_verdict_and_the_markdown_still_renders():
    records = [push("etcd", MiB, 4, 20.0, 21.0),
               {"system": "train", "op": "skipped", "reason": "torch is not installed"}]
    v = verdicts(records)
    assert v["3-node / etcd 3.4 MB/s, 1 MiB x4"] == (None, None)
    md = report.markdown(records, {"mode": "quick", "command": "python -m bench", "date": "d", "machine": "m",
                                   "durability": "x"})
    assert "raftps 3-node versus etcd 3.4" in md and "torch is not installed" in md


def test_a_failed_part_is_reported_and_the_rest_still_renders(tmp_path):
    """A part that raised leaves an error record (no size, no rates): the tables skip it, the
    report names it, and results.json holds every record."""
    import json
    records = [push("raftps-3", 4 * MiB, 4, 60.0, 251.7),
               {"system": "naive", "op": "error", "error": "RuntimeError: a naive node exited"}]
    md = report.write(records, {"mode": "quick", "command": "python -m bench", "date": "d", "machine": "m",
                                "durability": "x"}, str(tmp_path))
    assert "a naive node exited" in md
    with open(tmp_path / "results.json") as f:
        assert len(json.load(f)["records"]) == 2
