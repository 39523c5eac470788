"""``raftps export --format torch`` and its ``raftps import``: a job's model and optimizer state as
the file a PyTorch user saves, ``{"model": state_dict, "optimizer": state_dict}``.

The optimizer state_dict has one param group per distinct stored optimizer spec (nanoGPT's decay
and no-decay groups come back as two), tensors in name order, and each group lists its
parameters' names under ``param_names``, so a reader maps indices to parameters by name. A
``raftps`` entry keeps the store's specs, version and digest. The file loads with
``torch.load(path, weights_only=True)``; import reads it the same way (never unpickling).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from raftps import optim
from raftps.client.client import Client
from raftps.errors import UsageError
from raftps.jobs import INTERNAL, prefix_root
from raftps.optimizers import OPTIMIZERS
from raftps.torch import optimizers

# store optimizer -> the torch.optim class that runs it (raftps/optimizers/: each says)
CLASSES = {name: o.torch_class for name, o in OPTIMIZERS.items() if o.torch_class}


def torch_group(spec: dict) -> dict:
    """The torch param group options that run as the store spec ``spec`` (store_spec's inverse)."""
    name = spec["name"]
    if name in CLASSES:
        return OPTIMIZERS[name].torch_group(spec)
    raise UsageError(f"optimizer {name!r} has no torch.optim form (torch format: {sorted(CLASSES)})")


def export_torch(client: Client, prefix: str, path: str) -> dict:
    """Write the job under ``prefix`` (one linearizable read, optimizer state included) to
    ``path`` as a torch checkpoint; the file appears whole or not at all."""
    root = prefix_root(prefix)
    out = client.export(root, state=True)
    names = sorted(n for n in out["tensors"] if not n[len(root):].startswith(INTERNAL))
    if not names:
        raise UsageError(f"no tensor named {root}... in the store at version {out['version']}; nothing written")
    specs = {n: out["optimizers"][n] for n in names}
    classes = {CLASSES.get(s["name"]) for s in specs.values()}
    if None in classes or len(classes) != 1:
        raise UsageError(f"the torch format holds one torch.optim class; the tensors under {root} use "
                         f"{sorted({s['name'] for s in specs.values()})}")
    groups: list[dict] = []
    state: dict[int, dict] = {}
    by_spec: dict[str, dict] = {}
    for name in names:
        key = repr(sorted(specs[name].items()))
        group = by_spec.get(key)
        if group is None:
            group = by_spec[key] = {**torch_group(specs[name]), "params": [], "param_names": []}
            groups.append(group)
        group["param_names"].append(name[len(root):])
    index = 0
    for group in groups:
        for short in group["param_names"]:
            torch_state = optimizers.to_torch_state(specs[root + short], out["states"][root + short])
            if torch_state:
                state[index] = torch_state
            group["params"].append(index)
            index += 1
    checkpoint = {
        "model": {n[len(root):]: torch.from_numpy(np.array(out["tensors"][n])) for n in names},
        "optimizer": {"state": state, "param_groups": groups},
        "raftps": {"prefix": root, "class": classes.pop(), "version": str(out["version"]),
                   "digest": str(out["digest"]), "optimizers": {n[len(root):]: specs[n] for n in names}},
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"version": out["version"], "digest": out["digest"], "tensors": len(names),
            "bytes": sum(out["tensors"][n].nbytes for n in names), "path": path, "format": "torch"}


def import_torch(client: Client, path: str, prefix: str, spec: dict | None) -> dict:
    """Create ``P/<name>`` for every tensor of the checkpoint's ``model`` (with the specs its
    ``raftps`` entry keeps, else ``spec``), then seed the optimizer state its ``optimizer``
    holds. Everything is checked before the first write."""
    root = prefix_root(prefix)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)   # never unpickles objects
    except Exception as exc:
        raise UsageError(f"{path} is not a torch checkpoint torch.load(weights_only=True) reads: {exc}") from None
    model = checkpoint.get("model") if isinstance(checkpoint, dict) else None
    if not isinstance(model, dict) or not model or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise UsageError(f"{path}: expected {{'model': state_dict, 'optimizer': state_dict}} (as raftps export "
                         "--format torch writes)")
    kept = (checkpoint.get("raftps") or {}).get("optimizers") or {}
    if spec is None and set(kept) != set(model):
        raise UsageError(f"{path} does not name the store optimizer of every tensor: give --optimizer")
    values = {root + n: t.detach().to(torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype)
              .contiguous().numpy() for n, t in model.items()}
    specs = {root + n: optim.normalize(spec if spec is not None else kept[n], root + n) for n in model}
    states = _states(checkpoint.get("optimizer"), root, values, specs, path)
    result = client.create_result(values, specs)
    if states:
        client.assign_state({n: values[n] for n in states}, states)
    return {"version": result["version"], "tensors": len(values), "created": len(result.get("created", [])),
            "existing": len(values) - len(result.get("created", [])), "states": len(states),
            "bytes": sum(a.nbytes for a in values.values())}


def _states(optimizer: Any, root: str, values: dict, specs: dict, path: str) -> dict[str, dict]:
    if optimizer is None:
        return {}
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "param_names" in g for g in groups):
        raise UsageError(f"{path}: the optimizer state_dict's param groups must list param_names (as raftps export "
                         "writes, and torch does for an optimizer made from named_parameters())")
    out: dict[str, dict] = {}
    for group in groups:
        for index, short in zip(group["params"], group["param_names"]):
            name = root + short
            if name not in values:
                raise UsageError(f"{path}: the optimizer names {short!r}, which the model does not hold")
            try:
                out[name] = optimizers.to_store_state(specs[name], optimizer["state"].get(index, {}), values[name],
                                                      f"{path}: {short!r}")
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    return out
