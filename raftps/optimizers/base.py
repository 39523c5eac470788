"""What every store optimizer is (``Optimizer``), the checks its parameters use, and the pieces
of a step that several share.

An optimizer's ``step`` runs inside the replicated state machine: it returns new arrays and never
mutates its inputs, so a reader holding the previous arrays keeps a consistent view
(copy-on-write). Only + - * / and sqrt (and comparisons) are used, hyperparameters are cast to
the tensor's dtype once, scalars are Python floats: each of these is correctly rounded in IEEE
754, so every replica computes the same bits from the same log. Each formula is evaluated in its
textbook order, but into as few new arrays as it must return (plus a scratch array or two): a new
array per operation was half of Adam's apply (python -m bench.optim_apply). The same IEEE
operations on the same operands (a * b and b * a are the same bits) give the same bits as the
textbook expressions, which tests/test_optim.py checks bit for bit: replicas of older and newer
code never diverge.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

# A parameter's check: (what it must be, the test); an int default marks an integer parameter,
# a check of None a flag (true or false).
POSITIVE = ("> 0", lambda x: x > 0)
NON_NEGATIVE = (">= 0", lambda x: x >= 0)
UNIT = ("in [0, 1)", lambda x: 0 <= x < 1)
COUNT = ("an integer >= 1", lambda x: x >= 1)
STALENESS_AWARE = (False, None)          # lr / max(1, tau): Zhang et al., IJCAI 2016
MAXIMIZE = (False, None)                 # ascend: the gradient's sign flipped (torch's maximize)

# parameter -> (default, check); a default of None means required.
Params = dict[str, tuple[Any, Any]]


@dataclass(frozen=True)
class Context:
    """What the state machine knows about the entry being applied, all of it from the log."""
    index: int = 0                 # Raft index of this entry
    base: int | None = None        # store version the pusher pulled (None: not given)
    staleness: int = 0             # updates to this tensor after ``base`` (0 without a base)


NO_CONTEXT = Context()


class Optimizer:
    """One store optimizer, named in a tensor's spec (``{"name": NAME, ...}``): its parameters,
    its state's start, its deterministic step, where it may run, and its torch.optim form.

    A subclass in a module of this package is found by the registry (``__init__.py``) through
    the instances its module lists in ``OPTIMIZERS``."""
    name: str = ""
    params: Params = {}
    # Its state is per element (or scalar), so a row-sparse push can step the pushed rows alone.
    rows: bool = True
    # Why its state cannot leave this Raft group's log (a move, assign_state), or "" if it can.
    bound_to_log: str = ""
    # The torch.optim class whose param group runs as this optimizer (None: no torch form), and
    # the group options it reads besides the spec's own names.
    torch_class: str | None = None
    torch_options: frozenset[str] = frozenset()

    def init_state(self, spec: dict, param: np.ndarray) -> dict[str, Any]:
        """The state of a new tensor (arrays like ``param``, ints for counts, floats)."""
        return {}

    def step(self, spec: dict, param: np.ndarray, grad: np.ndarray, state: dict,
             ctx: Context) -> tuple[np.ndarray, dict]:
        """One update: (new param, new state). ``grad`` has param's shape and dtype."""
        raise NotImplementedError

    def check_applicable(self, spec: dict, state: dict, ctx: Context) -> None:
        """Raise what ``step`` would raise for this context, before any tensor of a push changes."""

    # ---- torch.optim (read by raftps.torch only; no torch here: arrays and floats) -------------

    def runs_torch_group(self, base: str, group: dict, number: Callable[[dict, str], float]) -> bool:
        """Whether a param group of torch.optim's ``base`` class runs as this optimizer (SGD's:
        sgd or momentum, by its momentum; Adam's: adam or adamw, by decoupled_weight_decay)."""
        return base == self.torch_class

    def spec_from_torch(self, group: dict, number: Callable[[dict, str], float]) -> dict:
        """This optimizer's own spec fields (its name included) from a torch param group."""
        raise NotImplementedError

    def torch_group(self, spec: dict) -> dict:
        """The torch param group options that run as ``spec`` (``spec_from_torch``'s inverse)."""
        raise NotImplementedError

    def to_torch_state(self, spec: dict, state: dict) -> dict[str, Any]:
        """One parameter's state as torch keeps it: arrays, and floats for torch's scalar tensors
        ({} where torch keeps nothing yet)."""
        raise NotImplementedError

    def torch_state_keys(self, spec: dict, torch_state: dict) -> set[str]:
        """The keys a torch state of this optimizer must have (and may have no others)."""
        raise NotImplementedError

    def from_torch_state(self, spec: dict, torch_state: dict, array: Callable[[str], np.ndarray], steps: int,
                         like: np.ndarray) -> dict[str, Any]:
        """A torch state as the store keeps it; ``array(key)`` is its key as an array like ``like``."""
        raise NotImplementedError


def torch_common(spec: dict) -> dict:
    """The torch param group options every torch form shares."""
    return {"lr": spec["lr"], "weight_decay": spec["weight_decay"], "maximize": spec.get("maximize", False)}


def new_like(param: np.ndarray) -> np.ndarray:
    """A new array for a result (an ndarray even for a 0-d tensor, so ``out=`` can take it)."""
    return np.empty_like(param)


class Prepared(NamedTuple):
    """What the gradient optimizers' step starts from (``prepare``)."""
    t: type                   # the tensor's scalar type: every hyperparameter is cast to it once
    lr_float: float           # the step's lr as a Python float (staleness-aware: divided first)
    lr: Any                   # the same, cast
    param: np.ndarray         # decoupled weight decay applied
    grad: np.ndarray          # maximize and coupled weight decay applied
    steps: int                # this step's count (the first is 1)


def prepare(spec: dict, param: np.ndarray, grad: np.ndarray, state: dict, ctx: Context,
            decoupled: bool = False) -> Prepared:
    """The start every gradient optimizer shares: the lr (over the staleness if asked), the sign
    flip of maximize, the step count, and weight decay, coupled (into the gradient) or
    ``decoupled`` (the parameter times 1 - lr * weight_decay)."""
    t = param.dtype.type
    # The scalar is divided as a Python float, then cast once: the same bits on every replica.
    lr_float = spec["lr"] / max(1, ctx.staleness) if spec["staleness_aware"] else spec["lr"]
    lr = t(lr_float)
    if spec.get("maximize"):
        grad = np.negative(grad)                     # exact: a sign flip
    steps = state.get("step", 0) + 1
    if decoupled:
        if spec["weight_decay"]:                     # decoupled: param * (1 - lr * weight_decay)
            param = np.multiply(param, t(1.0 - lr_float * spec["weight_decay"]), out=new_like(param))
    elif spec["weight_decay"]:
        decayed = np.multiply(param, t(spec["weight_decay"]), out=new_like(param))
        grad = np.add(grad, decayed, out=decayed)    # grad + weight_decay * param
    return Prepared(t, lr_float, lr, param, grad, steps)
