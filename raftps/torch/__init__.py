"""PyTorch on raftps: a torch training loop moves onto the store unchanged.

    import raftps.torch as rpt
    opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    opt = rpt.DistributedOptimizer(opt, model=model, mode="sync", prefix="job1")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_cosine)
    for step in range(opt.start_step, steps):     # resumes where the store is: no checkpoint files
        opt.zero_grad(); loss_fn(model(x), y).backward()
        opt.clip_grad_norm_(1.0); opt.step(); sched.step()

``DistributedOptimizer`` (optimizer.py) returns an instance of the wrapped optimizer's own class
with the user's param groups; each ``step()`` carries every group's current hyperparameters,
and the store runs the optimizer in its replicated state machine (one linearizable order,
bit-identical on every node), so a worker, a node or every worker can die and training goes on
from the store. ``state_dict()`` / ``load_state_dict()`` move the optimizer's state between the
store and plain torch. Which torch optimizers and options run in the store: optimizers.py. The
worker's side of each mode (sync, async, ssp, easgd): worker.py, moving tensors in and out of
the mode's engine (raftps/modes/, shared with the numpy trainer); DiLoCo (``mode="diloco"``, any
torch optimizer as the inner one, the outer step in the store): diloco.py, over raftps/client/diloco.py. The shorthand
``DistributedOptimizer(model, optimizer={"name": "adam", "lr": 1e-3})`` names a store optimizer
instead of a torch one.
"""
try:
    import torch  # noqa: F401
except ImportError:
    raise ImportError("raftps.torch needs PyTorch: `bash cluster/setup.sh --torch` installs torch's CPU build "
                      "(a plain `pip install torch` may fetch the CUDA build), then `pip install 'raftps[torch]'`") from None

from raftps.torch.optimizer import MODES, DistributedOptimizer
from raftps.torch.optimizers import SUPPORTED
from raftps.torch.worker import Worker

__all__ = ["DistributedOptimizer", "MODES", "SUPPORTED", "Worker"]
