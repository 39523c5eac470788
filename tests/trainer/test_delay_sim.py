"""The zero-overhead staleness simulator the trainer benchmark compares real async runs with."""
from trainer.config import Config
from trainer.delay_sim import updates_to_target


def test_staleness_alone_costs_updates():
    fresh = updates_to_target(Config(workers=1, seed=0), delay=0)
    stale = updates_to_target(Config(workers=4, seed=0), delay=3)
    assert fresh is not None and stale is not None
    assert stale > 2 * fresh, (fresh, stale)   # measured: 21 vs 107


def test_unreachable_target_reports_none():
    assert updates_to_target(Config(workers=2, seed=0), delay=1, max_updates=3) is None
