"""``Client.push_async``'s lanes: up to ``max_in_flight`` writes on their way at once, each sent
by a thread of its own over connections of its own (one transport per thread, made on its first
write), all in the same client session, so each stays exactly-once with its own seq.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from raftps.client.transport import Transport

Call = Callable[[str, dict, float], dict]


class Pipeline:
    def __init__(self, max_in_flight: int, new_transport: Callable[[], Transport]):
        self.max_in_flight = max_in_flight
        self._new_transport = new_transport
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._lanes = threading.local()
        self._transports: list[Transport] = []

    def submit(self, send: Callable[[Call], dict]) -> "Future[dict]":
        """Run ``send(call)`` on a lane, ``call`` being one attempt at one node over its connections."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="raftps-push")
        return self._executor.submit(lambda: send(self._lane().call))

    def _lane(self) -> Transport:
        lane = getattr(self._lanes, "transport", None)
        if lane is None:
            lane = self._lanes.transport = self._new_transport()
            with self._lock:
                self._transports.append(lane)
        return lane

    def close(self) -> None:
        """Wait for the writes on their way, then close every lane's connections."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        for lane in self._transports:
            lane.close()
