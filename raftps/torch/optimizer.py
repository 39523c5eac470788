"""``DistributedOptimizer``: the user's torch optimizer, moved onto the store.

The result is an instance of the wrapped optimizer's own class (a class made at run time that
subclasses it, as Horovod does), holding the same ``param_groups`` dicts, so LR schedulers,
``GradScaler`` and ``isinstance`` checks work unchanged. Its ``step()`` reads each group's current
hyperparameters and hands the gradients to the ``Worker`` (worker.py), which sends them with
those values; the optimizer itself runs in the store (optimizers.py says which run there).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from raftps import optim
from raftps.client.client import Client
from raftps.torch import amp, optimizers
from raftps.torch.diloco import DilocoWorker
from raftps.torch.state_marks import exported_mark, mark_unchanged
from raftps.torch.worker import MODES as STORE_MODES, STORED_AS, Worker

DEFAULT_SPEC = {"name": "sgd", "lr": 0.01}
DILOCO_MODES = ("diloco", "diloco-async")
MODES = STORE_MODES + DILOCO_MODES


class _Distributed:
    """What a wrapped optimizer adds to (or changes in) its torch class; see the module docstring."""

    _raftps: Worker | DilocoWorker
    _raftps_specs: list[dict]         # param group index -> the store spec its tensors were created with
    _raftps_local: bool               # the torch class's own step runs on this worker (easgd, diloco):
                                      # its state_dict is this worker's, as in plain torch
    _raftps_class: type               # the wrapped torch optimizer's class

    # ---- torch.optim.Optimizer's API --------------------------------------------------------

    def step(self, closure: Any = None) -> Any:
        """Send this step's gradients with each param group's current hyperparameters (an LR
        scheduler's lr among them) and bring the model up to date. As torch defines it, a
        ``closure`` (Lightning's automatic optimization passes one: forward, zero_grad, backward)
        is called once, with grad enabled, before the step, and its loss is returned; without
        one, the store version the model now holds is returned.

        With K > 1 sync ranks, this step tells ``torch.amp.GradScaler`` that it handles the scale
        itself (``_step_supports_amp_scaling``): GradScaler then calls it on every rank, also on one whose
        gradient holds an inf (``found_inf``), which contributes a skip, so the step is skipped
        on every rank and changes nothing in the store, as under DDP, and the ranks stay in step.
        A rank whose own gradients were finite tells its GradScaler of the skip, so that every
        rank's scale backs off, as every DDP rank's does (amp.py)."""
        if closure is None:
            return self._store_step()
        if not callable(closure):
            raise TypeError(f"step(closure): closure must be callable, got {type(closure).__name__}")
        with torch.enable_grad():
            loss = closure()
        self._store_step()
        return loss

    # GradScaler reads it: with K > 1 sync ranks it calls step() with found_inf and grad_scale set
    # (see step); torch's own skip (step() not called on an inf) stays with one rank. A step the
    # store skipped is told to the GradScaler (amp.py) and read by Accelerate's and HF Trainer's
    # skip detection through raftps.torch.hf.without_ddp's optimizer wrapper.
    _step_supports_amp_scaling = property(lambda self: self._raftps.mode == "sync" and self._raftps.world_size > 1)

    @torch.no_grad()
    def _store_step(self) -> int:
        if self._raftps.mode in DILOCO_MODES:     # the inner step is torch's own; the store's part is the round
            return self._raftps.step()
        hyper, lrs = self._step_hyper()
        clip, self._raftps_clip = self._raftps_clip, None
        found_inf = getattr(self, "found_inf", None)        # set by GradScaler (sync mode) for this call
        own_inf = found_inf is not None and bool(found_inf.item())
        overlapped = getattr(self._raftps, "overlap", None) is not None
        version = self._raftps.step(hyper, lrs, clip, skip=own_inf, grad_scale=getattr(self, "grad_scale", None),
                                    under_scaler=overlapped and amp.calling_scaler(self) is not None)
        if found_inf is not None and not own_inf and self._raftps.last_step_skipped:
            # another rank's inf skipped it: this rank's GradScaler backs off too, as under DDP
            scaler = amp.calling_scaler(self)
            if scaler is not None:
                self._raftps_inf_marker = amp.record_inf(scaler, self._raftps.params[0].tensor.device)
        return version

    def _step_hyper(self) -> tuple[dict[str, dict], dict[str, float]]:
        """This step's hyperparameters as the param groups hold them now: ({tensor: those that
        differ from its stored spec}, {tensor: lr})."""
        hyper, lrs = {}, {}
        for group, stored, names in zip(self.param_groups, self._raftps_specs, self._group_names()):
            now = (optimizers.store_spec(self._raftps_class, group) if not self._raftps_shorthand
                   else _shorthand_spec(stored, group))
            changed = optimizers.step_hyperparameters(now, stored)
            for name in names:
                lrs[name] = now["lr"]
                if changed:
                    hyper[name] = changed
        return hyper, lrs

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As DDP's: backward passes inside it only accumulate gradients (a micro-batch that does
        not end a step); the step's last backward runs outside it, then step(). It matters with
        overlap=True (whose hooks send the gradients backward makes); elsewhere it does nothing."""
        overlap = getattr(self._raftps, "overlap", None)
        if overlap is None:
            yield
            return
        with overlap.no_sync():
            yield

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_raftps", None) is None:       # torch's own __init__ adding the first groups
            return super().add_param_group(param_group)  # type: ignore[misc]
        raise ValueError("add_param_group after wrapping is not supported: the job's tensors are created when "
                         "DistributedOptimizer is made; give every group to the torch optimizer before wrapping it")

    def state_dict(self) -> dict:
        """A torch state_dict of this optimizer's class, its state read linearizably from the store:
        ``torch.optim.<Class>(params).load_state_dict(opt.state_dict())`` continues where the store is."""
        if self._raftps_local:
            return super().state_dict()   # type: ignore[misc]
        exported = self._raftps.client.export(self._raftps.prefix + "/", state=True)
        states, index, groups = {}, 0, []
        for group, stored, names in zip(self.param_groups, self._raftps_specs, self._group_names()):
            ids = []
            for name in names:
                torch_state = optimizers.to_torch_state(stored, exported["states"][name])
                if torch_state:
                    states[index] = torch_state
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        produced = {"state": states, "param_groups": groups}
        self._raftps_exported = exported_mark(produced, exported, self._raftps.params)
        return produced

    def load_state_dict(self, state_dict: dict) -> None:
        """Seed the store from a torch state_dict of this class: every parameter's optimizer state
        and the model's current parameter values, in one write per Raft group; the groups'
        hyperparameters (lr, ...) are taken as torch does. Refused before any write if the groups,
        the parameter count or a shape differ. The state_dict this optimizer's ``state_dict()``
        just returned, loaded unchanged while neither the store nor the model moved, writes
        nothing (it is what the store holds): Accelerate's ``prepare`` does that."""
        if self._raftps_local:
            return super().load_state_dict(state_dict)   # type: ignore[misc]
        saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved, list) or not isinstance(state_dict.get("state"), dict):
            raise ValueError("load_state_dict needs a torch optimizer state_dict: {'state': ..., 'param_groups': ...}")
        if len(saved) != len(self.param_groups):
            raise ValueError(f"the state_dict has {len(saved)} param groups, this optimizer {len(self.param_groups)}")
        values, states, index = {}, {}, 0
        slots = {s.store_name: s for s in self._raftps.params}
        for i, (group, mine, names) in enumerate(zip(saved, self.param_groups, self._group_names())):
            if len(group.get("params", ())) != len(mine["params"]):
                raise ValueError(f"param group {i} of the state_dict has {len(group.get('params', ()))} parameters, "
                                 f"this optimizer's {len(mine['params'])}")
            stored = self._raftps_specs[i]
            # torch's bias corrections use the saved group's betas: so do the store's beta products
            spec = stored if self._raftps_shorthand else {
                **optimizers.store_spec(self._raftps_class, {**mine, **{k: v for k, v in group.items() if k != "params"}}),
                "name": stored["name"], "amsgrad": stored.get("amsgrad")}
            for saved_id, name in zip(group["params"], names):
                slot = slots[name]
                like = np.empty(tuple(slot.tensor.shape), slot.dtype)
                states[name] = optimizers.to_store_state(spec, state_dict["state"].get(saved_id, {}), like,
                                                         f"parameter {index} ({name})")
                values[name] = slot.tensor.detach().to(device="cpu", dtype=torch.from_numpy(like).dtype).numpy()
                index += 1
        # load_state_dict(state_dict()) (Accelerate does it when it prepares the optimizer) would
        # rewrite what the store holds: skipped when nothing moved since (mark_unchanged says what)
        if not mark_unchanged(getattr(self, "_raftps_exported", None), state_dict, self._raftps.params,
                              lambda: self._raftps.client.tensors(self._raftps.prefix + "/")):
            self._raftps.client.assign_state(values, states)
        self._raftps_exported = None
        for group, mine in zip(saved, self.param_groups):
            mine.update({k: v for k, v in group.items() if k != "params"})

    # ---- beyond torch.optim ---------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip this step's gradient to ``max_norm`` as one process clipping the full batch would.
        In sync mode the store clips the step's mean gradient (over every rank: what DDP clips;
        ``opt.last_grad_norm`` is its norm after ``step()``) and this returns this rank's own
        norm; in the other modes the gradient is clipped here (it is this worker's whole batch)."""
        if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and max_norm > 0):
            raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
        if getattr(self._raftps, "overlap", None) is not None:
            raise ValueError("clip_grad_norm_ with overlap=True: the store clips the step's mean gradient, which "
                             "needs the whole step in one piece, and overlap sends it in chunks during backward; "
                             "make the optimizer without overlap to clip")
        if norm_type != 2.0 and self._raftps.mode == "sync":
            raise ValueError("sync mode clips the step's mean gradient by its L2 norm only (norm_type=2.0)")
        params = [p for g in self.param_groups for p in g["params"]]
        if self._raftps.mode != "sync":
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        self._raftps_clip = float(max_norm)
        return _total_norm([p.grad for p in params if p.grad is not None])

    def flush(self) -> None:
        """Push the gradients of steps not pushed yet (async with n_push > 1); close() does."""
        self._raftps.flush()

    def close(self) -> None:
        """Flush, leave the SSP group, close the client (if this optimizer made it)."""
        self._raftps.close()

    def pull_rows(self, param: torch.Tensor, rows: Any) -> int:
        """Bring rows ``rows`` of a sparse embedding's weight up to date from the store."""
        return self._raftps.pull_rows(param, rows)

    def __enter__(self) -> "_Distributed":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # the worker's view, read-only here
    start_step = property(lambda self: self._raftps.start_step, doc="the step to start at: where the store is")
    step_count = property(lambda self: self._raftps.step_count, doc="steps taken, counting earlier runs'")
    version = property(lambda self: self._raftps.version, doc="the store version the model holds")
    client = property(lambda self: self._raftps.client, doc="the raftps Client this optimizer uses")
    rank = property(lambda self: self._raftps.rank)
    world_size = property(lambda self: self._raftps.world_size)
    mode = property(lambda self: self._raftps.mode)
    prefix = property(lambda self: self._raftps.prefix)
    timings = property(lambda self: self._raftps.timings, doc="'push'/'pull' -> [calls, seconds]")
    last_grad_norm = property(lambda self: self._raftps.last_grad_norm)
    last_step_skipped = property(lambda self: getattr(self._raftps, "last_step_skipped", False),
                                 doc="sync: the last step was skipped (some rank's GradScaler found an inf)")
    params = property(lambda self: getattr(self._raftps, "params", []),
                      doc="the stored parameters' slots (diloco: none, its rounds hold the tensors)")
    stream_plan = property(lambda self: list(getattr(getattr(getattr(self._raftps, "engine", None), "stream", None),
                                                     "plan", None) or []),
                           doc="sync overlap=True: the chunks a step goes in (raftps.client.step_stream.Chunk: "
                               "Raft group, index: job JOB:chunk<index>, names); empty without overlap")
    counters = property(lambda self: getattr(self._raftps, "counters", {}),
                        doc="async modes: Raft group -> this rank's step counter there")
    bytes_sent = property(lambda self: getattr(self._raftps, "bytes_sent", None),
                          doc="diloco: the pseudo-gradient bytes this worker sent")
    synced = property(lambda self: list(getattr(self._raftps, "synced", ())),
                      doc="diloco: the rounds the last step() synced (raftps.client.diloco.Round: fragment, round, "
                          "count, late, bytes); empty when it synced none")

    def _group_names(self) -> list[list[str]]:
        return self._raftps_names


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``grads`` together (the L2 norm of their norms), as
    torch.nn.utils.clip_grad_norm_ returns it, with what torch 2.3 has (get_total_norm is 2.6+)."""
    if not grads:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(g.coalesce().values() if g.is_sparse else g) for g in grads]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def _shorthand_spec(stored: dict, group: dict) -> dict:
    """The shorthand form's group holds the store spec's step hyperparameters; a scheduler moves
    them there."""
    return {**stored, **{k: float(group[k]) for k in optim.STEP_HYPERPARAMETERS if k in stored and k in group}}


def DistributedOptimizer(optimizer_or_model: torch.optim.Optimizer | torch.nn.Module,
                         cluster: str | Iterable[str] | Client | None = None, optimizer: dict | None = None,
                         mode: str = "async", *, model: torch.nn.Module | None = None,
                         staleness_aware: bool = False, **options: Any) -> torch.optim.Optimizer:
    """The torch optimizer ``optimizer_or_model`` (with ``model=`` for its parameters' names),
    running against a raftps cluster; see the package docstring.

    ``mode``: "sync", "async", "ssp", "easgd" (the store runs the optimizer, or holds EASGD's
    centre), or "diloco" / "diloco-async" (the torch optimizer, any class, is DiLoCo's inner one;
    options ``sync_every`` (H), ``outer`` (a store spec; default Nesterov momentum, lr 0.7,
    momentum 0.9), ``fragments``, ``warmup``, ``compress``, ``step_timeout``: raftps/client/diloco.py).
    The shorthand ``DistributedOptimizer(model, optimizer={...store spec...})`` gives a
    ``torch.optim.Optimizer`` with one param group holding the spec's hyperparameters.
    ``cluster``: "host:port,..." or a list (None: $RAFTPS_CLUSTER), or a ready Client.
    ``options``: the Worker's (worker.py): n_push, n_fetch, compress, prefix, rank, world_size,
    ssp_staleness, easgd_alpha, step_timeout, ssp_timeout, token, timeout, chunk_bytes (sync:
    each step streamed in chunks of whole tensors of up to this many bytes; Client.push_step),
    pairs (sync, with chunk_bytes: ranks 2i and 2i + 1 add up half of each step's chunks each and
    relay the store's answers to each other, so the workers' links carry an all-reduce's bytes),
    overlap (sync, with chunk_bytes, pairs or not: each chunk sent as soon as backward has made
    its gradients, DDP's buckets' way; ``opt.no_sync()`` for gradient accumulation; not with
    clip_grad_norm_ or a GradScaler: overlap.py).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode in DILOCO_MODES and not isinstance(optimizer_or_model, torch.optim.Optimizer):
        raise ValueError(f"mode={mode!r} needs a torch optimizer to run as the inner one: "
                         "DistributedOptimizer(torch.optim.AdamW(...), model=model, mode='diloco')")
    if isinstance(optimizer_or_model, torch.nn.Module):
        if model is not None:
            raise ValueError("give the model once: DistributedOptimizer(model, optimizer={...}) or "
                             "DistributedOptimizer(torch_optimizer, model=model)")
        model = optimizer_or_model
        spec = dict(optimizer or DEFAULT_SPEC)
        if staleness_aware:
            spec["staleness_aware"] = True
        spec = optim.normalize(spec, f"{options.get('prefix', 'job')}/*")     # refused before any I/O
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        base = torch.optim.Optimizer(params, {k: spec[k] for k in optim.STEP_HYPERPARAMETERS if k in spec})
        specs, shorthand = [spec], True
    elif isinstance(optimizer_or_model, torch.optim.Optimizer):
        if optimizer is not None:
            raise ValueError("optimizer= is the shorthand's store spec; with a torch optimizer, configure it there")
        if not isinstance(model, torch.nn.Module):
            raise ValueError("DistributedOptimizer(torch_optimizer, model=model): the model names the parameters")
        base, shorthand = optimizer_or_model, False
        if isinstance(base, _Distributed):
            raise ValueError("this optimizer is already a DistributedOptimizer")
        specs = [optimizers.stored_spec(type(base), g) if mode not in DILOCO_MODES else {}
                 for g in base.param_groups]
        if staleness_aware:
            specs = [optim.normalize({**s, "staleness_aware": True}) for s in specs]
    else:
        raise TypeError("DistributedOptimizer takes a torch.optim.Optimizer (with model=) or an nn.Module (with "
                        f"optimizer={{...store spec...}}), got {type(optimizer_or_model).__name__}")

    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):   # torch.compile's wrapper: the model's names
        model = model._orig_mod
    names = {id(p): n for n, p in model.named_parameters()}
    by_param: dict[int, dict] = {}
    for i, group in enumerate(base.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"param group {i} holds a tensor that is not a parameter of the model "
                                 f"(shape {tuple(p.shape)})")
            if id(p) in by_param:
                raise ValueError(f"parameter {names[id(p)]!r} is in two param groups")
            if p.dtype not in STORED_AS:
                raise TypeError(f"parameter {names[id(p)]!r} has dtype {p.dtype}: raftps stores float32/float64 "
                                "(float16 and bfloat16 are kept in float32)")
            by_param[id(p)] = specs[i]

    cls = type(base)
    wrapped = type(cls.__name__, (_Distributed, cls), {"__module__": cls.__module__,
                                                        "__doc__": f"{cls.__name__} running on raftps."})
    opt = object.__new__(wrapped)
    opt.__dict__.update(base.__dict__)          # the same param_groups dicts: a scheduler on `base` still acts
    opt._raftps = None
    opt._raftps_specs, opt._raftps_shorthand, opt._raftps_clip = specs, shorthand, None
    opt._raftps_local = (mode == "easgd" and not shorthand) or mode in DILOCO_MODES
    opt._raftps_class = cls
    local_step = (lambda: cls.step(opt)) if opt._raftps_local else None
    if mode in DILOCO_MODES:
        opt._raftps = DilocoWorker(model, set(by_param), local_step, cluster, mode=mode, **options)
    else:
        opt._raftps = Worker(model, by_param, cluster, mode=mode, local_step=local_step, **options)
    opt._raftps_names = [[f"{opt._raftps.prefix}/{names[id(p)]}" for p in g["params"]] for g in opt.param_groups]
    if mode == "sync":        # overlap=True reads the hyperparameters when backward makes a step's first gradient
        opt._raftps.hyper_source = lambda: opt._step_hyper()[0]
    return opt
