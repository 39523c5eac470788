"""The worker of ``mode="diloco"`` and ``"diloco-async"``: the wrapped torch optimizer, whatever
its class, is the inner optimizer and steps on this worker's replica; every ``sync_every`` steps
the round's pseudo-gradient goes to the store, which applies the outer optimizer once
(raftps/client/diloco.py has the rounds, fragments and restarts), and the model continues from the new
global parameters. The inner optimizer's state stays here across rounds; a restarted worker
starts it fresh (raftps/client/diloco.py says why).

``overlap=True``: the round is sent in the background and the worker keeps taking inner steps;
its answer is applied (new global values plus the progress since the round's end) at the first
step after it arrives, copying the parameters to the host only then (raftps/client/diloco.py, Overlap).
``flush()`` (and ``close()``) wait for the rounds in flight and apply them.

Buffers (BatchNorm's running statistics) stay local to each worker, as in torchft's DiLoCo.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch

from raftps.client.client import Client
from raftps.client.diloco import DiLoCo
from raftps.torch.host import STORED_AS, PinnedStage, as_numpy, env_int


class DilocoWorker:
    """See the module docstring. ``local_step``: the wrapped torch optimizer's own step."""

    def __init__(self, model: torch.nn.Module, trained: set[int], local_step: Callable[[], Any],
                 cluster: str | Iterable[str] | Client | None = None, mode: str = "diloco", prefix: str = "job",
                 rank: int | None = None, world_size: int | None = None, sync_every: int = 100,
                 outer: dict | None = None, fragments: int = 1, step_timeout: float = 10.0,
                 compress: str | None = None, warmup: int = 0, overlap: bool = False, token: str | None = None,
                 timeout: float = 60.0):
        self.world_size = world_size if world_size is not None else (env_int("WORLD_SIZE") or 1)
        self.rank = rank if rank is not None else (env_int("RANK") or 0)
        self.mode, self.prefix, self.local_step = mode, prefix, local_step
        self.tensors = {n: p for n, p in model.named_parameters() if id(p) in trained}
        self.dtypes = {n: STORED_AS[p.dtype] for n, p in self.tensors.items()}
        host = {n: as_numpy(p, self.dtypes[n]) for n, p in self.tensors.items()}
        self._owns_client = not isinstance(cluster, Client)
        # a Client connects on its first request: DiLoCo checks every argument before any I/O
        self.client = cluster if isinstance(cluster, Client) else Client(cluster, timeout=timeout, token=token)
        self._stage = PinnedStage()
        self.timings = {"push": [0, 0.0], "pull": [0, 0.0]}
        self.last_grad_norm = None
        self.synced: list = []            # the rounds the last step synced
        try:
            self.diloco = DiLoCo(self.client, prefix, host, rank=self.rank, world_size=self.world_size,
                                 sync_every=sync_every, outer=outer, fragments=fragments,
                                 asynchronous=mode == "diloco-async", step_timeout=step_timeout, compress=compress,
                                 warmup=warmup, overlap=overlap)
            self.diloco.create()
            self.start_step, values = self.diloco.resume()
        except BaseException:
            self.close()
            raise
        self._stage.load([(n, self.tensors[n], values[n]) for n in self.tensors])
        self.step_count = self.start_step
        self.version = self.diloco.version

    @torch.no_grad()
    def step(self, hyper: Any = None, lrs: Any = None, clip_norm: Any = None) -> Any:
        """The inner step; at a round's end, the round's sync and the new global parameters."""
        with torch.enable_grad():
            self.local_step()
        self.synced = []
        if self.diloco.due(self.step_count) or self.diloco.ready():
            self._sync(lambda host: self.diloco.after_inner_step(self.step_count, host))
        self.step_count += 1
        return self.version

    def _sync(self, call: Callable[[dict], dict | None]) -> None:
        t0 = time.perf_counter()
        host = self._stage.to_host(self.tensors, self.dtypes)
        new = call(host)
        self._stage.load([(n, self.tensors[n], a) for n, a in (new or {}).items()])
        self.version = self.diloco.version
        self.synced = list(self.diloco.rounds)
        self.timings["push"][0] += 1
        self.timings["push"][1] += time.perf_counter() - t0

    @property
    def bytes_sent(self) -> int:
        """Pseudo-gradient bytes this worker sent to the store."""
        return self.diloco.bytes_sent

    def flush(self) -> None:
        """Wait for the rounds in flight (overlap) and apply them; without overlap, nothing to do."""
        if self.diloco.in_flight:
            self._sync(self.diloco.finish)

    def close(self) -> None:
        try:
            if hasattr(self, "diloco"):
                self.flush()
                self.diloco.close()
        finally:
            if self._owns_client:
                self.client.close()

    def pull_rows(self, param: torch.Tensor, rows: Any) -> int:
        raise ValueError("pull_rows works in the async modes: DiLoCo syncs whole tensors at round ends")
