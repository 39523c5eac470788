"""One run's settings, shared by the coordinator and every worker process (picklable for spawn)."""
from __future__ import annotations

from dataclasses import dataclass, field

from raftps.optim import SPECS

from .data import steps_per_epoch

DEFAULT_LR = {"sgd": 0.1, "momentum": 0.02, "adagrad": 0.05, "adam": 0.001, "adarevision": 0.05}
MODES = ("async", "sync", "ssp", "easgd", "diloco")


@dataclass
class Config:
    cluster: str | None = None          # "host:port,..."; None means RAFTPS_CLUSTER
    local: bool = False
    mode: str = "async"                 # async | sync | ssp | easgd | diloco
    workers: int = 4
    model: str = "mlp"
    hidden: tuple[int, ...] = (1000, 1000)
    dataset: str = "digits"
    epochs: int = 5
    steps: int | None = None            # cap on applied updates (overrides epochs when smaller)
    batch: int = 64                     # examples per applied update (sync: split over the workers)
    optimizer: str = "sgd"
    lr: float | None = None
    momentum: float = 0.9
    staleness_aware: bool = False       # lr / max(1, tau) in the store (Zhang et al. 2016)
    adarevision_window: int = 32        # AdaRevision: past gradient sums the store keeps per tensor
    staleness: int | None = None        # ssp: the bound s (0: BSP; None: unbounded, ASP)
    ssp_on_bound: str = "wait"          # ssp: wait at the leader (ssp_wait) | reject (push refused, retry)
    ssp_timeout: float = 10.0           # ssp: a member stuck this long at the slowest clock is dropped
    easgd_alpha: float | None = None    # easgd: moving rate alpha (default 0.9 / workers: beta = 0.9)
    compress: str = "none"              # none | fp16 | topk:FRACTION (async, ssp)
    seed: int = 0
    n_fetch: int = 1                    # async: pull every n_fetch local steps (Downpour)
    fresh_pull: bool = False            # async: linearizable pulls (leader) instead of any up-to-date node
    warmup: int = 0                     # async: other workers start once rank 0 has pushed this many updates
    n_push: int = 1                     # async: push the summed gradient every n_push local steps
    step_timeout: float = 10.0          # sync, diloco: a step (round) waits this long for its last worker
    sync_every: int = 20                # diloco: inner steps per round (H)
    fragments: int = 1                  # diloco: fragments synced at staggered offsets (streaming)
    diloco_async: bool = False          # diloco: apply each worker's pseudo-gradient on arrival
    outer_lr: float | None = None       # diloco: the store's outer step (Nesterov momentum SGD) ...
    outer_momentum: float | None = None # ... 0: plain SGD (with outer_lr 1.0: averaging); None: the
                                        # library's default for the mode (raftps/client/diloco.py)
    client_timeout: float = 30.0
    max_restarts: int = 3               # per worker
    max_time: float = 1800.0            # the whole run, in seconds
    evals_per_epoch: int = 2
    prefix: str = "model"               # tensor names are PREFIX/W0, PREFIX/b0, ...
    step_offset: int = 0                # sync: store step of this run's step 0 (set by the coordinator)
    out: str = "runs/latest"
    kill_leader_at: float | None = None # fraction of the run at which to SIGKILL the leader
    run_dir: str | None = None          # LocalCluster run dir (pid files) for --kill-leader-at
    extra: dict = field(default_factory=dict)

    def optimizer_spec(self) -> dict:
        """The store's optimizer for the run's tensors (EASGD: the elastic centre)."""
        if self.mode == "easgd" and not self.local:
            return {"name": "elastic"}
        if self.mode == "diloco" and not self.local:
            from raftps.client.diloco import outer_spec
            return outer_spec(self.outer_spec(), self.diloco_async)     # as the workers' DiLoCo creates them
        return self.local_spec()

    def outer_spec(self) -> dict:
        """DiLoCo's outer optimizer, applied by the store to the pseudo-gradients: what is not given
        is raftps.client.diloco's default for the mode (synchronous: the paper's Nesterov momentum, lr 0.7,
        momentum 0.9; asynchronous: plain averaging, lr 1.0, as Nesterov diverges there)."""
        from raftps.client.diloco import ASYNC_DEFAULT_OUTER, DEFAULT_OUTER
        default = ASYNC_DEFAULT_OUTER if self.diloco_async else DEFAULT_OUTER
        lr = default["lr"] if self.outer_lr is None else self.outer_lr
        momentum = default.get("momentum", 0.0) if self.outer_momentum is None else self.outer_momentum
        if momentum == 0:
            return {"name": "sgd", "lr": lr}
        return {"name": "momentum", "lr": lr, "momentum": momentum, "nesterov": True}

    def local_spec(self) -> dict:
        """The update rule itself: the store's for async/sync/ssp, each EASGD and DiLoCo worker's own."""
        spec = {"name": self.optimizer, "lr": self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]}
        takes = SPECS[self.optimizer]          # the options this optimizer has (raftps/optimizers/)
        if "momentum" in takes:
            spec["momentum"] = self.momentum
        if "window" in takes:
            spec["window"] = self.adarevision_window
        if self.staleness_aware and "staleness_aware" in takes:
            spec["staleness_aware"] = True
        return spec

    @property
    def asynchronous(self) -> bool:
        """Modes whose workers push on their own schedule (every worker's steps are updates)."""
        return self.mode in ("async", "ssp", "easgd") and not self.local

    def worker_steps(self, n_train: int) -> int:
        """Local steps of one async worker: its shard's epochs, capped by its share of --steps."""
        from .data import async_shard
        per_epoch = steps_per_epoch(len(async_shard(n_train, 0, self.workers)), self.batch)
        total = self.epochs * per_epoch
        if self.diloco:             # every worker takes --steps inner steps: the run's progress
            return total if self.steps is None else min(total, self.steps)
        return total if self.steps is None else min(total, -(-self.steps // self.workers))

    @property
    def diloco(self) -> bool:
        return self.mode == "diloco" and not self.local

    def total_updates(self, n_train: int) -> int:
        """The run's progress at its end (sync and --local: steps; async: all workers' pushes;
        diloco: one worker's inner steps, the store applying one outer step per round)."""
        if self.diloco:
            return self.worker_steps(n_train)
        if self.asynchronous:
            return self.workers * (-(-self.worker_steps(n_train) // self.n_push))
        total = self.epochs * steps_per_epoch(n_train, self.batch)
        return total if self.steps is None else min(total, self.steps)

    def updates_per_epoch(self, n_train: int) -> float:
        if self.diloco:
            from .data import async_shard
            return float(steps_per_epoch(len(async_shard(n_train, 0, self.workers)), self.batch))
        if self.asynchronous:
            from .data import async_shard
            return self.workers * steps_per_epoch(len(async_shard(n_train, 0, self.workers)), self.batch) / self.n_push
        return float(steps_per_epoch(n_train, self.batch))
