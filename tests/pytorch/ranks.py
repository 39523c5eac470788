"""Several ranks of a test in threads of one process.

The threads share torch's global random generator: build the ranks' models (``torch.manual_seed``
then ``nn.Linear(...)``) before ``run_ranks``, never in ``body``, or two ranks building at once
draw each other's numbers and start from an initialisation no reference has."""
from __future__ import annotations

import threading
from typing import Callable


def run_ranks(world: int, body: Callable[[int], None], timeout: float = 180.0) -> None:
    """``body(rank)`` in one thread per rank; the first error re-raised, a hang reported."""
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            body(rank)
        except BaseException as exc:      # re-raised below: a thread must not hide it
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"a rank did not finish within {timeout:.0f} s"
    if errors:
        raise errors[0]
